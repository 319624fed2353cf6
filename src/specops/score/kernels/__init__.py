"""Triton kernels for the scoring engine's hot paths, each beside a torch statement of what it computes.

- `head_argmax`: the target head's product with its argmax in the epilogue: each tile of rows x tokens
  is reduced to its rows' maximum and the first token holding it, so no float32 logits are written;
  `argmax_order` states the order (ties to the lowest token, NaN above all, as torch.argmax) and
  combines the tiles' partials; `first_max` is that order compiled for the kernel.
- `silu_mul`: SiLU(gate) * up, reading the MLP's fused gate-up product once.
- `norm_rope`: the queries' and keys' RMSNorm and RoPE in one pass.
- `reference`: what each kernel computes, in torch (the CPU tests and benchmarks/score_triton_check.py
  compare against it).

The kernel modules import triton at their top, so they are imported only where `applies` says yes: a
torch without triton (CI, the CPU) imports the engine and runs its torch paths.
"""

from __future__ import annotations

import functools
import warnings

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (once per process; a broken install counts as absent)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def applies(*tensors: torch.Tensor) -> bool:
    """The rule for every kernel here: CUDA tensors of one half-precision dtype, no gradient wanted (the
    kernels have no backward), and triton importable; anything else takes the torch path."""
    if not all(t.device.type == "cuda" and t.dtype in HALF_DTYPES for t in tensors):
        return False
    if len({t.dtype for t in tensors}) != 1:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return triton_available()


def failure(error: Exception, consequence: str) -> str:
    """A fast path's failure to build or run, in one line (its type and its message's first line), warned
    once with what runs instead (consequence, "{}" standing for the line); returns the line, which the
    caller keeps so that the fast path is not tried again."""
    text = str(error)
    line = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
    warnings.warn(consequence.format(line), RuntimeWarning, stacklevel=4)
    return line
