"""Diagnostics on what scoring measured: whether shifted target layers score better, whether SGLang's
online tau agrees with the offline walk, and what the acceptance pattern says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specops.diagnostics.finding import ONLINE_AGREEMENT, finding

LAYER_OFFSETS = (-1, 1)
# A shifted layer choice must beat the configured one by this fraction of tau to count as "clearly
# higher": scoring is deterministic, so what separates the choices is the drafter, not sampling noise.
DEFAULT_LAYER_OFFSET_TOLERANCE = 0.10
# Offsets whose taus all lie within this fraction of each other cannot tell the layers apart.
INCONCLUSIVE_SPREAD = 0.01
# Acceptance patterns (fractions of verify steps): see acceptance_pattern_check.
POSITION_ONE_NEAR_ZERO = 0.05
COLLAPSE_BEFORE, COLLAPSE_AFTER, COLLAPSE_MIN_STEPS = 0.5, 0.1, 10
FAR_BELOW_REFERENCE = 0.5


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
    margin that decided any of its drafts offline (specops.score.margins). Every differing prompt has
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
