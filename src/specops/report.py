"""The score stage's report: report.json's structure, the Markdown summary and the PNG plots.

Pure functions on plain data (lists of acceptance lengths, dicts), so they are tested without models.
Acceptance length of one verify step = leading draft tokens equal to the target's + 1 (the bonus
token); tau = total accepted tokens / verify steps, the same ratio as SGLang's spec_accept_length
(completion_tokens / spec_verify_ct), so the offline and online figures compare directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

PLOT_TAU_PER_PROMPT = "tau_per_prompt.png"
PLOT_BY_POSITION = "acceptance_by_position.png"
PLOT_HISTOGRAM = "acceptance_histogram.png"
PLOT_FILES = (PLOT_TAU_PER_PROMPT, PLOT_BY_POSITION, PLOT_HISTOGRAM)

STATUSES = ("ok", "warning", "skipped")


def tau(accept_lengths: Iterable[int]) -> float | None:
    """Mean acceptance length over verify steps; None when there was no step."""
    lengths = list(accept_lengths)
    return sum(lengths) / len(lengths) if lengths else None


def histogram(accept_lengths: Iterable[int], block_size: int) -> dict[str, list[int]]:
    """How many verify steps accepted 1, 2, ..., block_size tokens."""
    counts = [0] * block_size
    for length in accept_lengths:
        if not 1 <= length <= block_size:
            raise ValueError(f"acceptance length {length} outside 1..{block_size} (block size {block_size})")
        counts[length - 1] += 1
    return {"length": list(range(1, block_size + 1)), "count": counts}


def acceptance_by_position(accept_lengths: Iterable[int], block_size: int) -> dict[str, list]:
    """Per draft position k (1..block_size-1): the share of steps whose k-th draft token was accepted
    (`rate`), and the same among steps that reached position k (`conditional`)."""
    lengths = list(accept_lengths)
    positions = list(range(1, block_size))
    accepted = [sum(1 for n in lengths if n - 1 >= k) for k in positions]
    reached = [len(lengths)] + accepted[:-1]
    return {
        "position": positions,
        "rate": [a / len(lengths) if lengths else None for a in accepted],
        "conditional": [a / r if r else None for a, r in zip(accepted, reached, strict=True)],
    }


def summarize(sequences: Sequence[Mapping[str, Any]], block_size: int) -> dict[str, Any]:
    """Overall figures for one drafter from its per-sequence acceptance lengths (steps pooled)."""
    pooled = [n for seq in sequences for n in seq["accept_lengths"]]
    return {
        "tau": tau(pooled),
        "steps": len(pooled),
        "tokens": sum(pooled),
        "block_size": block_size,
        "histogram": histogram(pooled, block_size),
        "acceptance_by_position": acceptance_by_position(pooled, block_size),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def online_summary(online: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """SGLang's spec figures pooled over the prompts that carry them (tokens / verify steps)."""
    rows = [row for row in online.values() if row.get("verify_ct")]
    if not rows:
        return None
    tokens = sum(row["completion_tokens"] for row in rows)
    steps = sum(row["verify_ct"] for row in rows)
    return {"tau": tokens / steps, "steps": steps, "tokens": tokens, "n_prompts": len(rows)}


SERVER_DRAFTERS = ("drafter", "reference", "")
# Online and offline counts are integers: their taus agree exactly or the runs differed.
ONLINE_AGREEMENT_TOLERANCE = 1e-9


def online_from_offline(accept_lengths: Sequence[int], num_draft_tokens: int | None = None) -> dict[str, Any]:
    """SGLang's per-request spec figures implied by the offline walk of the same greedy completion.

    The prefill produces the first output token without a verify step. SGLang counts it in
    completion_tokens but not in spec_verify_ct; the offline walk (specops.acceptance) starts after
    it. So, with steps = len(accept_lengths) and walked = sum(accept_lengths) = completion_tokens - 1:

        spec_verify_ct     = steps
        completion_tokens  = walked + 1
        spec_accept_length = (walked + 1) / steps = offline tau + 1 / steps
        spec_accept_rate   = (walked - steps) / (steps * (num_draft_tokens - 1))

    Every verify step appends its accepted drafts plus one target token (the bonus, or the token the
    request ended on), hence walked - steps accepted drafts. With no step, length and rate are 0 as
    SGLang reports them. The rate needs the server's block size (num_draft_tokens); without it the
    rate is None. Assumes at least one output token, which every completion with spec figures has.
    """
    steps = len(accept_lengths)
    walked = sum(accept_lengths)
    if not steps:
        rate: float | None = 0.0
    elif num_draft_tokens:
        rate = (walked - steps) / (steps * (num_draft_tokens - 1))
    else:
        rate = None
    return {"spec_verify_ct": steps, "completion_tokens": walked + 1,
            "spec_accept_length": (walked + 1) / steps if steps else 0, "spec_accept_rate": rate}


