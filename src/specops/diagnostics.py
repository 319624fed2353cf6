"""Checks that explain a low tau before anyone blames the drafter's training.

Each check returns one report entry {"name", "status": ok|warning|skipped, "message", "details"}.
The config and tokenizer checks read JSON and safetensors headers only: no model is loaded.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

DIAGNOSTICS = ("acceptance", "layer_offset", "backend", "vocabulary")
# Not selectable: it runs whenever the score request names the drafter the server ran.
ONLINE_AGREEMENT = "online_agreement"
LAYER_OFFSETS = (-1, 1)
# A shifted layer choice must beat the configured one by this fraction of tau to count as "clearly
# higher": scoring is deterministic, so what separates the choices is the drafter, not sampling noise.
DEFAULT_LAYER_OFFSET_TOLERANCE = 0.10
# Offsets whose taus all lie within this fraction of each other cannot tell the layers apart.
INCONCLUSIVE_SPREAD = 0.01
# From this transformers version on, the torch fallback of gated_delta_rule matches fla's kernels to
# the bf16 noise floor (transformers PR #47625, checked with 5.23.0: FACTS.md), so the backend no
# longer changes what a drafter sees.
FALLBACK_ALIGNED_TRANSFORMERS = (5, 23)
# Acceptance patterns (fractions of verify steps): see acceptance_pattern_check.
POSITION_ONE_NEAR_ZERO = 0.05
COLLAPSE_BEFORE, COLLAPSE_AFTER, COLLAPSE_MIN_STEPS = 0.5, 0.1, 10
FAR_BELOW_REFERENCE = 0.5


def finding(name: str, status: str, message: str, **details: Any) -> dict[str, Any]:
    return {"name": name, "status": status, "message": message, "details": details}


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


def shifted_layer_ids(target_layer_ids: Sequence[int], offset: int) -> list[int]:
    return [layer + offset for layer in target_layer_ids]


def layer_offset_check(
    score: Callable[[list[int]], float | None],
    captured_layer_ids: Sequence[int],
    target_layer_ids: Sequence[int],
    base_tau: float | None,
    tolerance: float = DEFAULT_LAYER_OFFSET_TOLERANCE,
    offsets: Sequence[int] = LAYER_OFFSETS,
) -> dict[str, Any]:
    """Score the drafter with every target layer id shifted by each offset; warn when a shift scores
    more than `tolerance` (a fraction of tau) above the configured ids: an off-by-one in how the
    drafter's training read the layers (HF hidden_states[k + 1] is layer k)."""
    captured = set(captured_layer_ids)
    taus: dict[str, float | None] = {"0": base_tau}
    missing: dict[str, list[int]] = {}
    for offset in offsets:
        ids = shifted_layer_ids(target_layer_ids, offset)
        absent = [layer for layer in ids if layer not in captured]
        if absent:
            missing[f"{offset:+d}"] = absent
            continue
        taus[f"{offset:+d}"] = score(ids)
    details = {
        "tau_by_offset": taus,
        "target_layer_ids": list(target_layer_ids),
        "captured_layer_ids": sorted(captured),
        "missing_layers": missing,
        "tolerance": tolerance,
    }
    if len(taus) == 1:
        return finding(
            "layer_offset",
            "skipped",
            f"the hidden states hold layers {sorted(captured)} only, not the drafter's target layers "
            f"{list(target_layer_ids)} shifted by -1 and +1; extract with capture_offsets: [-1, 0, 1] "
            "(extract_hidden_states) to run this check",
            **details,
        )
    if base_tau is None:
        return finding("layer_offset", "skipped", "no verify step was scored, nothing to compare", **details)
    shifted = {k: tau for k, tau in taus.items() if k != "0" and tau is not None}
    best_key = max(shifted, key=shifted.__getitem__, default=None)
    scores = ", ".join(f"{k}: {v:.2f}" for k, v in taus.items() if v is not None)
    scored = [v for v in taus.values() if v is not None]
    if max(scored) - min(scored) <= INCONCLUSIVE_SPREAD * max(scored):
        return finding(
            "layer_offset",
            "inconclusive",
            f"every layer offset scores the same (tau by offset {scores}): the check cannot tell which "
            "layers the drafter was trained on; a drafter that accepts nothing at any layer choice scores "
            "alike everywhere (see the acceptance diagnosis)",
            **details,
        )
    if best_key is not None and shifted[best_key] > base_tau * (1 + tolerance):
        offset = int(best_key)
        return finding(
            "layer_offset",
            "warning",
            f"the drafter scores clearly higher with its target layers shifted by {best_key} "
            f"(tau {shifted[best_key]:.2f} vs {base_tau:.2f} at {list(target_layer_ids)}; {scores}): its "
            f"training most likely read layer ids {shifted_layer_ids(target_layer_ids, offset)}, an "
            "off-by-one between a layer id and HF's hidden_states index (layer k is hidden_states[k + 1]); "
            "fix dflash_config.target_layer_ids or how the trainer indexes the hidden states",
            **details,
        )
    skipped = f"; offsets {', '.join(missing)} not captured" if missing else ""
    return finding(
        "layer_offset",
        "ok",
        f"the configured target layers score best within a tolerance of "
        f"{tolerance:.0%} (tau by offset {scores}){skipped}",
        **details,
    )


