"""The plain reference for the batched engine (`specops.score.acceptance`): the same walk, one
sequence at a time, one block per forward, as z-lab's generate loop drafts, with the target's tokens
standing in for its verify pass. Slow and straightforward on purpose: the tests hold the engine's
acceptance lengths to it, and the development server drafts with `SequentialDrafter`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from specops.score.acceptance import SequenceAcceptance, as_input
from specops.score.drafter import DFlashAttention, DFlashDrafter
from specops.score.drafter_ops import apply_rope
from specops.score.target_head import TargetHead


def _oracle_mask(
    attn: DFlashAttention, start: int, block_size: int, device: torch.device
) -> torch.Tensor | None:
    """Visibility [bs, start + bs] of keys 0..start+bs-1 to queries start..start+bs-1."""
    return attn.visibility(
        torch.arange(start, start + block_size, device=device),
        torch.arange(start + block_size, device=device),
    )


class SequentialDrafter:
    """Drafting for one sequence the way z-lab's generate loop does: one block per forward, the
    context K/V in per-layer tensors that grow by the features of the accepted tokens before each
    block; the block's own K/V are concatenated for its forward and then dropped.
    """

    def __init__(self, drafter: DFlashDrafter, head: TargetHead, features: torch.Tensor):
        self.drafter, self.head = drafter, head
        self.device, dtype = head.device, drafter.fc.weight.dtype
        self.features = features.to(device=self.device, dtype=dtype)
        attn = drafter.decoder_layers[0].self_attn
        empty = torch.empty(1, attn.num_kv_heads, 0, attn.head_dim, dtype=dtype, device=self.device)
        self.cache = [(empty, empty) for _ in drafter.decoder_layers]
        self.cached = 0

    def block_hidden(self, token: int, start: int) -> torch.Tensor:
        """Drafter outputs [bs - 1, hidden] for the block [token, MASK...] at start (never decreasing)."""
        drafter, device, bs = self.drafter, self.device, self.drafter.block_size
        if start < self.cached:
            raise ValueError(f"block at {start} behind the cached context ({self.cached} positions)")
        if self.cached < start:
            new = drafter.context_kv(self.features[None, self.cached : start], first_position=self.cached)
            self.cache = [
                (torch.cat([k, nk], dim=-2), torch.cat([v, nv], dim=-2))
                for (k, v), (nk, nv) in zip(self.cache, new, strict=True)
            ]
            self.cached = start
        x = drafter.block_embeddings(self.head.embed, torch.tensor([token], device=device))  # [1, bs, hidden]
        cos, sin = drafter.rope(torch.arange(start, start + bs, device=device), x)
        for layer, (k_ctx, v_ctx) in zip(drafter.decoder_layers, self.cache, strict=True):
            attn = layer.self_attn
            y = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(y).view(1, bs, attn.num_heads, attn.head_dim)).transpose(1, 2)
            q = apply_rope(q, cos, sin)
            k_blk, v_blk = attn.kv(y, cos, sin)
            out = F.scaled_dot_product_attention(
                q,
                torch.cat([k_ctx, k_blk], dim=-2),
                torch.cat([v_ctx, v_blk], dim=-2),
                attn_mask=_oracle_mask(attn, start, bs, device),
                scale=attn.scaling,
                enable_gqa=True,
            )
            x = x + attn.o_proj(out.transpose(1, 2).reshape(1, bs, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return drafter.norm(x)[0, 1:]

    def drafts(self, token: int, start: int) -> list[int]:
        hidden = self.block_hidden(token, start)
        return self.head.argmax(hidden, self.drafter.output_multiplier, self.drafter.logit_softcap).tolist()


@torch.inference_mode()
def sequential_acceptance(drafter: DFlashDrafter, head: TargetHead, sequence: Any) -> SequenceAcceptance:
    """The oracle: a straightforward loop, one block at a time, as z-lab's generate loop drafts,
    with the target's tokens standing in for its verify pass (see `SequentialDrafter`).
    """
    seq = as_input(sequence)
    seq.validate(drafter)
    ids = seq.input_ids.tolist()
    L, bs = len(ids), drafter.block_size
    state = SequentialDrafter(drafter, head, seq.features)
    result = SequenceAcceptance(seq.id, bs)
    s = seq.prompt_len
    while s < L - 1:
        drafts = state.drafts(ids[s], s)
        remaining = L - 1 - s
        k = 0
        while k < min(bs - 1, remaining) and drafts[k] == ids[s + 1 + k]:
            k += 1
        a = min(k + 1, remaining)
        result.accept_lengths.append(a)
        result.block_starts.append(s)
        s += a
    return result
