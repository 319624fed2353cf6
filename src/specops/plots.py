"""The score report's PNG plots: one drafter's three, the comparison of drafters, the trend over runs.

matplotlib without a display (Agg); every file is written atomically.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specops import report as rep


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on the hosts that score
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> None:
    from specops.manifest import atomic_write_bytes

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def render_plots(report: Mapping[str, Any], out_dir: str | Path) -> list[str]:
    """Write one drafter's three PNGs into out_dir (atomically) and return their file names."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    overall, reference = report["overall"], report.get("reference")
    drafter_label, reference_label = report.get("name", "drafter"), "reference"

    def save(fig, name: str) -> None:
        _save(plt, fig, out_dir / name)

    rows = report["per_prompt"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(rows) + 2), 4))
    x = list(range(len(rows)))
    width = 0.4 if reference else 0.8
    ax.bar(
        [i - width / 2 if reference else i for i in x],
        [r["tau"] or 0 for r in rows],
        width,
        label=f"{drafter_label} (tau {rep.format_figure(overall['tau'])})",
    )
    if reference:
        ax.bar(
            [i + width / 2 for i in x],
            [r["reference_tau"] or 0 for r in rows],
            width,
            label=f"{reference_label} (tau {rep.format_figure(reference['tau'])})",
        )
    online_points = [
        (i, r["online_tau"]) for i, r in zip(x, rows, strict=True) if r["online_tau"] is not None
    ]
    if online_points:
        ax.scatter(
            [p[0] for p in online_points],
            [p[1] for p in online_points],
            marker="D",
            color="black",
            zorder=3,
            label="SGLang online",
        )
    ax.set_xticks(x)
    ax.set_xticklabels([str(r["id"]) for r in rows], rotation=60, ha="right", fontsize=7)
    tallest = max(
        [r["tau"] or 0 for r in rows]
        + [r["reference_tau"] or 0 for r in rows]
        + [p[1] for p in online_points]
        + [1.0]
    )
    ax.set_ylim(0, tallest * 1.3)  # headroom so the legend does not hide the bars
    ax.set_ylabel("tau (accepted tokens per verify step)")
    ax.set_title("tau per prompt")
    ax.legend(fontsize=8, loc="upper right")
    save(fig, rep.PLOT_TAU_PER_PROMPT)

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
    save(fig, rep.PLOT_BY_POSITION)

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
    save(fig, rep.PLOT_HISTOGRAM)
    return list(rep.PLOT_FILES)


def _error_bars(values: Sequence[float | None], intervals: Sequence[Sequence[float] | None]) -> list[list]:
    """matplotlib's yerr (distances below and above each value) from [low, high] intervals; 0 where
    there is no interval."""
    below, above = [], []
    for value, interval in zip(values, intervals, strict=True):
        below.append(value - interval[0] if interval and value is not None else 0.0)
        above.append(interval[1] - value if interval and value is not None else 0.0)
    return [below, above]


def render_comparison(summary: Mapping[str, Any], out_dir: str | Path) -> str:
    """tau of every drafter (and the reference) side by side with its 95% interval, and the expected
    speedup on top."""
    plt = _pyplot()
    rows = list(summary["comparison"])
    names = [r["name"] for r in rows]
    taus = [r["tau"] or 0 for r in rows]
    intervals = [r.get("interval") for r in rows]
    speedups = [r["expected_speedup"] for r in rows]
    if summary.get("reference"):
        names.append("reference")
        taus.append(summary["reference"]["tau"] or 0)
        intervals.append(summary["reference"].get("interval"))
        speedups.append((summary.get("speedup_model") or {}).get("reference_expected"))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(names) + 2), 4))
    bars = ax.bar(
        range(len(names)),
        taus,
        yerr=_error_bars(taus, intervals),
        capsize=4,
        color=["tab:blue"] * len(rows) + ["tab:orange"] * (len(names) - len(rows)),
    )
    for bar, speedup, interval in zip(bars, speedups, intervals, strict=True):
        if speedup is not None:
            ax.annotate(
                f"{speedup:.2f}x",
                # Above the interval's cap, where the label hides nothing.
                (bar.get_x() + bar.get_width() / 2, max(bar.get_height(), interval[1] if interval else 0)),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, max(taus + [i[1] for i in intervals if i] + [1.0]) * 1.2)
    ax.set_ylabel("tau, 95% interval (labels: expected speedup)")
    ax.set_title("tau by drafter")
    _save(plt, fig, Path(out_dir) / rep.PLOT_TAU_BY_DRAFTER)
    return rep.PLOT_TAU_BY_DRAFTER


def _tau_line(ax: Any, points: Sequence[tuple[int, float, Any]], **style: Any) -> None:
    """Points (run index, tau, 95% interval or None) joined, each interval as an error bar."""
    taus = [p[1] for p in points]
    ax.errorbar(
        [p[0] for p in points], taus, yerr=_error_bars(taus, [p[2] for p in points]), capsize=3, **style
    )


def render_trend(
    runs: Sequence[Mapping[str, Any]],
    drafters: Sequence[str],
    out_dir: str | Path,
    changes: Sequence[Mapping[str, Any]] = (),
) -> str:
    """tau per drafter over the runs of the index, oldest first (one line per drafter name), each point
    with its 95% interval where the run kept one; the last run's changes outside the noise
    (specops.history.changes) are marked with a red triangle pointing their way."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(runs) + 2), 4))
    x = list(range(len(runs)))
    for name in drafters:
        points = [
            (i, run["tau"][name], (run.get("interval") or {}).get(name))
            for i, run in zip(x, runs, strict=True)
            if run["tau"].get(name) is not None
        ]
        if points:
            _tau_line(ax, points, marker="o", label=name)
    references = [
        (i, run["reference_tau"], run.get("reference_interval"))
        for i, run in zip(x, runs, strict=True)
        if run.get("reference_tau") is not None
    ]
    if references:
        _tau_line(ax, references, linestyle="--", color="gray", label="reference")
    position = {run["run_id"]: i for i, run in enumerate(runs)}
    for direction in ("up", "down"):
        moved = [c for c in changes if c["direction"] == direction and c["run_id"] in position]
        if moved:
            ax.scatter(
                [position[c["run_id"]] for c in moved],
                [c["after"] for c in moved],
                marker="^" if direction == "up" else "v",
                s=120,
                color="red",
                zorder=4,
                label=f"moved {direction}, outside the noise",
            )
    ax.set_xticks(x)
    ax.set_xticklabels([run["run_id"] for run in runs], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("tau, 95% interval")
    ax.set_title("tau per drafter over past runs")
    ax.legend(fontsize=8)
    _save(plt, fig, Path(out_dir) / rep.PLOT_TAU_TREND)
    return rep.PLOT_TAU_TREND