# A greedy draft decided by less than this many logits can flip between kernels and dtypes (bf16
# rounding of logits of magnitude ~10-30 alone moves them by 0.06-0.125).
NEAR_TIE_LOGITS = 0.5
# A flipped draft changes one step and the walk after it, not a prompt's tau wholesale: a prompt whose
# online tau is further than this fraction from the offline walk's is not a near-tie.
NEAR_TIE_MAX_TAU_CHANGE = 0.2


def online_agreement_check(
    comparison: Mapping[str, Any] | None,
    server_drafter: str,
    tolerance: float = 1e-9,
    margins: Mapping[str, Mapping[str, Any]] | None = None,
    near_tie: float = NEAR_TIE_LOGITS,
) -> dict[str, Any]:
    """SGLang's online tau against the offline tau of the drafter the server ran (report.online_comparison).

    Under greedy decoding they agree exactly once the prefill's token is counted as SGLang counts
    it (report.online_from_offline), unless a greedy draft was a near-tie: across kernels and dtypes
    a draft whose logit margin is tiny can flip. margins: per differing prompt, the smallest logit
    margin that decided any of its drafts offline (specops.margins). Every differing prompt has
    one below `near_tie` and an online tau within NEAR_TIE_MAX_TAU_CHANGE of the offline walk's -> a
    near-tie (ok); any other -> a configuration error (the server ran another drafter, block size,
    target or sampling than the ones scored).
    """
    if comparison is None:
        return finding(
            ONLINE_AGREEMENT,
            "skipped",
            f"no completion carries SGLang's spec figures (spec_verify_ct) for a prompt the "
            f"{server_drafter} was scored on: nothing to compare",
            server_drafter=server_drafter,
        )
    details = dict(comparison)
    online, expected = comparison["online_tau"], comparison["expected_tau"]
    numbers = (
        f"SGLang online tau {online:.6f} vs {expected:.6f} from the {server_drafter}'s offline walk "
        f"(offline tau {comparison['offline_tau']:.6f}, + the prefill token SGLang counts) "
        f"over {comparison['n_prompts']} prompts"
    )
    if abs(online - expected) <= tolerance and not comparison["mismatched"]:
        return finding(ONLINE_AGREEMENT, "ok", f"{numbers}: they agree", classification="agree", **details)
    bad = comparison["mismatched"]
    differ = (
        f"{len(bad)} prompt{'s' if len(bad) != 1 else ''} differ, e.g. "
        f"{bad[0]['id'] if bad else 'in the pooled figure'}"
    )
    config_fix = (
        f"check that the server ran the {server_drafter} with its block size "
        "(--speculative-num-draft-tokens), the same target, greedy sampling, and that the hidden "
        "states came from those completions"
    )
    margins = margins or {}
    known = {row["id"]: margins[row["id"]] for row in bad if row["id"] in margins}
    details["margins"] = {key: dict(value) for key, value in known.items()}
    details["near_tie_logits"] = near_tie
    if bad and len(known) == len(bad):
        change = {
            row["id"]: abs(row["online_tau"] - row["expected_tau"]) / max(row["expected_tau"], 1e-9)
            for row in bad
        }
        wide = [
            key
            for key, m in known.items()
            if m["closest"] is None or m["closest"] > near_tie or change[key] > NEAR_TIE_MAX_TAU_CHANGE
        ]
        if not wide:
            smallest = min(m["closest"] for m in known.values())
            return finding(
                ONLINE_AGREEMENT,
                "ok",
                f"{numbers}: {differ}, each at a near-tie (a draft decided by at most {near_tie} logits; "
                f"smallest {smallest:.3f}): another kernel or dtype can flip such a greedy draft, so this "
                "is not a configuration error",
                classification="near_tie",
                **details,
            )
        return finding(
            ONLINE_AGREEMENT,
            "warning",
            f"{numbers}: {differ}; prompt{'s' if len(wide) != 1 else ''} {', '.join(map(str, wide[:5]))} "
            f"had no draft within {near_tie} logits of flipping or differ by more than "
            f"{NEAR_TIE_MAX_TAU_CHANGE:.0%} in tau, so no near-tie explains it: a configuration error; "
            f"{config_fix}",
            classification="configuration",
            **details,
        )
    return finding(
        ONLINE_AGREEMENT,
        "warning",
        f"{numbers}: they disagree ({differ}); under temperature 0 they must be equal up to near-ties, "
        f"which could not be measured here: {config_fix}",
        classification="unmeasured",
        **details,
    )


