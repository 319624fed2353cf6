"""The kernel check: fla's chunk_gated_delta_rule run against transformers' torch reference (in fp32 on
the same inputs) at each requested size, and the relative errors against GDR_TOLERANCE.
"""

from __future__ import annotations

import math
import time
from typing import Any

from specops.envcheck.facts import torch_reference
from specops.stage import StageError, log

# Relative error ||kernel - reference|| / ||reference|| (Frobenius; the larger of the output's and
# the final state's) allowed per input dtype. The reference is always fp32 on the kernel's own
# (rounded) inputs, so this measures the kernel's arithmetic only. fla 0.6.0 on an H200 measured
# 1.5e-3 with fp32 inputs (its triton dots use TF32) and 3.9e-3 with bf16 inputs, at every shape of
# benchmarks/fla_env_h200.sh: the tolerances leave 3-5x headroom and still catch a wrong kernel
# (a skipped q/k l2norm or a transposed state is off by O(1)).
GDR_TOLERANCE = {"float32": 5e-3, "bfloat16": 2e-2}

# Small enough for any GPU in a second, shaped to hit the awkward cases: a sequence that is not a
# multiple of the 64-token chunk, and grouped value heads (more value heads than key heads).
DEFAULT_GDR_SIZES: list[dict[str, Any]] = [
    {
        "batch": 2,
        "seq_len": 300,
        "k_heads": 2,
        "v_heads": 4,
        "head_k_dim": 64,
        "head_v_dim": 64,
        "dtype": "float32",
    },
    {
        "batch": 2,
        "seq_len": 300,
        "k_heads": 2,
        "v_heads": 4,
        "head_k_dim": 64,
        "head_v_dim": 64,
        "dtype": "bfloat16",
    },
]
SIZE_KEYS = ("batch", "seq_len", "k_heads", "v_heads", "head_k_dim", "head_v_dim")


def normalize_sizes(sizes: Any) -> list[dict[str, Any]]:
    """Validate `gdr_sizes` from the request; each entry names every dimension and a dtype."""
    if sizes is None:
        return [dict(size) for size in DEFAULT_GDR_SIZES]
    if not isinstance(sizes, list) or not sizes:
        raise StageError(
            "gdr_sizes must be a non-empty list of shapes, e.g. [{'batch': 1, 'seq_len': 2048, "
            "'k_heads': 16, 'v_heads': 48, 'head_k_dim': 128, 'head_v_dim': 128}]"
        )
    normalized = []
    for position, size in enumerate(sizes):
        if not isinstance(size, dict):
            raise StageError(f"gdr_sizes[{position}] must be a mapping of {', '.join(SIZE_KEYS)} and dtype")
        merged = {**DEFAULT_GDR_SIZES[0], **size}
        unknown = sorted(set(merged) - set(SIZE_KEYS) - {"dtype"})
        if unknown:
            raise StageError(
                f"gdr_sizes[{position}] has unknown keys {unknown}: use {', '.join(SIZE_KEYS)}, dtype"
            )
        for key in SIZE_KEYS:
            if not isinstance(merged[key], int) or merged[key] < 1:
                raise StageError(
                    f"gdr_sizes[{position}].{key} must be a positive integer, got {merged[key]!r}"
                )
        if merged["v_heads"] % merged["k_heads"]:
            raise StageError(
                f"gdr_sizes[{position}]: v_heads {merged['v_heads']} must be a multiple of k_heads "
                f"{merged['k_heads']} (grouped value heads)"
            )
        if merged["dtype"] not in GDR_TOLERANCE:
            raise StageError(
                f"gdr_sizes[{position}].dtype {merged['dtype']!r} is not one of {sorted(GDR_TOLERANCE)}"
            )
        normalized.append(merged)
    return normalized


