"""What a finished extraction leaves: the manifest, and the summary the stage returns."""

from __future__ import annotations

import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specops.extract.request import STAGE
from specops.extract.shards import ResumeState, ShardPlan
from specops.manifest import MANIFEST_NAME, write_manifest


def library_versions() -> dict[str, str | None]:
    from importlib import metadata

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "safetensors", "triton", "fla-core", "flash-linear-attention",
                 "causal-conv1d", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def finish_manifest(out_dir: Path, shards: Sequence[ShardPlan], state: ResumeState, inputs: dict[str, Any],
                    **extra: Any) -> dict[str, Any]:
    records = sorted(
        ({"id": r.id, "index": r.index, "shard": s.name, "num_tokens": r.num_tokens,
          "prompt_tokens": r.prompt_tokens} for s in shards for r in s.records),
        key=lambda r: r["index"])
    names = [s.name for s in shards]
    manifest = write_manifest(
        out_dir, STAGE, inputs, names, digests={n: state.shards[n] for n in names if n in state.shards},
        records=records,
        num_records=len(records),
        num_tokens=sum(r["num_tokens"] for r in records),
        prompt_tokens=sum(r["prompt_tokens"] for r in records),
        output_tokens=sum(r["num_tokens"] - r["prompt_tokens"] for r in records),
        **extra)
    state.remove()
    return manifest


def stage_result(manifest: dict[str, Any], out_dir: Path, changed: bool) -> dict[str, Any]:
    return {
        "changed": changed,
        "out_dir": str(out_dir),
        "manifest": str(out_dir / MANIFEST_NAME),
        "layer_ids": manifest.get("layer_ids"),
        "records": manifest.get("num_records"),
        "tokens": manifest.get("num_tokens"),
        "shards": sorted(manifest.get("files", {})),
        "backend": manifest.get("backend"),
        "parity": manifest.get("parity"),
        "progress": manifest.get("progress"),
        "parallel": manifest.get("parallel"),
    }
