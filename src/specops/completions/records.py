"""The completions stage's records on disk: the partial file that lets an interrupted run resume, and
the per-record digests that tell which lines of a finished output are intact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specops.manifest import atomic_write_text, load_manifest
from specops.stage import log

OUTPUT_NAME = "completions.jsonl"
PARTIAL_NAME = "completions.partial.jsonl"


def _matches(record: Any, prompt_ids: dict[str, list[int]]) -> bool:
    """A stored record of one of these prompts, made from the same prompt tokens."""
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        return False
    return prompt_ids.get(record["id"]) == record.get("prompt_ids")


def read_partial(path: Path, inputs_fingerprint: str, prompt_ids: dict[str, list[int]]) -> dict[str, dict]:
    """Records a previous run of the same inputs finished; a torn last line is dropped."""
    if not path.is_file():
        return {}
    kept: dict[str, dict] = {}
    with open(path, encoding="utf-8") as handle:
        header_line = handle.readline()
        try:
            header = json.loads(header_line)
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get("inputs_fingerprint") != inputs_fingerprint:
            log(f"{path.name} was made from other inputs: starting over")
            return {}
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # written when the run was interrupted: everything before it is whole
            if _matches(record, prompt_ids):
                kept[record["id"]] = record
    return kept


class PartialWriter:
    """Appends one record per line and flushes it to disk, so a kill loses at most the one in flight."""

    def __init__(self, path: Path, inputs_fingerprint: str, kept: list[dict]):
        header = json.dumps({"inputs_fingerprint": inputs_fingerprint, "partial_of": OUTPUT_NAME})
        # Rewrite first: this drops a torn last line before anything is appended after it.
        lines = [header, *(json.dumps(record, sort_keys=True) for record in kept)]
        atomic_write_text(path, "\n".join(lines) + "\n")
        self.handle = open(path, "a", encoding="utf-8")

    def append(self, record: dict) -> None:
        self.handle.write(json.dumps(record, sort_keys=True) + "\n")
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        self.handle.close()


def line_sha256(line: str) -> str:
    import hashlib

    return hashlib.sha256(line.encode("utf-8")).hexdigest()


def _recorded_lines(out: Path, inputs_fingerprint: str) -> tuple[dict[str, str], list[str]]:
    """(the manifest's sha256 per record id, the output's lines) when the manifest is of these inputs."""
    manifest = load_manifest(out) or {}
    path = out / OUTPUT_NAME
    if manifest.get("inputs_fingerprint") != inputs_fingerprint or not path.is_file():
        return {}, []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    return manifest.get("records_sha256") or {}, lines[:-1] if lines[-1] == "" else lines


def damaged_records(out: Path, inputs_fingerprint: str, ids: list[str]) -> list[str]:
    """Which lines of an output of these inputs differ from what was fetched, with the record's id.

    `ids` is the prompts' order, which is the output's: the manifest's JSON has its keys sorted, so the
    order of its per-record digests says nothing about lines."""
    recorded, lines = _recorded_lines(out, inputs_fingerprint)
    damaged = []
    for number, line in enumerate(lines, start=1):
        record_id = ids[number - 1] if number <= len(ids) else None
        if record_id is None or line_sha256(line + "\n") != recorded.get(record_id):
            damaged.append(f"{out / OUTPUT_NAME} line {number} (id {record_id!r}) is damaged or edited")
    return damaged


def intact_records(out: Path, inputs_fingerprint: str, prompt_ids: dict[str, list[int]]) -> dict[str, dict]:
    """Records of an earlier output of these inputs that still match their sha256: a repair refetches the
    others only."""
    recorded, lines = _recorded_lines(out, inputs_fingerprint)
    kept: dict[str, dict] = {}
    for line in lines:
        digest = line_sha256(line + "\n")
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if _matches(record, prompt_ids) and recorded.get(record["id"]) == digest:
            kept[record["id"]] = record
    return kept
