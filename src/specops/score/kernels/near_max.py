"""The tokens of each row whose rounded logit lies at or above a floor: the candidates for its argmax.

The head's logits rounded to half precision settle most rows' argmax alone; where several tokens lie within
one rounding step of the row's maximum, their logits must be recomputed in float32
(`specops.score.rounded_argmax`). This kernel finds them: one program per chunk of a row, which returns at
once where the chunk's maximum (`row_argmax.chunk_maxima`) lies below the row's floor, so that only the
few chunks holding the top of a row are read again. Each row's candidates are appended through an atomic
counter, so their order is not fixed, and the counter keeps counting past the room for them: a count
above it (or none) tells the caller that the candidates are not all there. Imports triton: import it
only where `specops.score.kernels.applies` says yes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.score.kernels.row_argmax import CHUNK, NUM_WARPS


@triton.jit
def _near_max_kernel(
    x_ptr,
    chunk_max_ptr,
    floor_ptr,
    found_ptr,
    count_ptr,
    N,
    stride_row,
    n_chunks,
    ROOM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    floor = tl.load(floor_ptr + row)
    top = tl.load(chunk_max_ptr + row.to(tl.int64) * n_chunks + chunk)
    # A NaN floor or chunk maximum compares false: the chunk is skipped and the caller sees the row's count.
    if top >= floor:
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < N, other=float("-inf"))
        near = (x.to(tl.float32) >= floor).to(tl.int32)
        first = tl.atomic_add(count_ptr + row, tl.sum(near, axis=0))
        slot = first + tl.cumsum(near, axis=0) - 1
        tl.store(found_ptr + row.to(tl.int64) * ROOM + slot, cols, mask=(near > 0) & (slot < ROOM))


def near_max(
    logits: torch.Tensor,
    chunk_values: torch.Tensor,
    floor: torch.Tensor,
    room: int,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(found [rows, room] int32, -1 where unused; count [rows] int32): the positions of logits [rows,
    vocab] at or above floor [rows] (float32), in any order, the first `room` of them; count is how many
    there are. chunk_values [rows, chunks]: each chunk's maximum (`chunk_maxima` with the same chunk)."""
    rows, n = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    found = torch.full((rows, room), -1, dtype=torch.int32, device=logits.device)
    count = torch.zeros(rows, dtype=torch.int32, device=logits.device)
    _near_max_kernel[(rows, chunk_values.shape[1])](
        logits,
        chunk_values.contiguous(),
        floor.contiguous(),
        found,
        count,
        n,
        logits.stride(0),
        chunk_values.shape[1],
        ROOM=room,
        BLOCK=chunk,
        num_warps=NUM_WARPS,
    )
    return found, count
