"""The shard plan (from the records' lengths alone) and the resume state of shards already written."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specops.extract.target import Record
from specops.hidden_states import shard_name
from specops.manifest import (
    MANIFEST_NAME,
    atomic_write_json,
    load_manifest,
    matches,
    remove_stale_temporaries,
)
from specops.stage import log

if TYPE_CHECKING:  # prepared.py plans its shards here
    from specops.extract.prepared import Prepared

STATE_NAME = ".extract-state.json"


@dataclass
class ShardPlan:
    number: int
    records: list[Record]
    batches: list[list[Record]]

    @property
    def name(self) -> str:
        return shard_name(self.number)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.records)


def plan_shards(records: Sequence[Record], shard_tokens: int, batch_tokens: int) -> list[ShardPlan]:
    """Longest first (an out-of-memory shows at once); shards from lengths alone, batches inside shards.

    The shard layout depends only on the records and shard_tokens, so a resumed run with another
    batch_tokens still finds its finished shards valid.
    """
    ordered = sorted(records, key=lambda r: (-r.num_tokens, r.index))
    groups: list[list[Record]] = []
    current: list[Record] = []
    tokens = 0
    for record in ordered:
        current.append(record)
        tokens += record.num_tokens
        if tokens >= shard_tokens:
            groups.append(current)
            current, tokens = [], 0
    if current:
        groups.append(current)
    shards = []
    for number, group in enumerate(groups):
        batches: list[list[Record]] = []
        for record in group:
            # Sorted longest first, so a batch's padded size is its first record's length times its size.
            if batches and (len(batches[-1]) + 1) * batches[-1][0].num_tokens <= batch_tokens:
                batches[-1].append(record)
            else:
                batches.append([record])
        shards.append(ShardPlan(number, group, batches))
    if shards and len(shards[-1].batches[-1]) > 1:
        # The last batch's write cannot overlap with compute: split it into single records so the
        # run ends on the smallest possible write.
        shards[-1].batches[-1:] = [[record] for record in shards[-1].batches[-1]]
    return shards


class ResumeState:
    """Which shards of this exact input set are already on disk; updated after every shard."""

    def __init__(self, out_dir: Path, inputs_fingerprint: str):
        self.path = out_dir / STATE_NAME
        self.fingerprint = inputs_fingerprint
        self.shards: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, out_dir: Path, inputs_fingerprint: str, planned: Sequence[str]) -> ResumeState:
        """Keep finished shards of the same inputs; delete everything else a previous run left."""
        state = cls(out_dir, inputs_fingerprint)
        try:
            saved = json.loads(state.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            saved = {}
        finished = load_manifest(out_dir) or {}
        for source in (finished, saved):
            if source.get("inputs_fingerprint") != inputs_fingerprint:
                continue
            for name, digest in (source.get("files") or source.get("shards") or {}).items():
                path = out_dir / name
                if name in planned and name not in state.shards and path.is_file():
                    if matches(path, digest):
                        state.shards[name] = digest
                    else:
                        log(f"{path} does not match its recorded sha256: extracting it again")
        remove_stale_temporaries(out_dir)
        (out_dir / MANIFEST_NAME).unlink(missing_ok=True)  # it describes older outputs now
        for stale in out_dir.glob("shard-*.safetensors"):
            if stale.name not in state.shards:
                stale.unlink()
        state.save()
        return state

    def add(self, name: str, digest: dict[str, Any]) -> None:
        with self._lock:
            self.shards[name] = digest
            self.save()

    def save(self) -> None:
        atomic_write_json(self.path, {"inputs_fingerprint": self.fingerprint, "shards": self.shards})

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def resumable_shards(prep: Prepared, fp: str) -> list[str]:
    """Shards a run would keep: recorded for these inputs (resume state or manifest) and intact."""
    kept = []
    for source in (load_manifest(prep.out_dir) or {}, _read_json(prep.out_dir / STATE_NAME)):
        if source.get("inputs_fingerprint") != fp:
            continue
        for name, digest in (source.get("files") or source.get("shards") or {}).items():
            path = prep.out_dir / name
            if name not in kept and matches(path, digest):
                kept.append(name)
    return sorted(kept)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}
