"""Reuse the drafters' scores of a report made inside the window, when what changed since cannot
change them: the window's record (written once the service is back), an outage, the history, or
diagnostics that were left for after the window (the layer offsets, which then run here alone).

The score stage would otherwise score every pass again for a record that only adds a section.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specops import cpu_bounds
from specops import diagnostics as diag
from specops import placement as where
from specops import report as rep
from specops.manifest import load_manifest
from specops.score.request import Options
from specops.score.result import REPORT_JSON
from specops.score.scorer import Scorer, resolve_dtype
from specops.score.writing import write_outputs
from specops.stage import log

# Inputs that say how the report is presented, not what the passes computed.
PRESENTATION = ("window", "outages")
PRESENTATION_OPTIONS = ("history", "diagnostics")
# The only diagnostic that may be added afterwards: it needs passes of its own, nothing else's.
DEFERRABLE = frozenset({"layer_offset"})


@dataclass
class Reusable:
    reports: list[dict[str, Any]]
    placement: dict[str, Any] | None
    # Diagnostics the new request asks for that the reports do not hold yet.
    missing: frozenset[str]


def _scores_inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
    kept = {k: v for k, v in inputs.items() if k not in PRESENTATION}
    kept["options"] = {
        k: v for k, v in (inputs.get("options") or {}).items() if k not in PRESENTATION_OPTIONS
    }
    return kept


def reusable(opts: Options, inputs: Mapping[str, Any]) -> Reusable | None:
    """The reports of the output in out_dir when only presentation changed (None: score again)."""
    manifest = load_manifest(opts.out_dir)
    if not manifest or not isinstance(manifest.get("inputs"), dict):
        return None
    before = manifest["inputs"]
    if _scores_inputs(before) != _scores_inputs(inputs):
        return None
    had = set((before.get("options") or {}).get("diagnostics") or [])
    wanted = set(opts.diagnostics)
    if not had <= wanted or not (wanted - had) <= DEFERRABLE:
        return None
    reports = []
    for name in opts.names:
        path = opts.out_dir / "drafters" / name / REPORT_JSON
        if not path.is_file():
            return None
        reports.append(json.loads(path.read_text()))
    try:
        summary = json.loads((opts.out_dir / REPORT_JSON).read_text())
    except (OSError, ValueError):
        return None
    return Reusable(reports, summary.get("placement"), frozenset(wanted - had))


def add_diagnostic(report: dict[str, Any], finding: Mapping[str, Any]) -> None:
    """Put a finding computed after the report beside the others, after the acceptance pattern."""
    at = 1 if report["diagnostics"] and report["diagnostics"][0]["name"] == "acceptance" else 0
    report["diagnostics"].insert(at, dict(finding))
    if finding["status"] == "warning":
        report["warnings"].append(f"{finding['name']}: {finding['message']}")


def refresh(
    opts: Options, inputs: dict[str, Any], inputs_fingerprint: str, reused: Reusable, started: float
) -> dict[str, Any]:
    """Rewrite the report from the drafters' scores made in the window, running only the diagnostics
    left for after it (the layer offsets, on the CPU)."""
    placed = dict(reused.placement or {})
    if "layer_offset" in reused.missing:
        captured = list((load_manifest(opts.hidden_states) or {}).get("layer_ids") or [])
        scorer = Scorer(opts, "cpu", resolve_dtype(opts.dtype, "cpu", opts.target, list(opts.drafter)))
        for report, path in zip(reused.reports, opts.drafter, strict=True):
            drafter = scorer.load(path)

            def tau_at(ids: list[int], drafter=drafter) -> float | None:
                scores = scorer.score(drafter, ids)
                return rep.summarize(scores["sequences"], scores["block_size"])["tau"]

            log(f"score: the layer-offset check of {report['name']} after the window")
            finding = diag.layer_offset_check(
                tau_at,
                captured,
                report["run"]["target_layer_ids"],
                report["overall"]["tau"],
                tolerance=opts.layer_offset_tolerance,
            )
            add_diagnostic(report, finding)
            del drafter
        placed["after_window"] = where.record(
            {"where": "cpu", "why": "the layer offsets run after the window"},
            time.monotonic() - started,
            cpu_bounds.observed(),
        )
    log(
        f"score: the scores made {'on ' + placed['host'] if placed.get('host') else 'in the window'} are "
        f"reused; {opts.out_dir} is rewritten with the window's record and the history"
    )
    return write_outputs(opts, inputs, inputs_fingerprint, reused.reports, placement=placed or None)