def gdr_inputs(size: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """fp32 CPU inputs shaped and scaled like a Qwen3.5 Gated DeltaNet layer's (reproducible)."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(seed)
    b, t, h, hv = size["batch"], size["seq_len"], size["k_heads"], size["v_heads"]
    dk, dv = size["head_k_dim"], size["head_v_dim"]
    # The layer's decay is -exp(A_log) * softplus(a + dt_bias) with exp(A_log) drawn from (0, 16).
    rate = torch.rand(hv, generator=generator) * 16
    return {
        "q": torch.randn(b, t, h, dk, generator=generator),
        "k": torch.randn(b, t, h, dk, generator=generator),
        "v": torch.randn(b, t, hv, dv, generator=generator),
        "g": -rate * F.softplus(torch.randn(b, t, hv, generator=generator)),
        "beta": torch.sigmoid(torch.randn(b, t, hv, generator=generator)),
    }


def _errors(got: Any, want: Any) -> tuple[float, float]:
    diff = got.float() - want
    return float(diff.abs().max()), float(diff.norm() / want.norm().clamp_min(1e-30))


def compare_gdr(
    kernel: Any, reference: Any, size: dict[str, Any], device: str, seed: int = 0
) -> dict[str, Any]:
    """Run `kernel` and the fp32 `reference` on the same inputs; return the errors and the verdict.

    The kernel gets q, k, v and beta in `size['dtype']` and g in fp32, as the Qwen3.5 layer passes
    them; the reference gets exactly those values upcast to fp32.
    """
    import torch

    dtype = getattr(torch, size["dtype"])
    raw = gdr_inputs(size, seed)
    inputs = {
        name: value.to(device=device, dtype=torch.float32 if name == "g" else dtype)
        for name, value in raw.items()
    }
    options = {"output_final_state": True, "use_qk_l2norm_in_kernel": True}
    with torch.no_grad():
        started = time.perf_counter()
        out, state = kernel(
            inputs["q"], inputs["k"], inputs["v"], g=inputs["g"], beta=inputs["beta"], **options
        )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        # The first call at a shape includes triton's compilation and autotuning.
        kernel_seconds = time.perf_counter() - started
        ref_inputs = {name: value.float() for name, value in inputs.items()}
        ref_out, ref_state = reference(
            ref_inputs["q"],
            ref_inputs["k"],
            ref_inputs["v"],
            g=ref_inputs["g"],
            beta=ref_inputs["beta"],
            **options,
        )
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    if tuple(out.shape) != tuple(ref_out.shape) or tuple(state.shape) != tuple(ref_state.shape):
        raise StageError(
            f"the kernel's output shapes {tuple(out.shape)}/{tuple(state.shape)} differ from the reference's "
            f"{tuple(ref_out.shape)}/{tuple(ref_state.shape)}: fla and transformers disagree on the layout"
        )
    out_abs, out_rel = _errors(out, ref_out)
    state_abs, state_rel = _errors(state, ref_state)
    finite = all(math.isfinite(value) for value in (out_abs, out_rel, state_abs, state_rel))
    tolerance = GDR_TOLERANCE[size["dtype"]]
    return {
        **size,
        "device": device,
        "output_max_abs_error": out_abs,
        "output_rel_error": out_rel,
        "state_max_abs_error": state_abs,
        "state_rel_error": state_rel,
        "tolerance": tolerance,
        "kernel_seconds": round(kernel_seconds, 3),
        "ok": finite and max(out_rel, state_rel) <= tolerance,
    }


def run_gdr_checks(sizes: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """fla's chunk_gated_delta_rule on cuda:0 against the torch reference, at every size."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    reference, reference_name = torch_reference()
    checks = []
    try:
        for size in sizes:
            log(f"envcheck: gated delta rule {size} on cuda:0")
            checks.append(compare_gdr(chunk_gated_delta_rule, reference, size, "cuda:0", seed))
    finally:
        torch.cuda.empty_cache()
    return summarize_checks(checks, reference_name)


def summarize_checks(checks: list[dict[str, Any]], reference_name: str) -> dict[str, Any]:
    return {
        "ran": True,
        "error": None,
        "reference": reference_name,
        "kernel": "fla.ops.gated_delta_rule.chunk_gated_delta_rule",
        "checks": checks,
        "max_abs_error": max(max(c["output_max_abs_error"], c["state_max_abs_error"]) for c in checks),
        "rel_error": max(max(c["output_rel_error"], c["state_rel_error"]) for c in checks),
        "ok": all(c["ok"] for c in checks),
    }
