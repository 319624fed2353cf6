"""Reading a model directory without loading the model: its JSON files, the language model's config
inside a multimodal one, and its tensors' shapes from the safetensors headers.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The token embedding's and the output head's tensor names, as checkpoints spell them: what the scoring
# multiplies by (score/target_head.py), and the only weights a scoring host needs (shipping.py).
EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "embed_tokens.weight",
)
LM_HEAD_NAMES = (
    "lm_head.weight",
    "model.lm_head.weight",
    "language_model.lm_head.weight",
)


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: multimodal wrappers (model_type qwen3_5) nest it in text_config."""
    return config.get("text_config") or config


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def safetensors_shapes(model_dir: str | Path) -> dict[str, list[int]]:
    """Tensor name -> shape for every safetensors file of a checkpoint, read from the headers only."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        shapes.update({name: meta["shape"] for name, meta in header.items() if name != "__metadata__"})
    return shapes
