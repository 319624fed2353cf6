"""The DFlash drafter: a few Qwen3 layers that draft a block of tokens from the target's hidden states.

Architecture (z-lab's DFlashDraftModel, block diffusion):
- `fc` projects the concatenated target features of the captured layers to the drafter's width, then
  `hidden_norm` normalises them: these are the *context*.
- Every layer's attention takes its queries from the block only; its keys and values are the
  context's (k_proj/v_proj of the same normalised features, k_norm, RoPE at the context positions)
  followed by the block's own. Inside a block attention is bidirectional.
- A block starting at position s is `[token at s, MASK x (block_size - 1)]` at positions
  s..s+block_size-1; its context is the target's features at positions 0..s-1. The outputs at block
  positions 1..block_size-1, through the *target's* lm_head, are the drafts for s+1..s+block_size-1.
- The drafter has no embedding and no lm_head of its own (see `specops.target_head`).

Because the context K/V never depend on the block, `context_kv` computes them once for a whole
sequence and `forward` drafts many blocks at once, each block seeing only the context before it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from specops.dflash_config import DrafterError, dflash_value, target_layer_ids

SUPPORTED_ARCHITECTURES = ("DFlashDraftModel",)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def select_target_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Stack HF `output_hidden_states` for target layer ids: layer k is `hidden_states[k + 1]`.

    Index 0 is the embedding output, so layer k's output sits one further; returns [..., L, n, hidden].
    The last entry is after the final norm and is never a layer output.
    """
    n_layers = len(hidden_states) - 1
    for k in layer_ids:
        if not 0 <= k < n_layers:
            raise DrafterError(
                f"target layer {k} out of range: the model has {n_layers} layers (0-{n_layers - 1})"
            )
    return torch.stack([hidden_states[k + 1] for k in layer_ids], dim=-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def _config_int(config: Qwen3Config, name: str) -> int:
    """A size transformers types as optional; Qwen3Config fills it in from the others when absent."""
    value = getattr(config, name)
    if not isinstance(value, int):
        raise DrafterError(f"drafter config: {name} is {value!r}, not an integer: fix config.json")
    return value


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.head_dim = _config_int(config, "head_dim")
        self.num_heads = _config_int(config, "num_attention_heads")
        self.num_kv_heads = _config_int(config, "num_key_value_heads")
        self.groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_type = (getattr(config, "layer_types", None) or ["full_attention"] * (layer_idx + 1))[layer_idx]
        is_causal = getattr(config, "is_causal", None)
        # SGLang's rule, which the scorer must match (tests/unit/test_drafter_sliding.py cites the source):
        # sliding layers are causal with a window, full layers are not, unless the config sets is_causal.
        # z-lab's reference at 44947fb makes every layer non-causal and ignores the window under sdpa.
        self.is_causal = layer_type == "sliding_attention" if is_causal is None else bool(is_causal)
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of x [..., T, hidden] -> [..., kv_heads, T, head_dim]."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(-2, -3)
        v = self.v_proj(x).view(shape).transpose(-2, -3)
        return apply_rope(k, cos.unsqueeze(-3), sin.unsqueeze(-3)), v

    def visibility(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        """Which key positions each query position sees ([len(queries), len(keys)] bool), or None
        when it sees all of them; the one statement of the rule, for the scorer and its oracle."""
        if not self.is_causal and self.sliding_window is None:
            return None
        q, k = queries[:, None], keys[None, :]
        visible = torch.ones(len(queries), len(keys), dtype=torch.bool, device=queries.device)
        if self.is_causal:
            visible &= k <= q
        if self.sliding_window is not None:
            visible &= q - k < self.sliding_window
            if not self.is_causal:
                visible &= k - q < self.sliding_window
        return visible

    def forward(self, x, cos, sin, starts, ctx_k, ctx_v):
        """Attention for blocks x [B, m, bs, hidden] against their sequence's context and themselves.

        ctx_k/ctx_v [B, kv_heads, T, head_dim] hold the context at positions 0..T-1; block (b, i)
        starts at starts[b, i] and sees context positions < starts[b, i] only.
        """
        return self.o_proj(self.mix(x, cos, sin, starts, ctx_k, ctx_v))

    def mix(self, x, cos, sin, starts, ctx_k, ctx_v):
        """The attention's output before o_proj, [B, m, bs, heads * head_dim] (see `forward`)."""
        B, m, bs, _ = x.shape
        T = ctx_k.shape[-2]
        h, g, d = self.num_kv_heads, self.groups, self.head_dim
        # Query heads are grouped as kv_head * groups + g (transformers' repeat_kv order).
        q = self.q_norm(self.q_proj(x).view(B, m, bs, h, g, d))
        # The scale goes on the queries: one product over bs positions instead of one over every score.
        q = apply_rope(q, cos[:, :, :, None, None], sin[:, :, :, None, None]) * self.scaling
        q = q.permute(0, 3, 1, 4, 2, 5).contiguous()  # [B, h, m, g, bs, d]
        k_blk, v_blk = self.kv(x, cos, sin)  # [B, m, h, bs, d]
        k_blk, v_blk = k_blk.transpose(1, 2), v_blk.transpose(1, 2)  # [B, h, m, bs, d]

        # Context part: every block of a sequence shares its context, so one matmul per (sequence, head).
        s_ctx = torch.matmul(q.view(B, h, m * g * bs, d), ctx_k.transpose(-1, -2)).view(B, h, m, g, bs, T)
        s_blk = torch.matmul(q.view(B, h, m, g * bs, d), k_blk.transpose(-1, -2)).view(B, h, m, g, bs, bs)
        # The scores stay in the compute dtype (the products above already round them to it); the
        # mask goes in in place and softmax accumulates in float32: the scores are the largest
        # tensor of a step, and each float32 copy of them costs more memory traffic than the matmuls.
        scores = torch.cat([s_ctx, s_blk], dim=-1)

        key_pos = torch.arange(T, device=x.device)
        starts_ = starts[:, None, :, None, None, None]
        ctx_hidden = key_pos >= starts_  # [B, 1, m, 1, 1, T]
        if self.sliding_window is not None:
            query_pos = starts_ + torch.arange(bs, device=x.device)[:, None]
            ctx_hidden = ctx_hidden | (query_pos - key_pos >= self.sliding_window)
        ctx_hidden = ctx_hidden.expand(B, 1, m, 1, bs, T)
        block = torch.arange(bs, device=x.device)
        blk_visible = self.visibility(block, block)
        blk_hidden = (
            torch.zeros(bs, bs, dtype=torch.bool, device=x.device) if blk_visible is None else ~blk_visible
        ).expand(B, 1, m, 1, bs, bs)
        mask = torch.cat([ctx_hidden, blk_hidden], dim=-1)
        probs = scores.masked_fill_(mask, float("-inf")).softmax(dim=-1)

        out = torch.matmul(probs[..., :T].reshape(B, h, m * g * bs, T), ctx_v).view(B, h, m, g, bs, d)
        out = out + torch.matmul(probs[..., T:].reshape(B, h, m, g * bs, bs), v_blk).view(B, h, m, g, bs, d)
        return out.permute(0, 2, 4, 1, 3, 5).reshape(B, m, bs, h * g * d)


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, starts, ctx_k, ctx_v):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, starts, ctx_k, ctx_v)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """z-lab's DFlash drafter with a forward that drafts many blocks per sequence at once."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        raw = config.to_dict()
        self.block_size = int(dflash_value(raw, "block_size"))
        self.mask_token_id = int(dflash_value(raw, "mask_token_id"))
        self.target_layer_ids = target_layer_ids(raw)
        # Optional scalars of newer z-lab configs; 1.0 / None reproduce the original model.
        self.input_embedding_scale = float(dflash_value(raw, "input_embedding_scale", 1.0))
        self.output_multiplier = float(dflash_value(raw, "output_multiplier", 1.0))
        softcap = dflash_value(raw, "final_logit_softcapping")
        self.logit_softcap = float(softcap) if softcap is not None and float(softcap) > 0 else None
        hidden = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)

    @property
    def decoder_layers(self) -> list[DFlashLayer]:
        """The layers, typed (iterating an nn.ModuleList yields plain Modules)."""
        return cast(list[DFlashLayer], list(self.layers))

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, head_dim] in like's dtype."""
        flat = positions.reshape(1, -1)
        cos, sin = self.rotary_emb(like, flat)
        shape = (*positions.shape, cos.shape[-1])
        return cos.view(shape), sin.view(shape)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., T, n, hidden] (or [..., T, n*hidden]) -> context [..., T, hidden]."""
        if (
            features.dim() >= 3
            and features.shape[-2] == len(self.target_layer_ids)
            and features.shape[-1] == self.hidden_size
        ):
            features = features.flatten(-2)
        return self.hidden_norm(self.fc(features))

    def context_kv(
        self, features: torch.Tensor, first_position: int = 0
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [B, kv_heads, T, head_dim] of the context at positions first_position.. .

        features: [B, T, n, hidden] target features. These K/V do not depend on any block.
        """
        ctx = self.project_context(features)
        positions = torch.arange(first_position, first_position + ctx.shape[-2], device=ctx.device)
        cos, sin = self.rope(positions, ctx)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.decoder_layers]

    def block_embeddings(self, embed, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """[token at s, MASK x (bs-1)] through the target's embedding: anchors [...] -> [..., bs, hidden]."""
        tokens = anchor_tokens.new_full((*anchor_tokens.shape, self.block_size), self.mask_token_id)
        tokens[..., 0] = anchor_tokens
        embeds = embed(tokens)
        return embeds * self.input_embedding_scale if self.input_embedding_scale != 1.0 else embeds

    def forward(
        self,
        block_embeds: torch.Tensor,
        starts: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Draft hidden states (after the final norm) for blocks of B sequences, m blocks each.

        block_embeds [B, m, bs, hidden]; starts [B, m] the position of each block's first token;
        context from `context_kv` (positions 0..T-1). Block (b, i) sees context positions < starts[b, i].
        Returns [B, m, bs, hidden]; outputs 1..bs-1 are the drafts for starts+1..starts+bs-1.
        """
        return self.finish(*self.trunk(block_embeds, starts, context))

    def trunk(
        self,
        block_embeds: torch.Tensor,
        starts: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks up to the last layer's attention: (residual, mix), both [B, m, bs, ...].

        Every layer before the last needs all block positions (the next layer's keys and values come
        from them), and so does the last layer's attention; what follows it (`finish`: o_proj, MLP,
        final norm) acts on each position alone, so it can run later on only the positions whose
        drafts are needed. residual is the last layer's input, mix its attention before o_proj.
        """
        bs = block_embeds.shape[-2]
        positions = starts[..., None] + torch.arange(bs, device=starts.device)
        cos, sin = self.rope(positions, block_embeds)
        layers = self.decoder_layers
        x = block_embeds
        for layer, (ctx_k, ctx_v) in zip(layers[:-1], context[:-1], strict=True):
            x = layer(x, cos, sin, starts, ctx_k, ctx_v)
        last = layers[-1]
        mixed = last.self_attn.mix(last.input_layernorm(x), cos, sin, starts, *context[-1])
        return x, mixed

    def finish(self, residual: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        """Draft hidden states from `trunk`'s (residual, mix) of any positions [..., hidden]."""
        last = self.decoder_layers[-1]
        x = residual + last.self_attn.o_proj(mixed)
        x = x + last.mlp(last.post_attention_layernorm(x))
        return self.norm(x)


# ----------------------------------------------------------------------------------------------
# Loading checkpoints in z-lab's layout
# ----------------------------------------------------------------------------------------------


def validate_config(config: Mapping[str, Any], where: str = "config.json") -> None:
    """Raise DrafterError naming what a DFlash config lacks; accepts both block_size layouts."""
    architectures = config.get("architectures") or []
    if architectures and not set(architectures) & set(SUPPORTED_ARCHITECTURES):
        raise DrafterError(
            f"{where}: architectures {architectures} is not a DFlash drafter "
            f"(expected {list(SUPPORTED_ARCHITECTURES)})"
        )
    if not isinstance(config.get("dflash_config"), Mapping):
        raise DrafterError(
            f"{where} has no dflash_config: a DFlash drafter's config needs "
            "dflash_config {mask_token_id, target_layer_ids}"
        )
    target_layer_ids(config, where)
    if not isinstance(dflash_value(config, "mask_token_id"), int):
        raise DrafterError(
            f"{where}: dflash_config.mask_token_id is missing; set it to the id of the "
            "mask token the drafter was trained with"
        )
    block_size = dflash_value(config, "block_size")
    if not isinstance(block_size, int) or block_size < 2:
        raise DrafterError(
            f"{where}: block_size is missing or below 2 (got {block_size!r}); set block_size "
            "at the top level or in dflash_config"
        )
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
    ):
        if not isinstance(config.get(key), int):
            raise DrafterError(f"{where}: {key} is missing; a DFlash drafter's config is a Qwen3 config")
    layer_types = config.get("layer_types") or []
    for i, kind in enumerate(layer_types):
        if kind not in SUPPORTED_LAYER_TYPES:
            raise DrafterError(
                f"{where}: layer_types[{i}] is {kind!r}; only "
                f"{list(SUPPORTED_LAYER_TYPES)} exist in a DFlash drafter"
            )
    if "sliding_attention" in layer_types and not config.get("sliding_window"):
        raise DrafterError(f"{where}: layer_types has sliding_attention layers but sliding_window is not set")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise DrafterError(
            f"{path} holds no .safetensors weights: a DFlash checkpoint is config.json + "
            "model.safetensors (or shards with model.safetensors.index.json)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(path / name)))
    return tensors


def load_drafter(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> DFlashDrafter:
    """Load a z-lab layout checkpoint (config.json + safetensors) into an eval-mode DFlashDrafter."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DrafterError(f"{path} has no config.json: point at a DFlash drafter checkpoint directory")
    raw = json.loads(config_file.read_text())
    validate_config(raw, str(config_file))
    raw = dict(raw)
    raw.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    config = Qwen3Config(**raw)
    with torch.device("meta"):
        model = DFlashDrafter(config)
    tensors = _read_tensors(path)
    # SGLang also accepts a `model.` prefix; strip it so both spellings load.
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        raise DrafterError(
            f"{path}: {'; '.join(parts)} for a {config.num_hidden_layers}-layer drafter "
            f"with {len(model.target_layer_ids)} target layers; check num_hidden_layers and "
            "target_layer_ids against the checkpoint"
        )
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    for name, tensor in tensors.items():
        want = shapes[name]
        if tuple(tensor.shape) != tuple(want):
            raise DrafterError(
                f"{path}: tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(want)}; the config.json does not match the weights"
            )
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, assign=True)
    # The rotary buffer was created on the meta device: rebuild it for real.
    model.rotary_emb = Qwen3RotaryEmbedding(config)
    return model.to(device=device).eval()