def online_comparison(online: Mapping[str, Mapping[str, Any]], scores: Mapping[str, Any] | None,
                      server_drafter: str) -> dict[str, Any] | None:
    """SGLang's online tau next to the offline tau of the drafter the server ran, on the same prompts.

    online: {id: {"tau", "verify_ct", "completion_tokens"}}; scores: that drafter's offline
    {"block_size", "sequences"}. expected_tau is what SGLang should report for these completions,
    from `online_from_offline` pooled (total completion tokens / total verify steps). None when the
    server's drafter is unknown or nothing is comparable.
    """
    if not server_drafter or scores is None:
        return None
    offline = {seq["id"]: seq["accept_lengths"] for seq in scores["sequences"]}
    ids = [i for i, row in online.items() if row.get("verify_ct") and i in offline]
    if not ids:
        return None
    expected = {i: online_from_offline(offline[i]) for i in ids}
    steps = sum(e["spec_verify_ct"] for e in expected.values())
    tokens = sum(e["completion_tokens"] for e in expected.values())
    online_steps = sum(online[i]["verify_ct"] for i in ids)
    online_tokens = sum(online[i]["completion_tokens"] for i in ids)
    mismatched = [
        {"id": i, "online_tau": online[i]["tau"], "expected_tau": expected[i]["spec_accept_length"],
         "online_verify_ct": online[i]["verify_ct"], "expected_verify_ct": expected[i]["spec_verify_ct"]}
        for i in ids
        if abs(online[i]["tau"] - expected[i]["spec_accept_length"]) > ONLINE_AGREEMENT_TOLERANCE
        or online[i]["verify_ct"] != expected[i]["spec_verify_ct"]
    ]
    return {
        "server_drafter": server_drafter,
        "n_prompts": len(ids),
        "online_tau": online_tokens / online_steps,
        "offline_tau": tau([n for i in ids for n in offline[i]]),
        "expected_tau": tokens / steps if steps else 0.0,
        "expected_steps": steps,
        "expected_tokens": tokens,
        "mismatched": mismatched,
        "not_scored": sorted(i for i, row in online.items() if row.get("verify_ct") and i not in offline),
    }


