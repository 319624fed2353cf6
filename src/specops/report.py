"""The score stage's report: report.json's structure, the Markdown summary and the PNG plots.

Pure functions on plain data (lists of acceptance lengths, dicts), so they are tested without models.
Acceptance length of one verify step = leading draft tokens equal to the target's + 1 (the bonus
token); tau = total accepted tokens / verify steps, the same ratio as SGLang's spec_accept_length
(completion_tokens / spec_verify_ct), so the offline and online figures compare directly.

One drafter's report (`build_report`) is a section of the run's summary (`build_summary`), which
sets several drafters side by side; the Markdown comes from the Jinja2 templates in
specops/templates (layout there, figures here). The plots are drawn by specops.plots.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from specops import stats

# 3: tau intervals (overall.interval), the paired comparison with the reference (vs_reference) and
# between drafters (pairs).
SCHEMA_VERSION = 3

# One drafter's plots (in its own directory) and the summary's (in the score directory).
PLOT_TAU_PER_PROMPT = "tau_per_prompt.png"
PLOT_BY_POSITION = "acceptance_by_position.png"
PLOT_HISTOGRAM = "acceptance_histogram.png"
PLOT_FILES = (PLOT_TAU_PER_PROMPT, PLOT_BY_POSITION, PLOT_HISTOGRAM)
PLOT_TAU_BY_DRAFTER = "tau_by_drafter.png"
PLOT_TAU_TREND = "tau_trend.png"
PLOT_TITLES = {
    PLOT_TAU_PER_PROMPT: "tau per prompt",
    PLOT_BY_POSITION: "acceptance by position in the block",
    PLOT_HISTOGRAM: "acceptance-length histogram",
    PLOT_TAU_BY_DRAFTER: "tau by drafter",
    PLOT_TAU_TREND: "tau per drafter over past runs",
}
# Sections other stages add to report.json under their own key; each has a template
# templates/sections/<key>.md.j2 and is shown only when the key is present.
OPTIONAL_SECTIONS = ("window",)

# inconclusive: the check ran but its figures cannot tell (e.g. every layer offset scores the same).
STATUSES = ("ok", "warning", "inconclusive", "skipped")


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


def prompt_counts(sequences: Sequence[Mapping[str, Any]]) -> dict[str, tuple[int, int]]:
    """Each prompt's (accepted tokens, verify steps): what tau's interval resamples."""
    return {str(seq["id"]): (sum(seq["accept_lengths"]), len(seq["accept_lengths"])) for seq in sequences}


def tau_interval(counts: Mapping[str, tuple[int, int]]) -> list[float] | None:
    """The 95% interval of the pooled tau, prompts resampled (specops.stats)."""
    values = list(counts.values())
    return stats.tau_interval([t for t, _ in values], [s for _, s in values])


def paired(
    first: Mapping[str, tuple[int, int]],
    second: Mapping[str, tuple[int, int]],
    names: Sequence[str],
    detectable: float = stats.DETECTABLE_DIFFERENCE,
) -> dict[str, Any]:
    """The first drafter against the second on the prompts both scored (specops.stats.paired_comparison);
    detectable: the difference in tau it says how many prompts would resolve."""
    ids = [i for i in first if i in second]
    comparison = stats.paired_comparison(
        [first[i][0] for i in ids],
        [first[i][1] for i in ids],
        [second[i][0] for i in ids],
        [second[i][1] for i in ids],
        detectable=detectable,
    )
    return {"names": list(names), **comparison}


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
    completion_tokens but not in spec_verify_ct; the offline walk (specops.score.acceptance) starts after
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
    return {
        "spec_verify_ct": steps,
        "completion_tokens": walked + 1,
        "spec_accept_length": (walked + 1) / steps if steps else 0,
        "spec_accept_rate": rate,
    }


def online_comparison(
    online: Mapping[str, Mapping[str, Any]], scores: Mapping[str, Any] | None, server_drafter: str
) -> dict[str, Any] | None:
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
        {
            "id": i,
            "online_tau": online[i]["tau"],
            "expected_tau": expected[i]["spec_accept_length"],
            "online_verify_ct": online[i]["verify_ct"],
            "expected_verify_ct": expected[i]["spec_verify_ct"],
        }
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
    name: str = "drafter",
    detectable: float = stats.DETECTABLE_DIFFERENCE,
) -> dict[str, Any]:
    """One drafter's report (its section of report.json, and its own directory's report.json).

    drafter / reference: {"block_size": int, "sequences": [{"id": str, "accept_lengths": [int]}]};
    online: {id: {"tau", "verify_ct", "completion_tokens"}} from SGLang's meta_info;
    diagnostics: [{"name", "status", "message", "details"}];
    comparison: `online_comparison`'s result, shown with the online figures;
    detectable: the difference in tau the comparison with the reference sizes a run for.
    """
    for diagnostic in diagnostics:
        if diagnostic["status"] not in STATUSES:
            raise ValueError(
                f"diagnostic {diagnostic['name']}: status {diagnostic['status']!r} "
                f"is not one of {', '.join(STATUSES)}"
            )
    online = online or {}
    counts = prompt_counts(drafter["sequences"])
    overall = {**summarize(drafter["sequences"], drafter["block_size"]), "interval": tau_interval(counts)}
    reference_overall, vs_reference = None, None
    if reference:
        reference_counts = prompt_counts(reference["sequences"])
        reference_overall = {
            **summarize(reference["sequences"], reference["block_size"]),
            "interval": tau_interval(reference_counts),
        }
        vs_reference = paired(counts, reference_counts, (name, "reference"), detectable)
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
            "reference_steps": len(ref["accept_lengths"]) if ref else None,
            "online_tau": online.get(seq["id"], {}).get("tau"),
        }
        row["ratio"] = ratio(row["tau"], row["reference_tau"])
        per_prompt.append(row)
    return {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "run": dict(run),
        "overall": overall,
        "reference": reference_overall,
        "ratio": ratio(overall["tau"], reference_overall["tau"] if reference_overall else None),
        "vs_reference": vs_reference,
        "online": online_summary(online),
        "online_comparison": dict(comparison) if comparison else None,
        "per_prompt": per_prompt,
        "diagnostics": [dict(d) for d in diagnostics],
        "warnings": [f"{d['name']}: {d['message']}" for d in diagnostics if d["status"] == "warning"],
    }


def format_figure(value: float | None, digits: int = 2) -> str:
    """The figure with `digits` decimals, "n/a" for None or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _interval(value: Sequence[float] | None, digits: int = 2) -> str:
    """The interval written after its figure, as " [low, high]"; nothing where a run had too few
    prompts for one (specops.stats.MIN_PROMPTS)."""
    return f" [{format_figure(value[0], digits)}, {format_figure(value[1], digits)}]" if value else ""


