"""A block's queries against the block's own keys, merged with their attention to the context
(`reference.attend_block` states it).

FlashAttention's variable-length kernel attends each block's queries to the context before the block's
start alone (`specops.score.block_attention.flash`) and returns, beside its output, each row's
log-sum-exp. The block's own keys are a handful (block_size) per sequence: one program per (sequence,
key/value head) takes that head's query rows (groups x block), scores them against the block's keys,
and merges the two softmaxes through the log-sum-exps, in float32, writing each row once, in the layout
o_proj reads. Nothing is written into the context's buffers, so nothing has to be put back.
Imports triton: import it only where `specops.score.kernels.applies` says yes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _attend_block_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    out_ptr,
    heads,
    rows,
    block,
    scale,
    q_seq_stride,
    q_row_stride,
    q_head_stride,
    k_seq_stride,
    k_row_stride,
    k_head_stride,
    v_seq_stride,
    v_row_stride,
    v_head_stride,
    o_seq_stride,
    o_row_stride,
    o_head_stride,
    lse_seq_stride,
    lse_row_stride,
    lse_head_stride,
    row_inner,
    out_seq_stride,
    out_outer_stride,
    out_inner_stride,
    out_head_stride,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    program = tl.program_id(0)
    seq = (program // heads).to(tl.int64)
    head = (program % heads).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    j = tl.arange(0, BLOCK_K)
    c = tl.arange(0, BLOCK_D)
    row_in = r < rows
    key_in = j < block
    col_in = c < D
    q = tl.load(
        q_ptr + seq * q_seq_stride + head * q_head_stride + r[:, None] * q_row_stride + c[None, :],
        mask=row_in[:, None] & col_in[None, :],
        other=0.0,
    )
    k = tl.load(
        k_ptr + seq * k_seq_stride + head * k_head_stride + j[:, None] * k_row_stride + c[None, :],
        mask=key_in[:, None] & col_in[None, :],
        other=0.0,
    )
    v = tl.load(
        v_ptr + seq * v_seq_stride + head * v_head_stride + j[:, None] * v_row_stride + c[None, :],
        mask=key_in[:, None] & col_in[None, :],
        other=0.0,
    )
    scores = tl.dot(q, tl.trans(k)) * scale
    scores = tl.where(key_in[None, :], scores, float("-inf"))
    lse = tl.load(
        lse_ptr + seq * lse_seq_stride + r * lse_row_stride + head * lse_head_stride,
        mask=row_in,
        other=float("-inf"),
    )
    # FlashAttention marks a row that saw no key with +inf: no context, not an infinite one.
    lse = tl.where(lse == float("inf"), float("-inf"), lse)
    top = tl.maximum(tl.max(scores, 1), lse)
    probs = tl.exp(scores - top[:, None])
    context_weight = tl.exp(lse - top)
    mixed = tl.dot(probs.to(v.dtype), v)
    o = tl.load(
        o_ptr + seq * o_seq_stride + head * o_head_stride + r[:, None] * o_row_stride + c[None, :],
        mask=row_in[:, None] & col_in[None, :],
        other=0.0,
    ).to(tl.float32)
    merged = (o * context_weight[:, None] + mixed) / (tl.sum(probs, 1) + context_weight)[:, None]
    out_at = (r // row_inner) * out_outer_stride + (r % row_inner) * out_inner_stride
    tl.store(
        out_ptr + seq * out_seq_stride + head * out_head_stride + out_at[:, None] + c[None, :],
        merged.to(out_ptr.dtype.element_ty),
        mask=row_in[:, None] & col_in[None, :],
    )


def attend_block(
    queries: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    o_ctx: torch.Tensor,
    lse_ctx: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """queries, o_ctx [B, R, heads, d]; k_blk, v_blk [B, bs, heads, d]; lse_ctx [B, R, heads] float32;
    out a [B, R_outer, R_inner, heads, d] view (see `reference.attend_block`). Any strides, the last 1."""
    B, R, heads, d = queries.shape
    bs = k_blk.shape[1]
    named = {"queries": queries, "k_blk": k_blk, "v_blk": v_blk, "o_ctx": o_ctx, "out": out}
    for name, tensor in named.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"attend_block: {name} needs its last dimension contiguous")
    if B * heads:
        _attend_block_kernel[(B * heads,)](
            queries,
            k_blk,
            v_blk,
            o_ctx,
            lse_ctx,
            out,
            heads,
            R,
            bs,
            float(scale),
            queries.stride(0),
            queries.stride(1),
            queries.stride(2),
            k_blk.stride(0),
            k_blk.stride(1),
            k_blk.stride(2),
            v_blk.stride(0),
            v_blk.stride(1),
            v_blk.stride(2),
            o_ctx.stride(0),
            o_ctx.stride(1),
            o_ctx.stride(2),
            lse_ctx.stride(0),
            lse_ctx.stride(1),
            lse_ctx.stride(2),
            out.shape[2],
            out.stride(0),
            out.stride(1),
            out.stride(2),
            out.stride(3),
            D=d,
            BLOCK_D=max(16, triton.next_power_of_2(d)),
            BLOCK_R=max(16, triton.next_power_of_2(R)),
            BLOCK_K=max(16, triton.next_power_of_2(bs)),
            num_warps=4,
        )
    return out
