"""What a tau buys: the expected speedup of speculative decoding over plain decoding.

Model (one request, greedy): without a drafter every output token costs one target decode step.
With one, every cycle costs one drafter step (DFlash drafts the whole block in one forward) plus one
target verify step over the block, and yields tau tokens on average. In units of a target decode step:

    speedup = tau / (draft_cost + verify_cost)

draft_cost and verify_cost are measured where possible (benchmarks/speedup_h200.py times both on the
GPU and checks the prediction against the measured speedup). Otherwise they are estimated:
decoding is memory-bound, so a step costs what it reads: verify_cost = 1 (the block's extra tokens
are free while the GPU waits for weights) and draft_cost = the bytes of the drafter's weights plus
the target's lm_head (which the drafter calls) over the bytes of the target's weights. The estimate
leaves out the KV cache reads, the scheduler's overhead and batching: at large batch sizes decoding
becomes compute-bound and the verify step costs up to block_size decode steps.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


def weight_bytes(model_dir: str | Path, suffix: str = "") -> int:
    """Bytes of a checkpoint's tensors (those whose name ends with suffix), from safetensors headers."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, meta in header.items():
            if name == "__metadata__" or not name.endswith(suffix):
                continue
            count = 1
            for dim in meta["shape"]:
                count *= dim
            total += count * DTYPE_BYTES.get(meta["dtype"], 2)
    return total


def estimated_costs(target_dir: str | Path, drafter_dir: str | Path) -> dict[str, float]:
    """draft_cost and verify_cost in target decode steps, from the bytes each step reads."""
    target = weight_bytes(target_dir)
    if not target:
        raise ValueError(f"{target_dir} holds no safetensors weights to size the target's decode step")
    head = weight_bytes(target_dir, "lm_head.weight") or weight_bytes(target_dir, "embed_tokens.weight")
    return {"draft_cost": (weight_bytes(drafter_dir) + head) / target, "verify_cost": 1.0}


def expected_speedup(tau: float | None, draft_cost: float, verify_cost: float) -> float | None:
    if tau is None:
        return None
    return tau / (draft_cost + verify_cost)


def model_description(source: str, measured: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The report's statement of the model and the assumptions behind its costs."""
    assumptions = [
        "one request at a time, greedy decoding; every cycle drafts one block in one drafter forward and "
        "verifies it in one target forward",
        "costs are in target decode steps (the time plain decoding spends per output token)",
    ]
    if source == "measured":
        assumptions.append(f"costs measured on the GPU by benchmarks/speedup_h200.py: {dict(measured or {})}")
    else:
        assumptions += [
            "costs estimated, not measured: decoding is memory-bound, so a step costs the weight bytes it "
            "reads; verify_cost = 1 (the block's extra tokens are free while the GPU waits for weights), "
            "draft_cost = (drafter weights + the target's lm_head) / the target's weights",
            "left out: KV-cache reads, scheduling overhead, batching (a large batch makes decoding "
            "compute-bound and a verify step then costs up to block_size decode steps)",
            "calibration (benchmarks/speedup_h200.json): with measured costs the model predicted the "
            "measured speedup within 0.32%; the estimate overpredicted a small launch-bound model by "
            "52-128%, so measure the costs where the weights are small",
        ]
    return {
        "formula": "expected speedup = tau / (draft_cost + verify_cost)",
        "source": source,
        "assumptions": assumptions,
    }
