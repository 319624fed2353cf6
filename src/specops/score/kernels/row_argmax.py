"""The argmax of each row of the head's float32 logits, in one pass that reads them at the memory's rate.

torch.argmax over a pass's logits ([768, 248,320] float32, 763 MB) took 0.33-0.65 ms on H100s, 1.2-2.3
TB/s of their 3.35 (benchmarks/score_step_profile_h100_2026-12-06_*.json, the head's product against its
product and argmax). Here each program folds one chunk of a row to its maximum and the first index of it
(`argmax_order.takes_first`, the order torch.argmax keeps: the first maximum, a NaN above every number), and
`argmax_order.combine_partials` picks each row's token from its chunks: torch.argmax's answer, exactly, on
the same logits. Imports triton: import it only where `specops.score.kernels.reduces` says yes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.score.kernels.argmax_order import combine_partials
from specops.score.kernels.first_max import first_max

# Positions of a row per program, and its warps: each thread holds 32 of them.
CHUNK = 8192
NUM_WARPS = 8


@triton.jit
def _row_argmax_kernel(x_ptr, values_ptr, indices_ptr, N, stride_row, n_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    # Past the row's end: -inf, at indices above every real one, so it loses to any real value.
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < N, other=float("-inf"))
    best, best_index = tl.reduce((x.to(tl.float32), cols), 0, first_max)
    out = row.to(tl.int64) * n_chunks + chunk
    tl.store(values_ptr + out, best)
    tl.store(indices_ptr + out, best_index)


def chunk_maxima(logits: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [rows, chunks] float32, indices [rows, chunks] int32): each chunk of a row's maximum and the
    first index of it, for logits [rows, vocab] of any float dtype (CUDA)."""
    rows, n = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n_chunks = triton.cdiv(n, chunk)
    values = torch.empty(rows, n_chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, n_chunks, dtype=torch.int32, device=logits.device)
    _row_argmax_kernel[(rows, n_chunks)](
        logits, values, indices, n, logits.stride(0), n_chunks, BLOCK=chunk, num_warps=NUM_WARPS
    )
    return values, indices


def row_argmax(logits: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """Token ids [rows] (long) of logits [rows, vocab] (CUDA): torch.argmax(logits, dim=-1)."""
    return combine_partials(*chunk_maxima(logits, chunk))
