"""What the extraction can check before the GPU window, so nothing is stopped that a check could refuse.

Each check names the file or setting at fault and the fix. The duration estimate sizes the window's
guard: it is deliberately pessimistic (a slow disk, a low utilisation), since a guard that fires
mid-extraction restarts the server under a running job.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from specops import diagnostics as diag
from specops.manifest import MANIFEST_NAME, load_manifest, matches
from specops.stage import StageError

# Pessimistic rates for the estimate: an H200 sustains ~450 TFLOP/s on a 27 B target (FACTS.md), a CPU
# a few GFLOP/s; weights load from a disk or a network share at no less than this many bytes per second.
ASSUMED_FLOPS = {"cuda": 50e12, "cpu": 2e9}
PER_FORWARD_S = {"cuda": 0.05, "cpu": 0.5}
# On the CPU the torch fallback's per-token loops, not the arithmetic, bound small models: 24 tok/s was
# measured for the local default's 8-layer target on a loaded 2-core machine.
PER_TOKEN_S = {"cuda": 0.0, "cpu": 0.05}
LOAD_BYTES_PER_S = 100e6
WRITE_BYTES_PER_S = 100e6
# Interpreter start, imports, CUDA initialisation.
STARTUP_S = 60.0
# An extraction started ahead of its window has done those, and holds the weights in host memory: inside
# the window it only copies them to the device (pinned: 25-50 GB/s measured on the H100 and H200; this
# bound assumes pageable memory on a slow bus) and says go within a second.
HOST_TO_DEVICE_BYTES_PER_S = 2e9
PRESTARTED_START_S = 5.0
# The parity probe runs each sample three times (run dtype, its torch floor, the fp32 reference).
PARITY_PASSES = 3
# A shard's safetensors header: names, dtypes, shapes and offsets of two tensors per record, and metadata.
HEADER_BYTES_PER_RECORD = 256
HEADER_BYTES_PER_SHARD = 1024


def read_config(path: Path, what: str) -> dict[str, Any]:
    """A model's config.json, or an error naming the file and what is wrong with it."""
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise StageError(f"{what} {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise StageError(
            f"{what} {path} is not valid JSON ({error}): the file is damaged; copy it again "
            f"from where the model came from"
        ) from None
    if not isinstance(config, dict):
        raise StageError(f"{what} {path} is not a JSON object: the file is damaged")
    return config


def drafter_problems(drafter: str | os.PathLike[str], target_dir: Path, target_vocab_size: int) -> list[str]:
    """The drafter's vocabulary and mask token against the target, each problem found (either wrong makes
    every draft garbage); a config that cannot be read is refused at once, nothing else can be checked."""
    path = Path(drafter) / "config.json"
    config = read_config(path, "drafter config")
    problems = []
    vocab = config.get("vocab_size")
    if vocab is not None and vocab != target_vocab_size:
        problems.append(
            f"{path}: vocab_size {vocab} differs from the target's {target_vocab_size} "
            f"({target_dir / 'config.json'}): the drafter was built for another target or "
            f"tokenizer; point drafter at the one trained for this target"
        )
    error = diag.mask_token_error(diag.vocabulary_check(config, target_dir))
    if error:
        problems.append(f"{path}: {error}")
    return problems


def refuse(problems: list[str]) -> None:
    """One StageError naming every problem found, so one run shows all there is to fix."""
    if len(problems) == 1:
        raise StageError(problems[0])
    if problems:
        listed = "; ".join(f"({number}) {problem}" for number, problem in enumerate(problems, 1))
        raise StageError(f"{len(problems)} problems, each to fix: {listed}")


def check_completions_file(path: Path) -> None:
    """completions.jsonl against the sha256 its stage recorded: a changed byte is named, not used."""
    manifest = load_manifest(path.parent)
    recorded = ((manifest or {}).get("files") or {}).get(path.name)
    if not recorded or not path.is_file():
        return
    if not matches(path, recorded):
        raise StageError(
            f"{path} does not match the sha256 in {path.parent / MANIFEST_NAME} (damaged or "
            f"edited): rerun sglang_completions, which fetches it again"
        )


