"""SiLU(gate) * up in one pass over the MLP's fused gate-up product (`reference.silu_mul` states it).

gate and up are the two halves of one product's rows (`DFlashLayer.feed_forward`): each program reads
a stretch of one row's gate and the same stretch of its up and writes that stretch of the output,
computed in float32 and rounded once. Eager torch reads gate, writes SiLU(gate), reads both again and
writes the product. Imports triton: import it only where `specops.score.kernels.applies` says yes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n_cols, gate_stride, up_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    gate = tl.load(gate_ptr + row * gate_stride + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_stride + cols, mask=inside, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate, up [rows, n] (any row stride, CUDA, one half dtype) -> [rows, n]."""
    rows, n = gate.shape
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if up.stride(-1) != 1:
        up = up.contiguous()
    out = torch.empty(rows, n, dtype=gate.dtype, device=gate.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, BLOCK))](
            gate, up, out, n, gate.stride(0), up.stride(0), BLOCK=BLOCK, num_warps=4
        )
    return out
