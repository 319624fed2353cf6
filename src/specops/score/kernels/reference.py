"""What each Triton kernel of this package computes, in torch: the kernels are checked against these
(benchmarks/score_triton_check.py on a GPU), and the engine's wiring is tested on the CPU with these in
the kernels' place. Same signatures as the kernels' launchers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specops.score.kernels.argmax_order import combine_partials, takes_first


def head_argmax(
    x: torch.Tensor, weight: torch.Tensor, multiplier: float = 1.0, block_n: int = 128
) -> torch.Tensor:
    """Token ids [rows] of argmax(x @ weight.T * multiplier) through the kernel's steps: float32 logits,
    each tile of block_n tokens folded to (maximum, first index) with `takes_first`, the tiles combined."""
    values, indices = head_argmax_partials(x, weight, multiplier, block_n)
    return combine_partials(values, indices)


def head_argmax_partials(
    x: torch.Tensor, weight: torch.Tensor, multiplier: float, block_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [rows, tiles] float32, indices [rows, tiles] int32): each tile's row maxima and first index."""
    logits = F.linear(x.float(), weight.float()) * multiplier
    rows, vocab = logits.shape
    tiles = -(-vocab // block_n)
    # The kernel's padding: columns past the vocabulary are -inf, with indices past it.
    padded = logits.new_full((rows, tiles * block_n), float("-inf"))
    padded[:, :vocab] = logits
    values = padded.view(rows, tiles, block_n)
    index = torch.arange(tiles * block_n, dtype=torch.int32, device=x.device).view(1, tiles, block_n)
    indices = index.expand(rows, tiles, block_n)
    return fold(values, indices)


def fold(values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce the last dimension pairwise with `takes_first` (a tree, as a kernel's reduction runs)."""
    while values.shape[-1] > 1:
        if values.shape[-1] % 2:
            values = torch.cat([values, values[..., -1:]], dim=-1)
            indices = torch.cat([indices, indices[..., -1:]], dim=-1)
        va, vb = values[..., 0::2], values[..., 1::2]
        ia, ib = indices[..., 0::2], indices[..., 1::2]
        first = takes_first(va, ia, vb, ib)
        values, indices = torch.where(first, va, vb), torch.where(first, ia, ib)
    return values[..., 0], indices[..., 0]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up [rows, n] in float32, rounded once (as SGLang's fused silu_and_mul; torch's eager
    act_fn(gate).mul_(up) rounds twice)."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE of RMSNorm(x) for x [tokens, heads, head_dim]; cos/sin [rows, head_dim], token t reading row
    t % rows. The norm as torch's rms_norm (float32, times the weight, rounded once), the rotation in
    float32 and rounded once (eager `apply_rope` rounds x * cos before adding the other half's term).
    out: a [tokens_outer, tokens_inner, heads_outer, heads_inner, head_dim] view to write into."""
    tokens, d = x.shape[0], x.shape[-1]
    normed = F.rms_norm(x.float(), (d,), weight.float(), eps).to(x.dtype).float()
    per_token = torch.arange(tokens, device=x.device) % cos.shape[0]
    c, s = cos[per_token].float()[:, None, :], sin[per_token].float()[:, None, :]
    half = d // 2
    lo, hi = normed[..., :half], normed[..., half:]
    rotated = torch.cat(
        [lo * c[..., :half] - hi * s[..., :half], hi * c[..., half:] + lo * s[..., half:]], dim=-1
    ).to(x.dtype)
    if out is None:
        return rotated
    return out.copy_(rotated.view(out.shape))


def attend_block(
    queries: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    o_ctx: torch.Tensor,
    lse_ctx: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Each sequence's queries [B, R, heads, d] against its block's own keys and values [B, bs, heads, d],
    merged with their attention to the context: o_ctx [B, R, heads, d] normalised by its log-sum-exp
    lse_ctx [B, R, heads] (float32; +inf, FlashAttention's mark of a row that saw no key, counts as no
    context). Scores and the merge in float32, the block's probabilities rounded to the values' dtype
    before their product (as FlashAttention does), the result rounded once into out, a
    [B, R_outer, R_inner, heads, d] view taking row r at (r // R_inner, r % R_inner)."""
    q = queries.float().transpose(1, 2)  # [B, heads, R, d]
    scores = q @ k_blk.float().permute(0, 2, 3, 1) * scale  # [B, heads, R, bs]
    lse = lse_ctx.float().transpose(1, 2)  # [B, heads, R]
    lse = torch.where(lse == float("inf"), torch.full_like(lse, float("-inf")), lse)
    top = torch.maximum(scores.amax(dim=-1), lse)
    probs = torch.exp(scores - top[..., None])
    context_weight = torch.exp(lse - top)
    mixed = probs.to(v_blk.dtype).float() @ v_blk.float().transpose(1, 2)  # [B, heads, R, d]
    merged = (o_ctx.float().transpose(1, 2) * context_weight[..., None] + mixed) / (
        probs.sum(dim=-1) + context_weight
    )[..., None]
    return out.copy_(merged.transpose(1, 2).reshape(out.shape).to(out.dtype))


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
    """Each sequence's queries [B, R, heads, d] against its context before its start (keys, values
    [B, T', heads, d], rows < starts[b]) and its block's own keys and values [B, bs, heads, d]: scores in
    float32, the probabilities rounded to the values' dtype before their product (as FlashAttention
    does), the result rounded once into out, a [B, R_outer, R_inner, heads, d] view taking row r at
    (r // R_inner, r % R_inner)."""
    B, R, heads, d = queries.shape
    for b in range(B):
        start = int(starts[b])
        k = torch.cat([keys[b, :start], k_blk[b]]).float().transpose(0, 1)  # [heads, keys, d]
        v = torch.cat([values[b, :start], v_blk[b]]).transpose(0, 1)
        scores = queries[b].float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, R, keys]
        probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        mixed = probs.to(v.dtype).float() @ v.float() / probs.sum(dim=-1, keepdim=True)
        out[b].copy_(mixed.transpose(0, 1).reshape(out[b].shape).to(out.dtype))
    return out