# Beside its shards the stage writes its manifest, the resume state, the progress log and the window's
# record (and the start signal's state beside the run): their size grows with the shards' entries.
METADATA_FILES = 5
METADATA_BYTES = 64 * 2**10
METADATA_BYTES_PER_SHARD = 1024
# Kept free by default: a disk filled to the last block fails the writes of everyone on it, and the
# score stage writes after the extraction (disk_reserve_bytes sets it; 0 keeps nothing).
DEFAULT_RESERVE_BYTES = 64 * 2**20
DEFAULT_BLOCK_BYTES = 4096


def nearest_existing(directory: Path) -> Path:
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            return candidate
    return Path("/")


def free_bytes(directory: Path) -> int:
    """Free space where `directory` will be: its nearest existing ancestor's file system."""
    return shutil.disk_usage(nearest_existing(directory)).free


def block_bytes(directory: Path) -> int:
    """The allocation unit of the file system `directory` will be on: every file takes whole ones."""
    try:
        stat = os.statvfs(nearest_existing(directory))
    except OSError:
        return DEFAULT_BLOCK_BYTES
    return max(stat.f_frsize or stat.f_bsize, 1)


def shard_bytes(tokens: int, records: int, shards: int, bytes_per_token: int) -> int:
    """Bytes of shards holding these tokens: tensors plus the headers' entries."""
    return tokens * bytes_per_token + records * HEADER_BYTES_PER_RECORD + shards * HEADER_BYTES_PER_SHARD


def on_disk_bytes(shards_bytes: int, shards: int, block: int) -> int:
    """What the stage takes from its file system: the shards and the files beside them, each file rounded
    up to whole blocks (at most one block more per file)."""
    files = shards + METADATA_FILES
    return shards_bytes + METADATA_BYTES + shards * METADATA_BYTES_PER_SHARD + files * block


def format_bytes(count: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} bytes"


def check_disk(out_dir: Path, needed: int, reserve: int = DEFAULT_RESERVE_BYTES, shards: int = 1) -> int:
    """Refuse shards of `needed` bytes that would not fit with their files and the reserve; the bytes
    they take on the disk."""
    free = free_bytes(out_dir)
    block = block_bytes(out_dir)
    taken = on_disk_bytes(needed, shards, block)
    if taken + reserve > free:
        kept = f" and {format_bytes(reserve)} are to stay free (disk_reserve_bytes)" if reserve else ""
        raise StageError(
            f"not enough disk space for {out_dir}: the hidden states need {format_bytes(taken)} "
            f"({format_bytes(needed)} of shards, their manifest, resume state and progress log, in "
            f"{block}-byte blocks){kept}, {format_bytes(free)} are free: free space, choose another "
            f"out_dir, or extract fewer records/layers"
        )
    return taken


def estimate_seconds(
    device_type: str,
    weights_bytes: int,
    weight_itemsize: int,
    layers_run: int,
    num_layers: int,
    tokens: int,
    forwards: int,
    parity_tokens: int,
    write_bytes: int,
    prestarted: bool = False,
) -> float:
    """A pessimistic duration of the extraction: start, load, forwards (only the layers run), writes;
    `prestarted`: inside the window of an extraction started ahead (its start and disk reads done)."""
    params = weights_bytes / max(weight_itemsize, 1) * layers_run / max(num_layers, 1)
    flops = ASSUMED_FLOPS.get(device_type, ASSUMED_FLOPS["cpu"])
    per_forward = PER_FORWARD_S.get(device_type, PER_FORWARD_S["cpu"])
    computed = tokens + PARITY_PASSES * parity_tokens
    compute = (
        2.0 * params * computed / flops
        + forwards * per_forward
        + computed * PER_TOKEN_S.get(device_type, PER_TOKEN_S["cpu"])
    )
    writes = write_bytes / WRITE_BYTES_PER_S
    if prestarted:
        to_device = weights_bytes / HOST_TO_DEVICE_BYTES_PER_S if device_type == "cuda" else 0.0
        return PRESTARTED_START_S + to_device + compute + writes
    return STARTUP_S + weights_bytes / LOAD_BYTES_PER_S + compute + writes
