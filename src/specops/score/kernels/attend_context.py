"""A block's queries against the context before its start and the block's own keys, in one pass
(`reference.attend_context` states it).

FlashAttention's kernel in torch's build tiles the queries by 128 rows; a key/value head here has 64 query
rows (4 groups x 16 block positions), so half of each tile's products are padding, and at the real
shape it read the context at about half the memory's rate. One program per (sequence, key/value head)
takes exactly its rows, walks the context before the start a tile of keys at a time with an online
softmax (float32 scores, probabilities rounded to the values' dtype before their product, as
FlashAttention does), then the block's own keys, and writes each row once in the layout o_proj reads: no
log-sum-exp, no second kernel to merge the block's keys. Imports triton: import it only where
`specops.score.kernels.applies` says yes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634

# Keys per tile, warps and pipeline stages; benchmarks/score_triton_check.py times others at the real shape.
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _attend_tile(q, k, v, key_in, top, total, acc, scale_log2):
    """One tile of keys into the running softmax (row maxima `top`, sums `total`, the mix `acc`): scores in
    base 2 (exp2 is one instruction), keys outside the tile's range at -inf."""
    s = tl.where(key_in[None, :], tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
    new_top = tl.maximum(top, tl.max(s, 1))
    probs = tl.exp2(s - new_top[:, None])
    kept = tl.exp2(top - new_top)
    total = total * kept + tl.sum(probs, 1)
    acc = acc * kept[:, None] + tl.dot(probs.to(v.dtype), v)
    return new_top, total, acc


@triton.jit
def _attend_context_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kb_ptr,
    vb_ptr,
    starts_ptr,
    out_ptr,
    heads,
    rows,
    block,
    scale_log2,
    q_seq_stride,
    q_row_stride,
    q_head_stride,
    k_seq_stride,
    k_row_stride,
    k_head_stride,
    v_seq_stride,
    v_row_stride,
    v_head_stride,
    kb_seq_stride,
    kb_row_stride,
    kb_head_stride,
    vb_seq_stride,
    vb_row_stride,
    vb_head_stride,
    row_inner,
    out_seq_stride,
    out_outer_stride,
    out_inner_stride,
    out_head_stride,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    program = tl.program_id(0)
    seq = (program // heads).to(tl.int64)
    head = (program % heads).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, D)
    row_in = r < rows
    q = tl.load(
        q_ptr + seq * q_seq_stride + head * q_head_stride + r[:, None] * q_row_stride + c[None, :],
        mask=row_in[:, None],
        other=0.0,
    )
    start = tl.load(starts_ptr + seq).to(tl.int32)
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    k_base = k_ptr + seq * k_seq_stride + head * k_head_stride
    v_base = v_ptr + seq * v_seq_stride + head * v_head_stride
    n = tl.arange(0, BLOCK_N)
    for first in range(0, start, BLOCK_N):
        j = first + n
        key_in = j < start
        k = tl.load(k_base + j[:, None] * k_row_stride + c[None, :], mask=key_in[:, None], other=0.0)
        v = tl.load(v_base + j[:, None] * v_row_stride + c[None, :], mask=key_in[:, None], other=0.0)
        top, total, acc = _attend_tile(q, k, v, key_in, top, total, acc, scale_log2)
    # The block's own keys: one tile after the context's.
    j = tl.arange(0, BLOCK_K)
    key_in = j < block
    kb = tl.load(
        kb_ptr + seq * kb_seq_stride + head * kb_head_stride + j[:, None] * kb_row_stride + c[None, :],
        mask=key_in[:, None],
        other=0.0,
    )
    vb = tl.load(
        vb_ptr + seq * vb_seq_stride + head * vb_head_stride + j[:, None] * vb_row_stride + c[None, :],
        mask=key_in[:, None],
        other=0.0,
    )
    top, total, acc = _attend_tile(q, kb, vb, key_in, top, total, acc, scale_log2)
    out_at = (r // row_inner) * out_outer_stride + (r % row_inner) * out_inner_stride
    tl.store(
        out_ptr + seq * out_seq_stride + head * out_head_stride + out_at[:, None] + c[None, :],
        (acc / total[:, None]).to(out_ptr.dtype.element_ty),
        mask=row_in[:, None],
    )


def attend_context(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """queries [B, R, heads, d]; keys, values [B, T', heads, d] (sequence b's context at rows < starts[b]);
    starts [B] integers; k_blk, v_blk [B, bs, heads, d]; out a [B, R_outer, R_inner, heads, d] view (see
    `reference.attend_context`). Any strides, the last 1; d a power of two of at least 16."""
    B, R, heads, d = queries.shape
    bs = k_blk.shape[1]
    named = {"queries": queries, "keys": keys, "values": values, "k_blk": k_blk, "v_blk": v_blk, "out": out}
    for name, tensor in named.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"attend_context: {name} needs its last dimension contiguous")
    if d < 16 or d & (d - 1):
        raise ValueError(f"attend_context: head_dim {d} is not a power of two of at least 16")
    if B * heads:
        _attend_context_kernel[(B * heads,)](
            queries,
            keys,
            values,
            k_blk,
            v_blk,
            starts.contiguous(),
            out,
            heads,
            R,
            bs,
            float(scale) * LOG2_E,
            *queries.stride()[:3],
            *keys.stride()[:3],
            *values.stride()[:3],
            *k_blk.stride()[:3],
            *v_blk.stride()[:3],
            out.shape[2],
            *out.stride()[:4],
            D=d,
            BLOCK_R=max(16, triton.next_power_of_2(R)),
            BLOCK_N=BLOCK_N,
            BLOCK_K=max(16, triton.next_power_of_2(bs)),
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )
    return out
