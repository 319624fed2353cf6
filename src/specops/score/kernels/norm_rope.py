"""The queries' and keys' RMSNorm and RoPE in one pass (`reference.norm_rope` states it).

Each program takes a few (token, head) rows of head_dim values: the mean of squares in float32, times
the norm's weight, rounded once to the input's dtype (torch's rms_norm, as `drafter_ops.RMSNorm`), then
the rotation with that token's cos and sin in float32, rounded once. Eager torch reads and writes the
heads five times for the same. The input may be a strided view (the fused q/k/v product's columns);
the output is contiguous, or written into a given view in another layout (the queries folded for the
attention kernel, `specops.score.block_attention.query_buffer`), which saves the attention a copy.
Imports triton: import it only where `specops.score.kernels.applies` says yes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_rows,
    heads,
    x_token_stride,
    x_head_stride,
    token_inner,
    out_token_outer_stride,
    out_token_inner_stride,
    head_inner,
    out_head_outer_stride,
    out_head_inner_stride,
    cos_rows,
    cos_stride,
    sin_stride,
    eps,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_HALF)
    inside = (rows < n_rows)[:, None] & (cols < HALF)[None, :]
    token = (rows // heads).to(tl.int64)
    head = (rows % heads).to(tl.int64)
    x_row = (x_ptr + token * x_token_stride + head * x_head_stride)[:, None] + cols[None, :]
    lo = tl.load(x_row, mask=inside, other=0.0).to(tl.float32)
    hi = tl.load(x_row + HALF, mask=inside, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt((tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / (2 * HALF) + eps)
    weight_lo = tl.load(weight_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    weight_hi = tl.load(weight_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # Rounded as the norm's output is on the eager path, before the rotation reads it.
    lo = (lo * rstd[:, None] * weight_lo[None, :]).to(dtype).to(tl.float32)
    hi = (hi * rstd[:, None] * weight_hi[None, :]).to(dtype).to(tl.float32)
    angle_row = token % cos_rows
    cos_row = (cos_ptr + angle_row * cos_stride)[:, None] + cols[None, :]
    sin_row = (sin_ptr + angle_row * sin_stride)[:, None] + cols[None, :]
    cos_lo = tl.load(cos_row, mask=inside, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_row + HALF, mask=inside, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_row, mask=inside, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_row + HALF, mask=inside, other=0.0).to(tl.float32)
    out_at = (
        (token // token_inner) * out_token_outer_stride
        + (token % token_inner) * out_token_inner_stride
        + (head // head_inner) * out_head_outer_stride
        + (head % head_inner) * out_head_inner_stride
    )
    out_row = (out_ptr + out_at)[:, None] + cols[None, :]
    tl.store(out_row, (lo * cos_lo - hi * sin_lo).to(dtype), mask=inside)
    tl.store(out_row + HALF, (hi * cos_hi + lo * sin_hi).to(dtype), mask=inside)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE of RMSNorm(x) for x [tokens, heads, head_dim] (head_dim even, last stride 1 or copied);
    cos/sin [rows, head_dim], token t reading row t % rows -> [tokens, heads, head_dim] contiguous, or
    written into out: a view [tokens_outer, tokens_inner, heads_outer, heads_inner, head_dim] (any strides,
    the last 1) whose element [to, ti, ho, hi] takes token to * tokens_inner + ti, head ho * heads_inner +
    hi; out is returned then."""
    tokens, heads, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    if out is None:
        out = torch.empty(tokens, heads, d, dtype=x.dtype, device=x.device)
        layout = (1, heads * d, 0, 1, d, 0)
    else:
        _, t_in, _, h_in, _ = out.shape
        if out.shape[0] * t_in != tokens or out.shape[2] * h_in != heads or out.stride(-1) != 1:
            raise ValueError(f"norm_rope: out {tuple(out.shape)} does not hold x {tuple(x.shape)}")
        layout = (t_in, out.stride(0), out.stride(1), h_in, out.stride(2), out.stride(3))
    n_rows = tokens * heads
    if n_rows:
        half = d // 2
        _norm_rope_kernel[(triton.cdiv(n_rows, BLOCK_ROWS),)](
            x,
            weight,
            cos,
            sin,
            out,
            n_rows,
            heads,
            x.stride(0),
            x.stride(1),
            *layout,
            cos.shape[0],
            cos.stride(0),
            sin.stride(0),
            float(eps),
            HALF=half,
            BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_ROWS=BLOCK_ROWS,
            num_warps=4,
        )
    return out
