"""Checks that explain a low tau before anyone blames the drafter's training.

Each check returns one report entry {"name", "status": ok|warning|skipped, "message", "details"}.
The config and tokenizer checks read JSON and safetensors headers only: no model is loaded.

The checks live by what they read: files (configs, safetensors headers, the tokenizer), scores
(what scoring measured); the report entry's shape is in finding, and the reading of a model
directory in specops.model_files. The checks' names are importable from here.
"""

from __future__ import annotations

from specops.diagnostics.files import (
    FALLBACK_ALIGNED_TRANSFORMERS,
    backend_check,
    mask_token_error,
    tokenizer_entry,
    vocabulary_check,
)
from specops.diagnostics.finding import DIAGNOSTICS, ONLINE_AGREEMENT, finding
from specops.diagnostics.scores import (
    COLLAPSE_AFTER,
    COLLAPSE_BEFORE,
    COLLAPSE_MIN_STEPS,
    DEFAULT_LAYER_OFFSET_TOLERANCE,
    FAR_BELOW_REFERENCE,
    INCONCLUSIVE_SPREAD,
    LAYER_OFFSETS,
    NEAR_TIE_LOGITS,
    NEAR_TIE_MAX_TAU_CHANGE,
    POSITION_ONE_NEAR_ZERO,
    acceptance_pattern_check,
    layer_offset_check,
    online_agreement_check,
    shifted_layer_ids,
)

__all__ = [
    "COLLAPSE_AFTER",
    "COLLAPSE_BEFORE",
    "COLLAPSE_MIN_STEPS",
    "DEFAULT_LAYER_OFFSET_TOLERANCE",
    "DIAGNOSTICS",
    "FALLBACK_ALIGNED_TRANSFORMERS",
    "FAR_BELOW_REFERENCE",
    "INCONCLUSIVE_SPREAD",
    "LAYER_OFFSETS",
    "NEAR_TIE_LOGITS",
    "NEAR_TIE_MAX_TAU_CHANGE",
    "ONLINE_AGREEMENT",
    "POSITION_ONE_NEAR_ZERO",
    "acceptance_pattern_check",
    "backend_check",
    "finding",
    "layer_offset_check",
    "mask_token_error",
    "online_agreement_check",
    "shifted_layer_ids",
    "tokenizer_entry",
    "vocabulary_check",
]