def _tau(figures: Mapping[str, Any]) -> str:
    return format_figure(figures["tau"]) + _interval(figures.get("interval"))


def verdict(report: Mapping[str, Any]) -> str:
    """One line: the drafter's tau and its interval, against the reference (with the paired verdict:
    better, worse, or no difference shown at this size) and SGLang's online figure when known."""
    line = f"drafter tau {_tau(report['overall'])}"
    if report.get("reference"):
        line += f" vs reference {_tau(report['reference'])} ({format_figure(report['ratio'])}x)"
        if report.get("vs_reference"):
            line += f": {report['vs_reference']['verdict']}"
    else:
        line += " (no reference drafter given)"
    if report.get("online"):
        line += f"; SGLang online tau {format_figure(report['online']['tau'])}"
    warned = [d["name"] for d in report["diagnostics"] if d["status"] == "warning"]
    if warned:
        line += f"; {len(warned)} diagnostic{'s' if len(warned) > 1 else ''} warn: {', '.join(warned)}"
    causes = [
        d["details"]["cause"]
        for d in report["diagnostics"]
        if d["status"] == "warning" and (d.get("details") or {}).get("cause")
    ]
    if causes:
        line += f"; likely cause: {'; '.join(causes)}"
    return line


def comparison_rows(reports: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per drafter: the figures a user compares checkpoints or rivals by."""
    rows = []
    for report in reports:
        by_pos = report["overall"]["acceptance_by_position"]["rate"]
        speedup = report.get("speedup") or {}
        rows.append(
            {
                "name": report["name"],
                "tau": report["overall"]["tau"],
                "interval": report["overall"].get("interval"),
                "ratio": report.get("ratio"),
                "ratio_interval": (report.get("vs_reference") or {}).get("ratio_interval"),
                "vs_reference": (report.get("vs_reference") or {}).get("verdict"),
                "position_1": by_pos[0] if by_pos else None,
                "expected_speedup": speedup.get("expected"),
                "warnings": [d["name"] for d in report["diagnostics"] if d["status"] == "warning"],
            }
        )
    return rows


def summary_verdict(summary: Mapping[str, Any]) -> str:
    """One line for the run: the single drafter's verdict, or the best of several."""
    drafters = summary["drafters"]
    if len(drafters) == 1:
        return verdict(drafters[0])
    ranked = sorted(drafters, key=lambda d: d["overall"]["tau"] or 0, reverse=True)
    best, runner_up = ranked[0], ranked[1]
    line = f"{len(drafters)} drafters; best {best['name']} tau {_tau(best['overall'])}"
    if summary.get("reference"):
        line += f" vs reference {_tau(summary['reference'])} ({format_figure(best.get('ratio'))}x)"
        if best.get("vs_reference"):
            line += f": {best['vs_reference']['verdict']}"
    against = next(
        (p for p in summary.get("pairs") or [] if set(p["names"]) == {best["name"], runner_up["name"]}), None
    )
    if against:
        # The pair may be stored either way round: its verdict read from the best drafter's side.
        word = against["verdict"] if against["names"][0] == best["name"] else _flipped(against["verdict"])
        line += f"; vs {runner_up['name']}: {word}"
    warned = [d["name"] for d in drafters if any(x["status"] == "warning" for x in d["diagnostics"])]
    if warned:
        line += f"; diagnostics warn for {', '.join(warned)}"
    return line


def _flipped(word: str) -> str:
    return {stats.BETTER: stats.WORSE, stats.WORSE: stats.BETTER}.get(word, word)


def reference_pairs(reports: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each drafter's paired comparison with the reference, under the drafter's name."""
    return [
        {**report["vs_reference"], "names": [report["name"], "reference"]}
        for report in reports
        if report.get("vs_reference")
    ]


def drafter_pairs(
    reports: Sequence[Mapping[str, Any]], detectable: float = stats.DETECTABLE_DIFFERENCE
) -> list[dict[str, Any]]:
    """Every two drafters of the run compared on the same prompts, in the order they were given."""
    counts = [{str(r["id"]): (r["tokens"], r["steps"]) for r in report["per_prompt"]} for report in reports]
    return [
        paired(counts[i], counts[j], (reports[i]["name"], reports[j]["name"]), detectable)
        for i in range(len(reports))
        for j in range(i + 1, len(reports))
    ]


def build_summary(
    run: Mapping[str, Any],
    reports: Sequence[Mapping[str, Any]],
    speedup_model: Mapping[str, Any] | None = None,
    history: Mapping[str, Any] | None = None,
    detectable: float = stats.DETECTABLE_DIFFERENCE,
) -> dict[str, Any]:
    """report.json of the run: every drafter's report, the comparison, the speedup model, the history.

    The first drafter's figures also stand at the top level (overall, ratio, vs_reference,
    per_prompt, diagnostics, warnings), where a single-drafter report keeps them.
    """
    if not reports:
        raise ValueError("a summary needs at least one drafter's report")
    first = reports[0]
    summary = {
        "schema_version": SCHEMA_VERSION,
        "run": dict(run),
        "drafters": [dict(r) for r in reports],
        "comparison": comparison_rows(reports),
        "pairs": reference_pairs(reports) + drafter_pairs(reports, detectable),
        "reference": first.get("reference"),
        "online": first.get("online"),
        "online_comparison": next(
            (r["online_comparison"] for r in reports if r.get("online_comparison")), None
        ),
        "speedup_model": dict(speedup_model) if speedup_model else None,
        "history": dict(history) if history else None,
        "overall": first["overall"],
        "ratio": first.get("ratio"),
        "vs_reference": first.get("vs_reference"),
        "per_prompt": first["per_prompt"],
        "diagnostics": first["diagnostics"],
        "warnings": [f"{r['name']}: {w}" if len(reports) > 1 else w for r in reports for w in r["warnings"]],
    }
    summary["verdict"] = summary_verdict(summary)
    return summary


# ----------------------------------------------------------------------------------------------
# Markdown: the layout lives in specops/templates
# ----------------------------------------------------------------------------------------------


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _environment():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("specops", "templates"),
        undefined=jinja2.StrictUndefined,  # a misspelt field fails the render instead of printing ""
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(fmt=format_figure, cell=_cell, interval=_interval)
    env.globals.update(
        verdict=verdict,
        titles=PLOT_TITLES,
        unresolved=stats.UNRESOLVED,
        min_prompts=stats.MIN_PROMPTS,
        marks={"ok": "OK", "warning": "WARNING", "inconclusive": "INCONCLUSIVE", "skipped": "skipped"},
    )
    return env


def render_markdown(report: Mapping[str, Any], plots: Sequence[str] = PLOT_FILES) -> str:
    """One drafter's report.md: the verdict first, then diagnostics, figures, plots, per prompt."""
    return _environment().get_template("drafter.md.j2").render(report=report, plots=list(plots))


def render_summary(
    summary: Mapping[str, Any], plot_dirs: Mapping[str, str], plots: Sequence[str] = ()
) -> str:
    """The run's report.md: verdict, comparison, optional sections, speedup, history, each drafter.

    plot_dirs: drafter name -> its directory relative to report.md; plots: the summary's own PNGs.
    """
    env = _environment()
    present = set(env.list_templates())
    sections = [key for key in OPTIONAL_SECTIONS if summary.get(key) and f"sections/{key}.md.j2" in present]
    return env.get_template("report.md.j2").render(
        summary=summary, plot_dirs=plot_dirs, plots=list(plots), sections=sections
    )
