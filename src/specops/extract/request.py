"""The extraction request: its options, their defaults and their validation."""

from __future__ import annotations

from typing import Any

from specops.extract.devices import validate_request
from specops.stage import StageError

STAGE = "extract_hidden_states"
DTYPES = ("bfloat16", "float16", "float32")
BACKENDS = ("auto", "fla", "torch", "any")
DEFAULTS: dict[str, Any] = {
    "drafter": None,
    "layer_ids": None,
    "capture_offsets": [0],
    "dtype": "auto",
    "device": "auto",
    # Devices to extract on (auto: every visible GPU when device is auto) and how (devices.py).
    "devices": "auto",
    "parallel": "auto",
    "require_backend": "auto",
    "parity_samples": 0,
    # bf16 hidden states differ from an fp32 reference by 1.4-2.8% on a small model (FACTS.md);
    # the limit per layer is the larger of this and twice the noise floor measured in the same run.
    "parity_tolerance": 0.05,
    "batch_tokens": 16384,
    "shard_tokens": 32768,
    "progress_log": None,
    "writer_threads": 4,
    # Flush each shard to the device as it is written; off leaves the flushing to the OS (faster on a
    # disk slower than the extraction, but a power loss can then damage shards the manifest lists).
    "fsync": True,
    # Bytes that must stay free on the output's file system once the shards are written.
    "disk_reserve_bytes": 0,
}
REQUIRED = ("target", "completions", "out_dir")


def parse_request(request: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(request) - set(DEFAULTS) - set(REQUIRED))
    if unknown:
        raise StageError(f"unknown request keys {unknown}: the keys are {sorted([*REQUIRED, *DEFAULTS])}")
    missing = [k for k in REQUIRED if not request.get(k)]
    if missing:
        raise StageError(f"missing {missing}: give the target model dir, the completions dir and out_dir")
    req = {**DEFAULTS, **{k: v for k, v in request.items() if v is not None}}
    if req["dtype"] not in ("auto", *DTYPES):
        raise StageError(f"dtype {req['dtype']!r} is not one of auto, {', '.join(DTYPES)}")
    if req["require_backend"] not in BACKENDS:
        raise StageError(f"require_backend {req['require_backend']!r} is not one of {', '.join(BACKENDS)}")
    for key in ("batch_tokens", "shard_tokens", "writer_threads"):
        if not isinstance(req[key], int) or req[key] < 1:
            raise StageError(f"{key} must be a positive integer, got {req[key]!r}")
    if not isinstance(req["disk_reserve_bytes"], int) or req["disk_reserve_bytes"] < 0:
        raise StageError(f"disk_reserve_bytes must be 0 or a positive integer, got "
                         f"{req['disk_reserve_bytes']!r}")
    if not isinstance(req["parity_samples"], int) or req["parity_samples"] < 0:
        raise StageError(f"parity_samples must be 0 (off) or a positive integer, got "
                         f"{req['parity_samples']!r}")
    offsets = req["capture_offsets"]
    if not isinstance(offsets, list) or not offsets or not all(isinstance(o, int) for o in offsets):
        raise StageError(f"capture_offsets must be a non-empty list of integers such as [0] or [-1, 0, 1], "
                         f"got {offsets!r}")
    validate_request(req)
    return req


def drafter_list(value: Any) -> list[str]:
    """The request's drafter: one path, a list of them, or none."""
    if not value:
        return []
    return [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]
