"""Past runs of the score stage: each run's own directory and one index, appended to.

Layout under the history directory:
    index.jsonl        one JSON line per run that scored: run_id, time, tau per drafter and its
                       95% interval, reference tau and its interval, prompts scored
    <run_id>/          that run's report.json, report.md and plots, copied when it was scored
Appends take an exclusive lock on the index and write each line with one write() call on an
O_APPEND descriptor, so concurrent runs (several AWX jobs on one host) never interleave or lose lines.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from specops import stats

INDEX = "index.jsonl"


def new_run_id(fingerprint: str, now: datetime.datetime | None = None) -> str:
    """Sortable and unique per input set: UTC time, then the inputs fingerprint's first characters."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return f"{now:%Y%m%dT%H%M%SZ}-{fingerprint[:8]}"


def entry(run_id: str, summary: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tau": {d["name"]: d["overall"]["tau"] for d in summary["drafters"]},
        "interval": {d["name"]: d["overall"].get("interval") for d in summary["drafters"]},
        "n_prompts": {d["name"]: len(d.get("per_prompt") or []) for d in summary["drafters"]},
        "paths": {d["name"]: d["run"].get("drafter") for d in summary["drafters"]},
        "reference_tau": (summary.get("reference") or {}).get("tau"),
        "reference_interval": (summary.get("reference") or {}).get("interval"),
    }


def append(history_dir: Path, record: Mapping[str, Any]) -> None:
    """Add one run to the index, atomically with respect to other writers."""
    history_dir.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(history_dir / INDEX, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)  # closing releases the lock


def read(history_dir: Path) -> list[dict[str, Any]]:
    """Every complete run line, oldest first; a line cut short by a crash is skipped."""
    path = history_dir / INDEX
    if not path.is_file():
        return []
    runs = []
    for line in path.read_text().splitlines():
        try:
            runs.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return runs


def keep_run(history_dir: Path, run_id: str, files: Iterable[Path]) -> Path:
    """Copy this run's outputs into history/<run_id>/ (a temporary directory renamed into place)."""
    final = history_dir / run_id
    staging = history_dir / f".{run_id}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for path in files:
        target = staging / path.name
        if path.is_dir():
            shutil.copytree(path, target)
        elif path.is_file():
            shutil.copy2(path, target)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    return final


def changes(runs: list[dict[str, Any]], run_id: str) -> list[dict[str, Any]]:
    """Each drafter of run_id whose tau moved since its previous run by more than the two runs'
    intervals allow (specops.stats.run_change); runs written before intervals were kept are never
    flagged."""
    position = next((i for i, run in enumerate(runs) if run["run_id"] == run_id), None)
    if position is None:
        return []
    current, found = runs[position], []
    for name, after in current["tau"].items():
        previous = next((run for run in reversed(runs[:position]) if run["tau"].get(name) is not None), None)
        if previous is None:
            continue
        before = previous["tau"][name]
        direction = stats.run_change(
            before,
            (previous.get("interval") or {}).get(name),
            after,
            (current.get("interval") or {}).get(name),
        )
        if direction:
            found.append(
                {
                    "run_id": run_id,
                    "drafter": name,
                    "direction": direction,
                    "before": before,
                    "after": after,
                    "previous_run_id": previous["run_id"],
                }
            )
    return found


def trend(runs: list[dict[str, Any]], run_id: str, index: Path) -> dict[str, Any]:
    """The report's history section: the runs, the drafter names seen in them (first-seen order) and
    the changes of this run that stand outside the noise."""
    names: list[str] = []
    for run in runs:
        names += [name for name in run["tau"] if name not in names]
    return {
        "index": str(index),
        "run_id": run_id,
        "runs": runs,
        "drafters": names,
        "changes": changes(runs, run_id),
    }