def build_report(
    run: Mapping[str, Any],
    drafter: Mapping[str, Any],
    reference: Mapping[str, Any] | None = None,
    online: Mapping[str, Mapping[str, Any]] | None = None,
    diagnostics: Sequence[Mapping[str, Any]] = (),
    comparison: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """report.json's content.

    drafter / reference: {"block_size": int, "sequences": [{"id": str, "accept_lengths": [int]}]};
    online: {id: {"tau", "verify_ct", "completion_tokens"}} from SGLang's meta_info;
    diagnostics: [{"name", "status", "message", "details"}];
    comparison: `online_comparison`'s result, shown with the online figures.
    """
    for diagnostic in diagnostics:
        if diagnostic["status"] not in STATUSES:
            raise ValueError(f"diagnostic {diagnostic['name']}: status {diagnostic['status']!r} "
                             f"is not one of {', '.join(STATUSES)}")
    online = online or {}
    overall = summarize(drafter["sequences"], drafter["block_size"])
    reference_overall = summarize(reference["sequences"], reference["block_size"]) if reference else None
    reference_by_id = {seq["id"]: seq for seq in reference["sequences"]} if reference else {}
    per_prompt = []
    for seq in drafter["sequences"]:
        ref = reference_by_id.get(seq["id"])
        row = {
            "id": seq["id"],
            "tau": tau(seq["accept_lengths"]),
            "steps": len(seq["accept_lengths"]),
            "tokens": sum(seq["accept_lengths"]),
            "reference_tau": tau(ref["accept_lengths"]) if ref else None,
            "online_tau": online.get(seq["id"], {}).get("tau"),
        }
        row["ratio"] = ratio(row["tau"], row["reference_tau"])
        per_prompt.append(row)
    return {
        "schema_version": SCHEMA_VERSION,
        "run": dict(run),
        "overall": overall,
        "reference": reference_overall,
        "ratio": ratio(overall["tau"], reference_overall["tau"] if reference_overall else None),
        "online": online_summary(online),
        "online_comparison": dict(comparison) if comparison else None,
        "per_prompt": per_prompt,
        "diagnostics": [dict(d) for d in diagnostics],
        "warnings": [f"{d['name']}: {d['message']}" for d in diagnostics if d["status"] == "warning"],
    }


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def verdict(report: Mapping[str, Any]) -> str:
    """One line: the drafter's tau, against the reference and SGLang's online figure when known."""
    line = f"drafter tau {_fmt(report['overall']['tau'])}"
    if report.get("reference"):
        line += f" vs reference {_fmt(report['reference']['tau'])} ({_fmt(report['ratio'])}x)"
    else:
        line += " (no reference drafter given)"
    if report.get("online"):
        line += f"; SGLang online tau {_fmt(report['online']['tau'])}"
    warned = [d["name"] for d in report["diagnostics"] if d["status"] == "warning"]
    if warned:
        line += f"; {len(warned)} diagnostic{'s' if len(warned) > 1 else ''} warn: {', '.join(warned)}"
    return line


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Mapping[str, Any], plots: Sequence[str] = PLOT_FILES) -> str:
    """report.md: the verdict first, then diagnostics, figures, plots (relative links), per prompt."""
    run = report["run"]
    overall, reference, online = report["overall"], report.get("reference"), report.get("online")
    lines = [f"# Drafter acceptance: {_cell(run.get('drafter', 'drafter'))}", "",
             f"**{verdict(report)}**", ""]
    lines += [
        f"- target: `{run.get('target')}`",
        f"- drafter: `{run.get('drafter')}`",
        f"- reference drafter: `{run.get('reference_drafter')}`" if run.get("reference_drafter")
        else "- reference drafter: none",
        f"- hidden states: `{run.get('hidden_states')}` (gated_delta_rule backend: "
        f"{run.get('hidden_state_backend', {}).get('gated_delta_rule', 'unknown')})",
        f"- scored on {run.get('device')} in {run.get('dtype')}, block size {overall['block_size']}",
        "",
        "## Diagnostics",
        "",
    ]
    if not report["diagnostics"]:
        lines.append("No diagnostics were run.")
    for d in report["diagnostics"]:
        mark = {"ok": "OK", "warning": "WARNING", "skipped": "skipped"}[d["status"]]
        lines.append(f"- **{d['name']}: {mark}**: {d['message']}")
    lines += ["", "## Overall", "", "| | tau | verify steps | accepted tokens |", "| --- | --- | --- | --- |"]
    lines.append(f"| drafter | {_fmt(overall['tau'])} | {overall['steps']} | {overall['tokens']} |")
    if reference:
        lines.append(f"| reference | {_fmt(reference['tau'])} | {reference['steps']} | "
                     f"{reference['tokens']} |")
    if online:
        plural = "s" if online["n_prompts"] != 1 else ""
        lines.append(f"| SGLang online ({online['n_prompts']} prompt{plural}) | {_fmt(online['tau'])} | "
                     f"{online['steps']} | {online['tokens']} |")
    comparison = report.get("online_comparison")
    if comparison:
        lines.append(f"| {comparison['server_drafter']} offline, counted as SGLang counts "
                     f"({comparison['n_prompts']} prompts) | {_fmt(comparison['expected_tau'], 4)} | "
                     f"{comparison['expected_steps']} | {comparison['expected_tokens']} |")
        lines += ["", "SGLang counts the prefill's token in completion_tokens but not in spec_verify_ct, so "
                  "it reports offline tau + 1 / steps per completion "
                  f"(the {comparison['server_drafter']}'s offline tau on these prompts: "
                  f"{_fmt(comparison['offline_tau'], 4)})."]
    titles = {
        PLOT_TAU_PER_PROMPT: "tau per prompt",
        PLOT_BY_POSITION: "acceptance by position in the block",
        PLOT_HISTOGRAM: "acceptance-length histogram",
    }
    lines += ["", "## Plots", ""]
    for name in plots:
        lines += [f"![{titles.get(name, name)}]({name})", ""]
    lines += ["## Acceptance by position", "", "| position | drafter | reference |", "| --- | --- | --- |"]
    by_pos = overall["acceptance_by_position"]
    ref_rate = reference["acceptance_by_position"]["rate"] if reference else [None] * len(by_pos["rate"])
    for k, rate, ref in zip(by_pos["position"], by_pos["rate"], ref_rate, strict=False):
        lines.append(f"| {k} | {_fmt(rate, 3)} | {_fmt(ref, 3)} |")
    lines += ["", "## Per prompt", "", "| prompt | steps | tau | reference tau | ratio | SGLang online tau |",
              "| --- | --- | --- | --- | --- | --- |"]
    for row in report["per_prompt"]:
        lines.append(f"| {_cell(row['id'])} | {row['steps']} | {_fmt(row['tau'])} | "
                     f"{_fmt(row['reference_tau'])} "
                     f"| {_fmt(row['ratio'])} | {_fmt(row['online_tau'])} |")
    versions = run.get("versions") or {}
    if versions:
        lines += ["", "## Versions", "", ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))]
    return "\n".join(lines) + "\n"