def _reached(histogram: Mapping[str, list[int]], position: int) -> int:
    """Verify steps whose draft reached position k: those that accepted the k - 1 drafts before it."""
    return sum(c for n, c in zip(histogram["length"], histogram["count"], strict=True) if n >= position)


def acceptance_pattern_check(
    overall: Mapping[str, Any], reference: Mapping[str, Any] | None, per_prompt: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Name the cause a drafter's acceptance figures point to, in order of how much they explain.

    - position-1 acceptance near zero: the drafter never predicts even the next token (untrained or
      wrong weights, an embedding/lm_head of another target, a wrong mask token); hidden states or
      layers would lower the reference on the same states too.
    - acceptance collapsing after position k (conditional acceptance >= 0.5 at k, <= 0.1 at k + 1):
      the drafter was trained for a shorter block, or with another block layout.
    - tau far below the reference on every prompt (systematic: configuration or training) vs on some
      (those prompts are outside what the drafter learnt).
    """
    steps = overall["steps"]
    by_pos = overall["acceptance_by_position"]
    details: dict[str, Any] = {
        "position_1": by_pos["rate"][0] if by_pos["rate"] else None,
        "conditional": by_pos["conditional"],
        "cause": None,
    }
    if not steps:
        return finding("acceptance", "skipped", "no verify step was scored, nothing to read", **details)
    problems: list[str] = []
    causes: list[str] = []
    reference_note = ""
    if reference and reference.get("tau"):
        ref_pos = reference["acceptance_by_position"]["rate"]
        reference_note = (
            f"; the reference scores tau {reference['tau']:.2f} (position-1 acceptance "
            f"{ref_pos[0]:.3f}) on the same hidden states, so states, layers and backend "
            "are usable"
        )
    position_1 = details["position_1"] or 0.0
    if position_1 < POSITION_ONE_NEAR_ZERO:
        problems.append(
            f"position-1 acceptance is {position_1:.3f}: the drafter almost never predicts even the next "
            "token; untrained or wrong weights, an embedding/lm_head of another target, or a wrong "
            f"mask_token_id{reference_note}"
        )
        causes.append(
            f"position-1 acceptance {position_1:.3f} (untrained or wrong weights, embedding/head "
            "or mask token)"
        )
    else:
        conditional = by_pos["conditional"]
        for k in range(1, len(conditional)):
            before, after = conditional[k - 1], conditional[k]
            reached = _reached(overall["histogram"], k + 1)
            if (
                before is not None
                and after is not None
                and before >= COLLAPSE_BEFORE
                and after <= COLLAPSE_AFTER
                and reached >= COLLAPSE_MIN_STEPS
            ):
                problems.append(
                    f"acceptance collapses after position {k} (conditional acceptance {before:.2f} at "
                    f"position {k}, {after:.2f} at {k + 1} over {reached} steps): the drafter was most "
                    f"likely trained with block size {k + 1} or another block layout than the scored "
                    f"block size {overall['block_size']}"
                )
                causes.append(f"acceptance collapses after position {k} (trained for a shorter block?)")
                details["collapse_after"] = k
                break
    compared = [row for row in per_prompt if row.get("ratio") is not None]
    below = [row for row in compared if row["ratio"] < FAR_BELOW_REFERENCE]
    details["prompts_far_below_reference"] = [row["id"] for row in below]
    if compared and below and len(below) == len(compared):
        worst = max(row["ratio"] for row in below)
        problems.append(
            f"tau is far below the reference on every prompt (ratio at most {worst:.2f}): a "
            "systematic cause (configuration or training), not a few hard prompts"
        )
        causes.append("far below the reference on every prompt (systematic)")
    elif below:
        ids = ", ".join(str(row["id"]) for row in below[:5]) + (" ..." if len(below) > 5 else "")
        problems.append(
            f"tau is far below the reference on {len(below)} of {len(compared)} prompts ({ids}) "
            "and close on the rest: those prompts lie outside what the drafter learnt"
        )
        causes.append(
            f"far below the reference on {len(below)} of {len(compared)} prompts (prompt-dependent)"
        )
    if problems:
        details["cause"] = causes[0]
        return finding("acceptance", "warning", "; ".join(problems), **details)
    return finding(
        "acceptance",
        "ok",
        f"position-1 acceptance {position_1:.3f}, no collapse along the block"
        + (", no prompt far below the reference" if compared else ""),
        **details,
    )
