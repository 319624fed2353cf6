"""Extractions finished on this host, found by what they were made from, so the same work never takes the
service down twice.

A run's extraction is noted after its window as a pointer, <cache_dir>/<inputs fingerprint>.json ->
{"out_dir", "noted_at", "owner"}: the shards stay where the run wrote them. A later run of the same work
(same target, layers, completions' tokens, options; its plan gives the fingerprint) links those files
into its own output directory (hard links where the file systems allow, else copies), manifest last,
before any window: its plan then finds the output up to date. A later run of other work is told which
noted extraction took the service down how long ago and how its inputs differ, for its message and its
window's record.

python -m specops.extraction_cache --plan|--run with a JSON request on stdin:
    {"action": "note", "cache_dir": DIR, "out_dir": DIR, "owner": TEXT}
    {"action": "reuse", "cache_dir": DIR, "out_dir": DIR, "fingerprint": HEX, "inputs": {...}, "recent_s": S,
     "take_over": true}   (false: only say what was noted recently)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from specops.manifest import MANIFEST_NAME, atomic_write_json, is_up_to_date, load_manifest
from specops.stage import StageError, log, serve

# A window noted this long ago counts as "just before" this one: two outages close together are named.
RECENT_S = 3600.0


def _noted(cache_dir: Path) -> list[dict[str, Any]]:
    notes = []
    for path in cache_dir.glob("*.json") if cache_dir.is_dir() else []:
        try:
            note = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(note, dict) and note.get("out_dir"):
            notes.append({**note, "fingerprint": path.stem})
    return sorted(notes, key=lambda note: float(note.get("noted_at") or 0))


def _link_or_copy(source: Path, target: Path) -> None:
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)  # the shards are never written in place: a link shares nothing that changes
    except OSError:
        shutil.copy2(source, target)


def differences(noted: dict[str, Any], inputs: dict[str, Any]) -> list[str]:
    """What differs between the inputs a noted extraction was made from and these, in words."""
    manifest = load_manifest(noted["out_dir"]) or {}
    theirs = manifest.get("inputs") or {}
    names = {
        "target": "the target",
        "completions": "the completions' tokens",
        "layer_ids": "the layers",
        "dtype": "the dtype",
        "device_type": "the device",
        "require_backend": "the required backend",
        "shard_tokens": "the shard size",
        "format_version": "the output format",
    }
    said = []
    for key in sorted(set(theirs) | set(inputs)):
        if theirs.get(key) != inputs.get(key):
            what = names.get(key, key)
            if key == "layer_ids":
                what = f"the layers ({theirs.get(key)} there, {inputs.get(key)} here)"
            said.append(what)
    return said or ["its output is no longer there or was changed"]


def note(request: dict[str, Any], dry_run: bool) -> dict[str, Any]:
    out_dir = Path(request["out_dir"])
    manifest = load_manifest(out_dir)
    if not manifest or not is_up_to_date(out_dir, manifest.get("inputs_fingerprint", "")):
        return {"changed": False, "msg": f"{out_dir} holds no finished extraction: nothing noted"}
    path = Path(request["cache_dir"]) / f"{manifest['inputs_fingerprint']}.json"
    if not dry_run:
        atomic_write_json(
            path, {"out_dir": str(out_dir), "noted_at": time.time(), "owner": request.get("owner")}
        )
    return {"changed": True, "path": str(path)}


def reuse(request: dict[str, Any], dry_run: bool) -> dict[str, Any]:
    cache_dir, out_dir = Path(request["cache_dir"]), Path(request["out_dir"])
    fingerprint = str(request.get("fingerprint") or "")
    notes = [n for n in _noted(cache_dir) if Path(n["out_dir"]) != out_dir]
    take_over = bool(request.get("take_over", True))
    for noted in notes:
        source = Path(noted["out_dir"])
        if not take_over or noted["fingerprint"] != fingerprint or not is_up_to_date(source, fingerprint):
            continue
        manifest = load_manifest(source) or {}
        if not dry_run:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / MANIFEST_NAME).unlink(missing_ok=True)  # written last: present means complete
            for name in sorted(manifest.get("files") or {}):
                _link_or_copy(source / name, out_dir / name)
            _link_or_copy(source / MANIFEST_NAME, out_dir / MANIFEST_NAME)
            log(f"took the extraction of {source} (the same inputs) into {out_dir}")
        return {"changed": True, "reused_from": str(source), "owner": noted.get("owner")}
    recent_s = float(request.get("recent_s", RECENT_S))
    recent = [n for n in notes if time.time() - float(n.get("noted_at") or 0) <= recent_s]
    if not recent:
        return {"changed": False}
    last = recent[-1]
    same = last["fingerprint"] == fingerprint
    return {
        "changed": False,
        "recent": {
            "out_dir": last["out_dir"],
            "owner": last.get("owner"),
            "noted_at": last.get("noted_at"),
            "ago_s": round(time.time() - float(last.get("noted_at") or 0), 1),
            # The same work, not taken over (take_over false, or its output changed since).
            "same_work": same,
            "differs": [] if same else differences(last, dict(request.get("inputs") or {})),
        },
    }


def _work(request: dict[str, Any], dry_run: bool) -> dict[str, Any]:
    for key in ("action", "cache_dir", "out_dir"):
        if not request.get(key):
            raise StageError(f"'{key}' is required (action note or reuse, the host's cache, the output)")
    if request["action"] == "note":
        return note(request, dry_run)
    if request["action"] == "reuse":
        return reuse(request, dry_run)
    raise StageError(f"action {request['action']!r} is not note or reuse")


def plan(request: dict[str, Any]) -> dict[str, Any]:
    return _work(request, dry_run=True)


def run(request: dict[str, Any]) -> dict[str, Any]:
    return _work(request, dry_run=False)


def main(argv: list[str] | None = None) -> int:
    return serve("extraction_cache", plan, run, argv)


if __name__ == "__main__":
    sys.exit(main())
