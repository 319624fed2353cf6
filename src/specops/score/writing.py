"""Writing the score stage's output: each drafter's report and plots, the summary, the history, and
the manifest last.
"""

from __future__ import annotations

import shutil
from typing import Any

from specops import history as hist
from specops import placement as where
from specops import report as rep
from specops import speedup as spd
from specops import window as win
from specops.manifest import atomic_write_json, atomic_write_text, write_manifest
from specops.score.request import STAGE, Options
from specops.score.result import REPORT_JSON, REPORT_MD, key_figures
from specops.stage import log

DRAFTERS_DIR = "drafters"


def _speedup(opts: Options, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Each drafter's expected speedup (into its report) and the model's statement for the summary."""
    measured = dict(opts.step_costs)
    for report, path in zip(reports, opts.drafter, strict=True):
        costs = measured or spd.estimated_costs(opts.target, path)
        report["speedup"] = {
            **costs,
            "source": "measured" if measured else "estimated",
            "expected": spd.expected_speedup(report["overall"]["tau"], **costs),
        }
    model = spd.model_description("measured" if measured else "estimated", measured)
    if opts.reference_drafter and reports[0].get("reference"):
        costs = measured or spd.estimated_costs(opts.target, opts.reference_drafter)
        model["reference_expected"] = spd.expected_speedup(reports[0]["reference"]["tau"], **costs)
    return model


def write_outputs(
    opts: Options,
    inputs: dict[str, Any],
    inputs_fingerprint: str,
    reports: list[dict[str, Any]],
    placement: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every drafter's directory, then the summary; the history; the manifest last."""
    from specops import plots

    out = opts.out_dir
    out.mkdir(parents=True, exist_ok=True)
    model = _speedup(opts, reports)
    files: list[str] = []
    plot_dirs = {}
    for report in reports:
        directory = out / DRAFTERS_DIR / report["name"]
        directory.mkdir(parents=True, exist_ok=True)
        report["plots"] = plots.render_plots(report, directory)
        atomic_write_text(directory / REPORT_MD, rep.render_markdown(report))
        atomic_write_json(directory / REPORT_JSON, report)
        plot_dirs[report["name"]] = f"{DRAFTERS_DIR}/{report['name']}/"
        files += [
            f"{DRAFTERS_DIR}/{report['name']}/{name}" for name in (REPORT_MD, REPORT_JSON, *report["plots"])
        ]
    # A drafter no longer in the list leaves no stale directory behind.
    for stale in (out / DRAFTERS_DIR).iterdir():
        if stale.name not in plot_dirs and stale.is_dir():
            shutil.rmtree(stale)
    run_info = {
        key: value for key, value in reports[0]["run"].items() if key not in ("drafter", "target_layer_ids")
    }
    summary = rep.build_summary(run_info, reports, model, detectable=opts.detectable_difference)
    summary_plots = [plots.render_comparison(summary, out)]
    run_id = None
    if opts.history:
        run_id = hist.new_run_id(inputs_fingerprint)
        hist.append(opts.history, hist.entry(run_id, summary))
        runs = hist.read(opts.history)
        summary["history"] = hist.trend(runs, run_id, opts.history / hist.INDEX)
        summary_plots.append(
            plots.render_trend(runs, summary["history"]["drafters"], out, summary["history"]["changes"])
        )
    summary["plots"] = summary_plots
    summary["window"] = win.read_window(opts.hidden_states)
    summary["outages"] = win.read_outages(opts.hidden_states)
    summary["placement"] = placement
    atomic_write_text(
        out / REPORT_MD,
        rep.render_summary(summary, plot_dirs, summary_plots)
        + win.render_markdown(summary["window"])
        + win.render_outages(summary["outages"])
        + where.render_markdown(placement),
    )
    atomic_write_json(out / REPORT_JSON, summary)
    files = [REPORT_JSON, REPORT_MD, *summary_plots, *files]
    if opts.history and run_id:
        hist.keep_run(
            opts.history,
            run_id,
            [out / name for name in (REPORT_JSON, REPORT_MD, *summary_plots)] + [out / DRAFTERS_DIR],
        )
    figures = {
        "tau": summary["overall"]["tau"],
        "reference_tau": (summary.get("reference") or {}).get("tau"),
        "ratio": summary.get("ratio"),
        "drafters": {r["name"]: r["overall"]["tau"] for r in reports},
    }
    write_manifest(out, STAGE, inputs, files, figures=figures)
    log(f"score: {summary['verdict']}; report in {out / REPORT_MD}")
    return key_figures(summary, out, changed=True)
