"""The target head's product with its argmax in the epilogue: no float32 logits are written.

Each program computes one tile of rows x tokens of hidden @ lm_head.T with float32 accumulation, scales
it by the output multiplier as `TargetHead._finish` does (in float32), and reduces it to each row's
maximum and the first token holding it (`argmax_order.takes_first`). What leaves the kernel is
[rows, tiles] of those partials (8 bytes a tile, against 4 x block_n bytes of logits);
`argmax_order.combine_partials` picks each row's token. Imports triton: import it only where
`specops.score.kernels.applies` says yes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specops.score.kernels.argmax_order import combine_partials
from specops.score.kernels.first_max import first_max

# Tile sizes and launch settings; benchmarks/score_triton_check.py times a few others beside these. The
# fastest of nine on an H100 at 768, 349 and 140 rows: 2.86, 1.52 and 1.13 ms, against 2.77, 1.41 and
# 1.05 ms for torch's product and argmax (benchmarks/score_triton_check_h100_2026-12-06_tiles.json).
TILES = {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 4}


@triton.jit
def _head_argmax_kernel(
    x_ptr,
    w_ptr,
    values_ptr,
    indices_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    n_tiles,
    multiplier,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(M, BLOCK_M)
    # The row tiles of one vocabulary tile run next to each other: that lm_head tile is read from memory
    # once and from the L2 cache after (the rows, a few MB, stay there).
    pid_m = pid % row_tiles
    pid_n = pid // row_tiles
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Rows and tokens past the end wrap around (read, never stored): the loads need no mask.
    x_ptrs = x_ptr + (rows % M).to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + (cols % N).to(tl.int64)[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(ks + k < K)[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=(ks + k < K)[:, None], other=0.0)
        acc += tl.dot(x, w)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * multiplier
    # Tokens past the vocabulary lose to every real one: -inf, and an index above all of the tile's.
    acc = tl.where((cols < N)[None, :], acc, float("-inf"))
    index = tl.broadcast_to(cols[None, :], (BLOCK_M, BLOCK_N))
    best, best_index = tl.reduce((acc, index), 1, first_max)
    out = rows * n_tiles + pid_n
    tl.store(values_ptr + out, best, mask=rows < M)
    tl.store(indices_ptr + out, best_index, mask=rows < M)


def head_argmax_partials(
    x: torch.Tensor, weight: torch.Tensor, multiplier: float = 1.0, **tiles: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [rows, tiles] float32, indices [rows, tiles] int32) of x [rows, hidden] @ weight.T
    [vocab, hidden] (CUDA, one half dtype): each vocabulary tile's row maxima and first index."""
    settings = {**TILES, **tiles}
    M, K = x.shape
    N = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    # tl.dot wants 16 rows at least; fewer rows than the tile (the oracle's 15) take a smaller one.
    block_m = min(settings["block_m"], max(16, triton.next_power_of_2(M)))
    block_n, block_k = settings["block_n"], settings["block_k"]
    n_tiles = triton.cdiv(N, block_n)
    values = torch.empty(M, n_tiles, dtype=torch.float32, device=x.device)
    indices = torch.empty(M, n_tiles, dtype=torch.int32, device=x.device)
    grid = (triton.cdiv(M, block_m) * n_tiles,)
    _head_argmax_kernel[grid](
        x,
        weight,
        values,
        indices,
        M,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        n_tiles,
        float(multiplier),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=K % block_k == 0,
        num_warps=settings["num_warps"],
        num_stages=settings["num_stages"],
    )
    return values, indices


def head_argmax(x: torch.Tensor, weight: torch.Tensor, multiplier: float = 1.0, **tiles: int) -> torch.Tensor:
    """Token ids [rows] (long): argmax over the vocabulary of x @ weight.T * multiplier, ties to the
    lowest token, NaN as torch.argmax takes it."""
    return combine_partials(*head_argmax_partials(x, weight, multiplier, **tiles))
