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
- The drafter has no embedding and no lm_head of its own (see `specops.score.target_head`).

Because the context K/V never depend on the block, `context_kv` computes them once for a whole
sequence and `forward` drafts many blocks at once, each block seeing only the context before it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RotaryEmbedding

from specops.score.block_attention import block_attention, context_slots, query_buffer
from specops.score.dflash_config import DrafterError, dflash_value, target_layer_ids
from specops.score.drafter_ops import (
    RMSNorm,
    add_linear,
    fuse_linears,
    fused_linears,
    lay_out,
    norm_rope,
    silu_mul,
)

SUPPORTED_ARCHITECTURES = ("DFlashDraftModel",)
# Device types where `fuse_projections` stores the MLP's down projection column-major (its linear's weight
# a transposed view of an [intermediate, hidden] matrix): cuBLAS picks its kernel by layout, and for
# [rows, intermediate] @ weight.T at the real shape it picks a faster one so. Measured alone on H100s at
# the full batch (4096 rows): 0.947 against 1.062 ms (771 against 687 TFLOP/s), 0.947 against 0.997 ms,
# 0.950 against 1.061 ms, equal on a fourth, while q/k/v, o_proj and gate/up ran as fast or faster
# row-major (benchmarks/score_step_profile_h100_2026-12-06_layouts.json and the later records of that
# day); in the whole engine no effect beyond the rounds' spread (benchmarks/README.md).
DOWN_COLUMNS_DEVICES: tuple[str, ...] = ("cuda",)
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
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
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
        fused = self.fused_qkv()
        if fused is None:
            k, v = self.k_proj(x), self.v_proj(x)
        else:
            weight, bias = fused
            first = self.num_heads * self.head_dim
            k, v = F.linear(x, weight[first:], None if bias is None else bias[first:]).chunk(2, dim=-1)
        k = norm_rope(k.reshape(shape), self.k_norm, cos, sin).transpose(-2, -3)
        return k, v.reshape(shape).transpose(-2, -3)

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

    def fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The q/k/v weights (and biases) as one matrix where `fuse_projections` made the three
        projections views of it and no gradient is wanted; None otherwise (the three products run)."""
        return fused_linears(self._qkv, (self.q_proj, self.k_proj, self.v_proj))

    def projections(self, x: torch.Tensor, rows_alike: bool = False) -> torch.Tensor:
        """q, k and v of x [..., bs, hidden] side by side, [..., bs, (heads + 2 kv_heads) * head_dim].

        rows_alike: rows 1.. of every block are the same (the first layer's mask rows): they are
        projected once per block and repeated.
        """
        bs = x.shape[-2]
        if rows_alike and bs > 2:
            # Contiguous first: torch multiplies a strided slice block by block (a bmm of 2 rows, each
            # reading the whole weight), 1.8 ms a forward at the real shape on the H200, not one product.
            two = self.projections(x[..., :2, :].contiguous())
            rest = two[..., 1:, :].expand(*two.shape[:-2], bs - 1, two.shape[-1])
            return torch.cat([two[..., :1, :], rest], dim=-2)
        fused = self.fused_qkv()
        if fused is None:
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return F.linear(x, *fused)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows_alike: bool = False):
        """Queries [..., bs, kv_heads, groups, head_dim] (normed, rotated, not scaled) and the block's
        own keys and values [..., kv_heads, bs, head_dim] of x [..., bs, hidden]."""
        h, g, d = self.num_kv_heads, self.groups, self.head_dim
        q, k, v = self.projections(x, rows_alike).split([h * g * d, h * d, h * d], dim=-1)
        # Query heads are grouped as kv_head * groups + g (transformers' repeat_kv order); laid out in
        # memory as the attention kernel reads them where it says how (`query_buffer`).
        lead = tuple(x.shape[:-1])
        folded = query_buffer(lead, h, g, d, x)
        q = norm_rope(q.view(*lead, h * g, d), self.q_norm, cos, sin, out=folded).view(*lead, h, g, d)
        shape = (*x.shape[:-1], h, d)
        k = norm_rope(k.view(shape), self.k_norm, cos, sin).transpose(-2, -3)
        return q, k, v.view(shape).transpose(-2, -3)

    def forward(self, x, cos, sin, starts, ctx_k, ctx_v, context_len=None, rows_alike=False):
        """Attention for blocks x [B, m, bs, hidden] against their sequence's context and themselves.

        ctx_k/ctx_v [B, kv_heads, T, head_dim] hold the context at positions 0..T-1; block (b, i)
        starts at starts[b, i] and sees context positions < starts[b, i] only. context_len: where the
        context ends in buffers made with block slots (`DFlashDrafter.context_kv`). rows_alike: see
        `projections`.
        """
        return self.o_proj(self.mix(x, cos, sin, starts, ctx_k, ctx_v, context_len, rows_alike))

    def mix(self, x, cos, sin, starts, ctx_k, ctx_v, context_len=None, rows_alike=False):
        """The attention's output before o_proj, [B, m, bs, heads * head_dim] (see `forward`)."""
        q, k_blk, v_blk = self.qkv(x, cos, sin, rows_alike)
        return block_attention(self, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len)


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self._gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP up to its down projection: one product for gate and up where they are fused, then the
        activation and the product with up (`silu_mul`: two in-place passes, or one kernel); Qwen3MLP's
        own steps otherwise."""
        mlp = self.mlp
        fused = fused_linears(self._gate_up, (mlp.gate_proj, mlp.up_proj))
        if fused is None:
            return mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        gate, up = F.linear(x, *fused).chunk(2, dim=-1)
        return silu_mul(mlp.act_fn, gate, up)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP (`gated`, then the down projection)."""
        return self.mlp.down_proj(self.gated(x))

    def forward(self, x, cos, sin, starts, ctx_k, ctx_v, context_len=None, rows_alike=False, owned=False):
        """owned: x is the caller's to give up (the first residual sum may then go into its memory)."""
        attn = self.self_attn
        y = self.input_layernorm(x)
        mixed = attn.mix(y, cos, sin, starts, ctx_k, ctx_v, context_len, rows_alike)
        x = add_linear(x, attn.o_proj, mixed, in_place=owned)
        return add_linear(x, self.mlp.down_proj, self.gated(self.post_attention_layernorm(x)), in_place=True)


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
        self.hidden_norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)

    def fuse_projections(self) -> DFlashDrafter:
        """Concatenate every layer's q/k/v and gate/up weights once (see `fuse_linears`): one matrix product
        each instead of three and two; store the down projection in the layout its device multiplies
        fastest (DOWN_COLUMNS_DEVICES). A later .to() keeps them fused; training uses the plain path."""
        for layer in self.decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn._qkv = fuse_linears((attn.q_proj, attn.k_proj, attn.v_proj))
            layer._gate_up = fuse_linears((mlp.gate_proj, mlp.up_proj))
            lay_out(mlp.down_proj, columns=mlp.down_proj.weight.device.type in DOWN_COLUMNS_DEVICES)
        return self

    def _apply(self, fn, recurse=True):
        # .to() and friends convert each parameter alone: unfuse first and fuse again after, so the
        # model never holds a stale copy of its weights.
        fused = any(layer._gate_up is not None for layer in self.decoder_layers)
        for layer in self.decoder_layers:
            layer.self_attn._qkv = layer._gate_up = None
        result = super()._apply(fn, recurse)
        if fused:
            self.fuse_projections()
        return result

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
        self, features: torch.Tensor, first_position: int = 0, block_slots: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [B, kv_heads, T, head_dim] of the context at positions first_position.. .

        features: [B, T, n, hidden] target features. These K/V do not depend on any block.
        block_slots: leave spare positions after the context (zeros) for a block's own keys and
        values, so the fused attention needs no concatenation (`specops.score.block_attention`); pass
        `context_len=T` to `trunk` then.
        """
        ctx = self.project_context(features)
        T = ctx.shape[-2]
        positions = torch.arange(first_position, first_position + T, device=ctx.device)
        cos, sin = self.rope(positions, ctx)
        found = []
        for layer in self.decoder_layers:
            k, v = layer.self_attn.kv(ctx, cos, sin)
            if block_slots:
                k, v = context_slots(k, v, self.block_size)
            found.append((k, v))
        return found

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
        context_len: int | None = None,
        mask_rows_alike: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks up to the last layer's attention: (residual, mix), both [B, m, bs, ...].

        Every layer before the last needs all block positions (the next layer's keys and values come
        from them), and so does the last layer's attention; what follows it (`finish`: o_proj, MLP,
        final norm) acts on each position alone, so it can run later on only the positions whose
        drafts are needed. residual is the last layer's input, mix its attention before o_proj.
        context_len: where the context ends when it was built with block slots (`context_kv`).
        mask_rows_alike: rows 1.. of every block are the mask token's embedding (`block_embeddings`
        makes them so): the first layer projects q/k/v of those rows once per block.
        """
        bs = block_embeds.shape[-2]
        positions = starts[..., None] + torch.arange(bs, device=starts.device)
        cos, sin = self.rope(positions, block_embeds)
        layers = self.decoder_layers
        x = block_embeds
        for i, (layer, (ctx_k, ctx_v)) in enumerate(zip(layers[:-1], context[:-1], strict=True)):
            # The blocks' embeddings are the caller's; every later x is this loop's own.
            x = layer(x, cos, sin, starts, ctx_k, ctx_v, context_len, mask_rows_alike and i == 0, owned=i > 0)
        last = layers[-1]
        alike = mask_rows_alike and len(layers) == 1
        y = last.input_layernorm(x)
        mixed = last.self_attn.mix(y, cos, sin, starts, *context[-1], context_len, alike)
        return x, mixed

    def finish(self, residual: torch.Tensor, mixed: torch.Tensor, owned: bool = False) -> torch.Tensor:
        """Draft hidden states from `trunk`'s (residual, mix) of any positions [..., hidden]; owned: residual
        is the caller's to give up (a gathered copy: the first sum may then go into its memory)."""
        last = self.layers[-1]
        assert isinstance(last, DFlashLayer)
        x = add_linear(residual, last.self_attn.o_proj, mixed, in_place=owned)
        x = add_linear(x, last.mlp.down_proj, last.gated(last.post_attention_layernorm(x)), in_place=True)
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
    return model.to(device=device).fuse_projections().eval()
