"""What a finished extraction leaves: the manifest, and the summary the stage returns."""

from __future__ import annotations

import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specops.extract.prepared import Prepared
from specops.extract.request import STAGE
from specops.extract.shards import ResumeState, ShardPlan
from specops.manifest import MANIFEST_NAME, write_manifest
from specops.versions import installed_versions


def library_versions() -> dict[str, str | None]:
    libraries = (
        "torch",
        "transformers",
        "safetensors",
        "triton",
        "fla-core",
        "flash-linear-attention",
        "causal-conv1d",
        "numpy",
    )
    return {"python": platform.python_version(), **installed_versions(libraries)}


def write_extraction_manifest(
    prep: Prepared,
    state: ResumeState,
    backend: dict[str, Any],
    parity: Any,
    progress: dict[str, Any],
    parallel: dict[str, Any],
) -> dict[str, Any]:
    """The manifest of a finished extraction, on one device or several."""
    return finish_manifest(
        prep.out_dir,
        prep.shards,
        state,
        prep.inputs,
        layer_ids=prep.layer_ids,
        target_layer_ids=prep.target_layer_ids,
        capture_offsets=prep.req["capture_offsets"],
        skipped_layer_ids=prep.skipped_layer_ids,
        dtype=prep.dtype_name,
        hidden_size=prep.target.hidden_size,
        num_layers=prep.target.num_layers,
        target={"path": str(prep.target.path), **prep.target.identity},
        completions={"path": str(prep.completions_path.resolve()), **prep.inputs["completions"]},
        backend=backend,
        versions=library_versions(),
        parity=parity,
        progress={k: round(v, 3) if isinstance(v, float) else v for k, v in progress.items()},
        parallel=parallel,
    )


def finish_manifest(
    out_dir: Path, shards: Sequence[ShardPlan], state: ResumeState, inputs: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    records = sorted(
        (
            {
                "id": r.id,
                "index": r.index,
                "shard": s.name,
                "num_tokens": r.num_tokens,
                "prompt_tokens": r.prompt_tokens,
            }
            for s in shards
            for r in s.records
        ),
        key=lambda r: r["index"],
    )
    names = [s.name for s in shards]
    manifest = write_manifest(
        out_dir,
        STAGE,
        inputs,
        names,
        digests={n: state.shards[n] for n in names if n in state.shards},
        records=records,
        num_records=len(records),
        num_tokens=sum(r["num_tokens"] for r in records),
        prompt_tokens=sum(r["prompt_tokens"] for r in records),
        output_tokens=sum(r["num_tokens"] - r["prompt_tokens"] for r in records),
        **extra,
    )
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