def render_plots(report: Mapping[str, Any], out_dir: str | Path) -> list[str]:
    """Write the three PNGs into out_dir (atomically) and return their file names."""
    import io

    import matplotlib

    matplotlib.use("Agg")  # no display on the hosts that score
    import matplotlib.pyplot as plt

    from specops.manifest import atomic_write_bytes

    out_dir = Path(out_dir)
    overall, reference = report["overall"], report.get("reference")
    drafter_label, reference_label = "drafter", "reference"

    def save(fig, name: str) -> None:
        buffer = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buffer, format="png", dpi=110)
        plt.close(fig)
        atomic_write_bytes(out_dir / name, buffer.getvalue())

    rows = report["per_prompt"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(rows) + 2), 4))
    x = list(range(len(rows)))
    width = 0.4 if reference else 0.8
    ax.bar([i - width / 2 if reference else i for i in x], [r["tau"] or 0 for r in rows], width,
           label=f"{drafter_label} (tau {_fmt(overall['tau'])})")
    if reference:
        ax.bar([i + width / 2 for i in x], [r["reference_tau"] or 0 for r in rows], width,
               label=f"{reference_label} (tau {_fmt(reference['tau'])})")
    online_points = [(i, r["online_tau"]) for i, r in zip(x, rows, strict=True)
                     if r["online_tau"] is not None]
    if online_points:
        ax.scatter([p[0] for p in online_points], [p[1] for p in online_points], marker="D", color="black",
                   zorder=3, label="SGLang online")
    ax.set_xticks(x)
    ax.set_xticklabels([str(r["id"]) for r in rows], rotation=60, ha="right", fontsize=7)
    tallest = max([r["tau"] or 0 for r in rows] + [r["reference_tau"] or 0 for r in rows]
                  + [p[1] for p in online_points] + [1.0])
    ax.set_ylim(0, tallest * 1.3)  # headroom so the legend does not hide the bars
    ax.set_ylabel("tau (accepted tokens per verify step)")
    ax.set_title("tau per prompt")
    ax.legend(fontsize=8, loc="upper right")
    save(fig, PLOT_TAU_PER_PROMPT)

    fig, ax = plt.subplots(figsize=(6, 4))
    by_pos = overall["acceptance_by_position"]
    ax.plot(by_pos["position"], [r or 0 for r in by_pos["rate"]], marker="o", label=drafter_label)
    if reference:
        ref_pos = reference["acceptance_by_position"]
        ax.plot(ref_pos["position"], [r or 0 for r in ref_pos["rate"]], marker="s", label=reference_label)
    ax.set_xticks(by_pos["position"])
    ax.set_xlabel("draft position in the block")
    ax.set_ylabel("share of verify steps accepting it")
    ax.set_ylim(0, 1.02)
    ax.set_title("acceptance by position")
    ax.legend(fontsize=8)
    save(fig, PLOT_BY_POSITION)

    fig, ax = plt.subplots(figsize=(6, 4))
    hist = overall["histogram"]
    shares = [c / overall["steps"] if overall["steps"] else 0 for c in hist["count"]]
    ax.bar([n - width / 2 if reference else n for n in hist["length"]], shares, width, label=drafter_label)
    if reference:
        ref_hist = reference["histogram"]
        ref_shares = [c / reference["steps"] if reference["steps"] else 0 for c in ref_hist["count"]]
        ax.bar([n + width / 2 for n in ref_hist["length"]], ref_shares, width, label=reference_label)
    ax.set_xticks(hist["length"])
    ax.set_xlabel("acceptance length (tokens per verify step, bonus included)")
    ax.set_ylabel("share of verify steps")
    ax.set_title("acceptance-length histogram")
    ax.legend(fontsize=8)
    save(fig, PLOT_HISTOGRAM)
    return list(PLOT_FILES)
