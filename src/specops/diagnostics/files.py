"""Diagnostics that read files only, no model loaded: which gated_delta_rule backend made the hidden
states, and whether the drafter's vocabulary and mask token fit the target.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specops.diagnostics.finding import finding
from specops.model_files import read_json, safetensors_shapes, text_config

# From this transformers version on, the torch fallback of gated_delta_rule matches fla's kernels to
# the bf16 noise floor (transformers PR #47625, checked with 5.23.0: FACTS.md), so the backend no
# longer changes what a drafter sees.
FALLBACK_ALIGNED_TRANSFORMERS = (5, 23)


def _rows(shapes: Mapping[str, list[int]], suffix: str) -> int | None:
    for name, shape in shapes.items():
        if name.endswith(suffix):
            return shape[0]
    return None


def _version(text: str | None) -> tuple[int, ...] | None:
    parts = []
    for piece in (text or "").split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts) if parts else None


def backend_check(
    hidden_manifest: Mapping[str, Any],
    target_config: Mapping[str, Any],
    reference_tau: float | None = None,
    drafter_tau: float | None = None,
) -> dict[str, Any]:
    """Warn when the hidden states came from the torch fallback of gated_delta_rule and that can matter.

    It matters when the extraction's transformers predates the fallback's alignment with fla's kernels
    (drafters are trained on fla-kernel features) and no reference drafter scored well on the same
    states: a reference that does shows the states are usable, so the backend cannot explain a gap.
    """
    backend = dict(hidden_manifest.get("backend") or {})
    layer_types = text_config(target_config).get("layer_types") or []
    hybrid = any(kind == "linear_attention" for kind in layer_types)
    versions = hidden_manifest.get("versions") or {}
    transformers_version: str | None = versions.get("transformers")
    details = {
        "backend": backend,
        "target_has_linear_attention": hybrid,
        "transformers": transformers_version,
    }
    kernel = backend.get("gated_delta_rule")
    if not hybrid:
        return finding(
            "backend",
            "ok",
            "the target has no Gated DeltaNet layers: the kernel backend does "
            f"not apply (extraction ran on {backend.get('device', 'an unrecorded device')})",
            **details,
        )
    if kernel == "fla":
        return finding(
            "backend",
            "ok",
            "hidden states were extracted with fla's gated_delta_rule kernels "
            f"on {backend.get('device', 'an unrecorded device')}, as drafters are trained",
            **details,
        )
    if kernel == "torch":
        version = _version(transformers_version)
        if version is not None and version >= FALLBACK_ALIGNED_TRANSFORMERS:
            return finding(
                "backend",
                "ok",
                f"hidden states came from the torch fallback of gated_delta_rule with "
                f"transformers {details['transformers']}, which matches fla's kernels from "
                f"{'.'.join(map(str, FALLBACK_ALIGNED_TRANSFORMERS))} on: the backend does not change "
                "this tau",
                **details,
            )
        if reference_tau is not None and drafter_tau is not None and reference_tau > drafter_tau:
            return finding(
                "backend",
                "ok",
                f"hidden states came from the torch fallback of gated_delta_rule "
                f"(transformers {details['transformers'] or 'unrecorded'}), but the reference drafter "
                f"scores {reference_tau:.2f} on the same states: the backend does not explain the "
                f"drafter's {drafter_tau:.2f}",
                **details,
            )
        return finding(
            "backend",
            "warning",
            "HIDDEN STATES CAME FROM THE TORCH FALLBACK of gated_delta_rule "
            f"(device {backend.get('device', 'unrecorded')}, transformers "
            f"{details['transformers'] or 'unrecorded'}), not fla's kernels that GPU-trained drafters "
            "saw. Older transformers' fallback differs enough to make a good drafter look broken; "
            "re-extract on a GPU with fla installed (extract_hidden_states after fla_env) before "
            "trusting this tau.",
            **details,
        )
    return finding(
        "backend",
        "warning",
        "the extraction manifest does not record which gated_delta_rule "
        "backend ran (fla or the torch fallback); re-extract with the current "
        "extract_hidden_states so the report can tell",
        **details,
    )


def vocabulary_check(drafter_config: Mapping[str, Any], target_dir: str | Path) -> dict[str, Any]:
    """Drafter vocab_size against the target's, lm_head and embedding rows; the mask token's identity."""
    target_dir = Path(target_dir)
    target_config = text_config(read_json(target_dir / "config.json") or {})
    shapes = safetensors_shapes(target_dir)
    dflash = drafter_config.get("dflash_config") or {}
    mask_id = dflash.get("mask_token_id", drafter_config.get("mask_token_id"))
    details: dict[str, Any] = {
        "drafter_vocab_size": drafter_config.get("vocab_size"),
        "target_vocab_size": target_config.get("vocab_size"),
        "lm_head_rows": _rows(shapes, "lm_head.weight"),
        "embed_rows": _rows(shapes, "embed_tokens.weight"),
        "mask_token_id": mask_id,
    }
    if details["lm_head_rows"] is None and target_config.get("tie_word_embeddings"):
        details["lm_head_rows"] = details["embed_rows"]
    problems = []
    sizes = {
        k: details[k]
        for k in ("drafter_vocab_size", "target_vocab_size", "lm_head_rows", "embed_rows")
        if details[k] is not None
    }
    if len(set(sizes.values())) > 1:
        problems.append(
            "vocabulary sizes disagree ("
            + ", ".join(f"{k} {v}" for k, v in sizes.items())
            + "): the drafter was built for another target or tokenizer"
        )
    target_sizes = [v for k, v in sizes.items() if k != "drafter_vocab_size"]
    rows = min(target_sizes) if target_sizes else None
    if mask_id is None:
        problems.append("the drafter's config has no dflash_config.mask_token_id")
    elif rows is not None and not 0 <= mask_id < rows:
        problems.append(f"mask_token_id {mask_id} is outside the target's vocabulary (0-{rows - 1})")
    else:
        token = tokenizer_entry(target_dir, mask_id)
        details["mask_token"] = token
        if token is None:
            details["tokenizer"] = "not found"
        elif token["kind"] == "ordinary":
            problems.append(
                f"mask_token_id {mask_id} is the ordinary token {token['content']!r} in the "
                "target's tokenizer, not a special or added token: the drafter's mask "
                "embedding is a real word's (check dflash_config.mask_token_id)"
            )
    if problems:
        return finding("vocabulary", "warning", "; ".join(problems), **details)
    mask_desc = {
        None: "within the vocabulary (the target has no tokenizer.json to name it)",
        "special": "a special token",
        "added": "an added token",
        "unused": "an embedding row no tokenizer token uses",
    }
    kind = (details.get("mask_token") or {}).get("kind")
    return finding(
        "vocabulary",
        "ok",
        f"drafter and target agree on {sizes.get('target_vocab_size', '?')} "
        f"tokens; mask_token_id {mask_id} is {mask_desc[kind]}",
        **details,
    )


def tokenizer_entry(target_dir: Path, token_id: int) -> dict[str, Any] | None:
    """What a token id is in the target's tokenizer: special, added, ordinary or unused; None if no
    tokenizer.json is there."""
    data = read_json(target_dir / "tokenizer.json")
    if data is None:
        return None
    for added in data.get("added_tokens", []):
        if added.get("id") == token_id:
            return {"content": added.get("content"), "kind": "special" if added.get("special") else "added"}
    decoder = (read_json(target_dir / "tokenizer_config.json") or {}).get("added_tokens_decoder") or {}
    if str(token_id) in decoder:
        entry = decoder[str(token_id)]
        return {"content": entry.get("content"), "kind": "special" if entry.get("special") else "added"}
    vocab = (data.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, dict):
        for content, index in vocab.items():
            if index == token_id:
                return {"content": content, "kind": "ordinary"}
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...] indexed by id
        if token_id < len(vocab):
            return {"content": vocab[token_id][0], "kind": "ordinary"}
    return {"content": None, "kind": "unused"}


def mask_token_error(check: Mapping[str, Any]) -> str | None:
    """The vocabulary problems that make scoring impossible (the engine would index out of range)."""
    details = check["details"]
    mask_id = details.get("mask_token_id")
    rows = [details[k] for k in ("lm_head_rows", "embed_rows", "target_vocab_size") if details.get(k)]
    if mask_id is None:
        return (
            "the drafter's config.json has no dflash_config.mask_token_id: set it to the mask token "
            "the drafter was trained with"
        )
    if rows and not 0 <= mask_id < min(rows):
        return (
            f"the drafter's mask_token_id {mask_id} is out of range: the target's embedding has "
            f"{min(rows)} rows (0-{min(rows) - 1}); the drafter was built for another target"
        )
    return None
