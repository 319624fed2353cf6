"""How the window's parts grow with the target's weights, and a straight-line projection to Qwen3.6-27B.

Used by eval_h200.sh's summary: from each eval play's window record (report.json `window`) and the
weights of its target, per mode: downtime, the release or stop, the resume or start, and the
extraction's weights handling ahead of and inside the window (host load, pinning, host -> device).
Each figure is fitted as a + b x GB over the sizes measured (least squares) and evaluated at 54 GB:
a projection, labelled as one, since nothing of that size ran.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

QWEN36_27B_BYTES = 54e9
# The figure's name, and where it is in a window record.
FIGURES = {
    "downtime_s": ("downtime_s",),
    "stop_or_release_s": ("stages", "stop-server"),
    "start_or_resume_s": ("stages", "start-server"),
    "extract_stage_s": ("stages", "extract"),
    "compute_s": ("compute_s",),
    "other_s": ("other_s",),
    "release_s": ("release_s",),
    "host_load_s": ("extraction", "prestart", "host_load_s"),
    "pin_s": ("extraction", "prestart", "pin_s"),
    "to_device_s": ("extraction", "prestart", "to_device_s"),
}


def figure(window: Mapping[str, Any], path: Sequence[str]) -> float | None:
    if path[0] == "stages":
        found = [s["s"] for s in window.get("stages") or [] if s.get("stage") == path[1]]
        return found[0] if found else None
    value: Any = window
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return float(value) if isinstance(value, int | float) else None


def fit(points: Sequence[tuple[float, float]], at: float) -> dict[str, float] | None:
    """Least-squares line through (GB, value) points, evaluated at `at` GB; None below two sizes."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return {
        "per_gb": round(slope, 4),
        "intercept": round(mean_y - slope * mean_x, 3),
        "projected": round(mean_y + slope * (at - mean_x), 2),
    }


def scaling(plays: Sequence[Mapping[str, Any]], weights_bytes: Mapping[str, int]) -> dict[str, Any]:
    """Per mode: the measured figures by target size, and their projection to 54 GB."""
    result: dict[str, Any] = {
        "note": f"projected_to_54gb is a straight-line fit over the sizes measured, evaluated at "
        f"{QWEN36_27B_BYTES / 1e9:.0f} GB: a projection, not a measurement"
    }
    for play in plays:
        window = play.get("window")
        target = str(play["play"]).split("-")[0]
        if not window or target not in weights_bytes:
            continue
        # A memory-saver window with a plan is keyed by what it released (kv_cache: the weights stayed on
        # the GPU; all: they went to host memory); one recorded before the plan released every tag.
        plan = window.get("memory_plan") or {}
        mode = window.get("mode", "stop") + (f":{plan['choice']}" if plan.get("choice") else "")
        row = {"play": play["play"], "weights_gb": round(weights_bytes[target] / 1e9, 3)}
        row.update({name: figure(window, path) for name, path in FIGURES.items()})
        memory = (window.get("extraction") or {}).get("prestart", {}).get("host_memory") or {}
        row["host_weights"] = memory.get("weights")
        result.setdefault(mode, {"measured": []})["measured"].append(row)
    for section in result.values():
        if not isinstance(section, dict):
            continue
        rows = section["measured"]
        section["projected_to_54gb"] = {
            name: fit(
                [(r["weights_gb"], r[name]) for r in rows if r[name] is not None], QWEN36_27B_BYTES / 1e9
            )
            for name in FIGURES
        }
    return result
