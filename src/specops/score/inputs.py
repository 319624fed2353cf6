"""What the score stage reads before any model loads: the fingerprint of its inputs, SGLang's online
figures from the completions, and each drafter's config checked against the target and the hidden states.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specops import diagnostics as diag
from specops import window as win
from specops.manifest import file_identity, load_manifest
from specops.model_files import read_json, text_config
from specops.score.dflash_config import DrafterError, target_layer_ids
from specops.score.request import Options
from specops.stage import StageError

# The target's files that identify it cheaply; its weights are tens of GB and the hidden-state
# manifest already fingerprints the model they came from.
TARGET_IDENTITY_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors.index.json",
)


def _stage_output_identity(directory: Path) -> dict[str, Any]:
    """A stage output is identified by its manifest: what it was made from and the files it holds."""
    manifest = load_manifest(directory) or {}
    return {"inputs_fingerprint": manifest.get("inputs_fingerprint"), "files": manifest.get("files")}


def _checkpoint_identity(directory: Path) -> dict[str, Any]:
    files = sorted(p for p in directory.iterdir() if p.suffix in (".json", ".safetensors") and p.is_file())
    return {p.name: file_identity(p)["sha256"] for p in files}


def inputs_of(opts: Options) -> dict[str, Any]:
    """Everything the report depends on; reading it loads no model."""
    return {
        "hidden_states": _stage_output_identity(opts.hidden_states),
        "completions": _stage_output_identity(opts.completions) if opts.completions else None,
        "target": {
            name: file_identity(opts.target / name)["sha256"]
            for name in TARGET_IDENTITY_FILES
            if (opts.target / name).is_file()
        },
        "drafter": [_checkpoint_identity(path) for path in opts.drafter],
        "reference_drafter": _checkpoint_identity(opts.reference_drafter) if opts.reference_drafter else None,
        "window": win.read_window(opts.hidden_states),
        # An outage added later (the guard ended it) makes the report stale: it must show it.
        "outages": win.read_outages(opts.hidden_states),
        "options": {
            "device": opts.device,
            "dtype": opts.dtype,
            "diagnostics": sorted(opts.diagnostics),
            "layer_offset_tolerance": opts.layer_offset_tolerance,
            "detectable_difference": opts.detectable_difference,
            "server_drafter": opts.server_drafter,
            "step_costs": dict(opts.step_costs),
            "history": str(opts.history) if opts.history else None,
        },
    }


def online_acceptance(completions_dir: Path | None) -> dict[str, dict[str, Any]]:
    """Per completion id, SGLang's own figures when the server ran speculative decoding."""
    if completions_dir is None:
        return {}
    path = completions_dir / "completions.jsonl"
    if not path.is_file():
        raise StageError(f"{path} does not exist: the completions directory must hold completions.jsonl")
    online = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise StageError(
                f"{path} line {number} is not JSON ({error}): rerun sglang_completions"
            ) from error
        meta = record.get("meta_info") or {}
        verify_ct = meta.get("spec_verify_ct")
        if verify_ct:
            tokens = meta.get("completion_tokens", len(record.get("output_ids") or []))
            online[str(record["id"])] = {
                "tau": meta.get("spec_accept_length", tokens / verify_ct),
                "verify_ct": verify_ct,
                "completion_tokens": tokens,
            }
    return online


def drafter_layer_ids(config: Mapping[str, Any], name: str) -> list[int]:
    try:
        return target_layer_ids(config, f"the {name}'s config.json")
    except DrafterError as error:
        raise StageError(str(error)) from None


def require_layers(needed: list[int], captured: list[int], name: str, target_layers: int | None) -> None:
    if target_layers is not None:
        out = [k for k in needed if not 0 <= k < target_layers]
        if out:
            raise StageError(
                f"the {name}'s target layer {out[0]} is out of range: the target has "
                f"{target_layers} layers (0-{target_layers - 1}); the {name} was built for "
                "another target"
            )
    absent = [k for k in needed if k not in captured]
    if absent:
        raise StageError(
            f"the hidden states hold layers {captured} but the {name} needs {needed} "
            f"(missing {absent}): rerun extract_hidden_states with these target layer ids"
        )


def checked_config(
    path: Path, label: str, target: Path, target_config: Mapping[str, Any], captured: list[int]
) -> tuple[dict[str, Any], list[int]]:
    """A drafter's config and target layers, checked against the target and the hidden states before
    any model loads (a bad mask id or layer would only crash the engine)."""
    config = read_json(path / "config.json") or {}
    text = text_config(target_config)
    layer_ids = drafter_layer_ids(config, label)
    require_layers(layer_ids, captured, label, text.get("num_hidden_layers"))
    if text.get("hidden_size") and config.get("hidden_size") != text["hidden_size"]:
        raise StageError(
            f"the {label}'s hidden_size {config.get('hidden_size')} differs from the "
            f"target's {text['hidden_size']}: the {label} was built for another target"
        )
    error = diag.mask_token_error(diag.vocabulary_check(config, target))
    if error:
        raise StageError(error.replace("the drafter's", f"the {label}'s"))
    return config, layer_ids
