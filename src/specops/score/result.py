"""The score stage's result: the key figures of report.json that the module returns and set_stats
publishes for AWX, and where the report is."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specops import report as rep

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
# Runs of the history the stage result (and so AWX) carries.
TREND_RUNS = 20


def _paired(comparison: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A paired comparison's headline: the difference with its interval, the wins, the verdict."""
    if not comparison:
        return None
    return {
        key: comparison[key]
        for key in ("names", "n_prompts", "difference", "interval", "ratio_interval", "wins", "verdict")
        if key in comparison
    } | {"prompts_needed": (comparison.get("prompts_needed") or {}).get("observed")}


def key_figures(report: Mapping[str, Any], out_dir: Path, changed: bool) -> dict[str, Any]:
    """The stage result: what set_stats publishes, and where the report is."""
    history = report.get("history") or {}
    return {
        "changed": changed,
        "tau": report["overall"]["tau"],
        "tau_interval": report["overall"].get("interval"),
        "reference_tau": (report.get("reference") or {}).get("tau"),
        "reference_tau_interval": (report.get("reference") or {}).get("interval"),
        "ratio": report.get("ratio"),
        "vs_reference": _paired(report.get("vs_reference")),
        "online_tau": (report.get("online") or {}).get("tau"),
        "n_prompts": len(report["per_prompt"]),
        "steps": report["overall"]["steps"],
        "verdict": report.get("verdict") or rep.verdict(report),
        "warnings": report["warnings"],
        "drafters": [
            {
                "name": row["name"],
                "tau": row["tau"],
                "tau_interval": row.get("interval"),
                "ratio": row["ratio"],
                "vs_reference": row.get("vs_reference"),
                "expected_speedup": row["expected_speedup"],
                "warnings": row["warnings"],
            }
            for row in report.get("comparison") or []
        ],
        "pairs": [_paired(pair) for pair in report.get("pairs") or []],
        "expected_speedup": ((report.get("comparison") or [{}])[0]).get("expected_speedup"),
        "history_index": history.get("index"),
        # The trend AWX shows: tau per drafter and its interval over the last runs of the index.
        "trend": [
            {
                "run_id": r["run_id"],
                "tau": r["tau"],
                "tau_interval": r.get("interval") or {},
                "reference_tau": r.get("reference_tau"),
                "reference_tau_interval": r.get("reference_interval"),
            }
            for r in (history.get("runs") or [])[-TREND_RUNS:]
        ],
        "changes": history.get("changes") or [],
        "run_id": history.get("run_id"),
        "out_dir": str(out_dir),
        "report_json": str(out_dir / REPORT_JSON),
        "report_md": str(out_dir / REPORT_MD),
        "plots": [str(out_dir / name) for name in report.get("plots") or []],
        "placement": report.get("placement"),
    }
