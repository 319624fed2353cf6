"""What the extraction reads: the target model (inspected, never loaded here), the completions, the layers."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specops import preflight
from specops.manifest import sha256_file
from specops.score.dflash_config import DrafterError, target_layer_ids
from specops.stage import StageError


@dataclass
class Record:
    index: int
    id: Any
    input_ids: Any  # numpy int64 [num_tokens]
    prompt_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class TargetInfo:
    path: Path
    config: dict[str, Any]
    num_layers: int
    hidden_size: int
    vocab_size: int
    identity: dict[str, Any]


def inspect_target(path: str | os.PathLike[str]) -> TargetInfo:
    """Read the target's config and a cheap weights fingerprint; loads no weights."""
    path = Path(path)
    if not path.is_dir():
        raise StageError(
            f"target model directory {path} does not exist: set target to the model directory "
            "(config.json + *.safetensors)"
        )
    config_path = path / "config.json"
    if not config_path.is_file():
        raise StageError(f"{path} has no config.json: target must be a transformers model directory")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise StageError(
            f"{config_path} is not valid JSON ({error}): the model directory is damaged"
        ) from error
    text = config.get("text_config") or config
    try:
        num_layers, hidden, vocab = (int(text[k]) for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    except (KeyError, TypeError, ValueError) as error:
        raise StageError(
            f"{config_path} lacks num_hidden_layers/hidden_size/vocab_size: not a decoder model config"
        ) from error
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise StageError(f"{path} has no *.safetensors weights: save the model with safe_serialization")
    identity = {
        "config_sha256": sha256_file(config_path),
        "weights": [
            {"name": w.name, "size": w.stat().st_size, "header_sha256": _safetensors_header_sha(w)}
            for w in weights
        ],
    }
    index = path / "model.safetensors.index.json"
    if index.is_file():
        identity["index_sha256"] = sha256_file(index)
    return TargetInfo(path.resolve(), config, num_layers, hidden, vocab, identity)


def _safetensors_header_sha(path: Path) -> str:
    """The header names every tensor with its dtype, shape and offsets: a cheap, strong fingerprint."""
    import hashlib
    import struct

    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise StageError(f"{path} is not a safetensors file (too short): the download is incomplete")
        (length,) = struct.unpack("<Q", raw)
        if length > path.stat().st_size:
            raise StageError(f"{path} is truncated (header says {length} bytes): download it again")
        return hashlib.sha256(raw + handle.read(length)).hexdigest()


def read_completions(directory: str | os.PathLike[str], vocab_size: int) -> list[Record]:
    directory = Path(directory)
    path = directory / "completions.jsonl" if directory.is_dir() else directory
    if not path.is_file():
        raise StageError(
            f"{path} does not exist: run sglang_completions first or point completions at its "
            "output directory"
        )
    import numpy as np

    records: list[Record] = []
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise StageError(
                    f"{where} is not JSON ({error}): rerun sglang_completions, which fetches a "
                    f"damaged file again"
                ) from error
            if not isinstance(item, dict):
                raise StageError(f"{where} is not a JSON object: regenerate the completions")
            ids = []
            for key in ("prompt_ids", "output_ids"):
                value = item.get(key)
                if not isinstance(value, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in value
                ):
                    raise StageError(
                        f"{where}: '{key}' must be a list of token ids: regenerate the completions"
                    )
                ids.append(value)
            tokens = ids[0] + ids[1]
            if not tokens:
                raise StageError(f"{where} (id {item.get('id')!r}) has no tokens: drop it or regenerate")
            bad = [t for t in tokens if t < 0 or t >= vocab_size]
            if bad:
                raise StageError(
                    f"{where} (id {item.get('id')!r}) has token id {bad[0]} outside the "
                    f"target's "
                    f"vocabulary (0-{vocab_size - 1}): the completions come from another model"
                )
            records.append(
                Record(len(records), item.get("id", len(records)), np.asarray(tokens, np.int64), len(ids[0]))
            )
    if not records:
        raise StageError(f"{path} holds no completions: run sglang_completions with some prompts")
    return records


def drafter_layer_ids(drafter: str | os.PathLike[str], num_layers: int) -> list[int]:
    path = Path(drafter) / "config.json"
    if not path.is_file():
        raise StageError(
            f"drafter config {path} does not exist: set drafter to the DFlash drafter directory "
            "or give layer_ids"
        )
    config = preflight.read_config(path, "drafter config")
    try:
        ids = target_layer_ids(config, str(path))
    except DrafterError as error:
        raise StageError(f"{error}, or give layer_ids") from None
    trained_for = config.get("num_target_layers")
    if trained_for is not None and int(trained_for) != num_layers:
        raise StageError(
            f"the drafter was trained on a {trained_for}-layer target but the target has "
            f"{num_layers} layers: check that target and drafter belong together"
        )
    return ids


def captured_layers(
    target_ids: Sequence[int], offsets: Sequence[int], num_layers: int
) -> tuple[list[int], list[int]]:
    """(captured ids, neighbours skipped as out of range); target ids themselves must be in range."""
    for k in target_ids:
        if not isinstance(k, int) or not 0 <= k < num_layers:
            raise StageError(
                f"target layer {k} out of range: the model has {num_layers} layers (0-{num_layers - 1})"
            )
    wanted = {k + o for k in target_ids for o in offsets}
    captured = sorted(k for k in wanted if 0 <= k < num_layers)
    return captured, sorted(k for k in wanted if not 0 <= k < num_layers)


def tokens_fingerprint(records: Sequence[Record]) -> str:
    """sha256 of every record's id, prompt length and token ids, in file order."""
    import hashlib

    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps([record.id, record.prompt_tokens, record.num_tokens]).encode())
        digest.update(record.input_ids.tobytes())
    return digest.hexdigest()
