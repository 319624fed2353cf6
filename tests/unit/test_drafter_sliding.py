"""Sliding-window draft layers against a golden reference of the rule SGLang serves.

SGLang's DFlash drafter (sgl-project/sglang python/sglang/srt/models/dflash.py, as on the main line
carried by fzyzcjy/sglang at 2c387820557da096e357e1e9f11c34d1c17b2082, `_get_dflash_layer_attention_params`;
window from speculative/dflash_utils.py `get_dflash_attention_sliding_window_size`, JustinTong0323/sglang
at 978f0f13942b56ad0b56255d77ed35d2e06830bd): a full_attention layer is non-causal (ENCODER_ONLY) over
the context and the whole block; a sliding_attention layer is causal (DECODER) with window_left =
sliding_window - 1, i.e. query q sees key k when k <= q and q - k < sliding_window, context included.
z-lab's reference (z-lab/dflash dflash/model.py at 44947fbf71114e241c96de194f4b382b5dd330d0) sets
is_causal = False on every layer and only hands sliding_window to the attention function, which the
default sdpa path ignores: every layer sees the whole context and block. The scorer must match SGLang.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from transformers import Qwen3Config  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import rotate_half  # noqa: E402

from specops.score.drafter import DFlashDrafter  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK, WINDOW = 32, 4, 2, 8, 4, 3
START = 9  # the block's first position: its context (0..8) is longer than the window


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models: extra threads only contend on a shared machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(layer_types: list[str], seed: int = 0) -> DFlashDrafter:
    config = Qwen3Config(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=len(layer_types),
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=64,
        layer_types=layer_types,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=0,
        block_size=BLOCK,
        dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 1]},
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config).float().eval()
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.normal_(0, 0.3)
    return drafter


def sglang_visible(layer_type: str, query: int, key: int) -> bool:
    if layer_type == "full_attention":
        return True
    return key <= query and query - key < WINDOW


def zlab_visible(layer_type: str, query: int, key: int) -> bool:
    return True


def golden(drafter: DFlashDrafter, features: torch.Tensor, block: torch.Tensor, visible) -> torch.Tensor:
    """One block written out plainly: keys are context positions 0..START-1 then the block's."""
    positions = torch.arange(START + BLOCK)
    cos, sin = drafter.rotary_emb(block, positions[None])
    rope = lambda x, p: x * cos[0, p, None] + rotate_half(x) * sin[0, p, None]  # noqa: E731
    context = drafter.hidden_norm(drafter.fc(features.flatten(-2)))  # [START, hidden]
    x = block.clone()  # [BLOCK, hidden]
    for layer, layer_type in zip(drafter.layers, drafter.config.layer_types, strict=True):
        attn = layer.self_attn
        y = layer.input_layernorm(x)
        keys_in = torch.cat([context, y])
        q = rope(attn.q_norm(attn.q_proj(y).view(BLOCK, HEADS, HEAD_DIM)), positions[START:])
        k = rope(attn.k_norm(attn.k_proj(keys_in).view(-1, KV_HEADS, HEAD_DIM)), positions)
        v = attn.v_proj(keys_in).view(-1, KV_HEADS, HEAD_DIM)
        out = torch.empty(BLOCK, HEADS, HEAD_DIM)
        for i in range(BLOCK):
            seen = [j for j in range(START + BLOCK) if visible(layer_type, START + i, j)]
            for h in range(HEADS):
                g = h // (HEADS // KV_HEADS)
                weights = (k[seen, g] @ q[i, h] * HEAD_DIM**-0.5).softmax(0)
                out[i, h] = weights @ v[seen, g]
        x = x + attn.o_proj(out.reshape(BLOCK, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


def drafted(drafter: DFlashDrafter, features: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    context = drafter.context_kv(features[None])
    return drafter(block[None, None], torch.tensor([[START]]), context)[0, 0]


@pytest.fixture
def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(START, 2, HIDDEN), torch.randn(BLOCK, HIDDEN)


@torch.no_grad()
def test_sliding_layers_follow_sglangs_causal_windowed_rule(inputs):
    drafter = build(["sliding_attention", "full_attention"])
    expected = golden(drafter, *inputs, sglang_visible)
    assert torch.allclose(drafted(drafter, *inputs), expected, atol=1e-5)


@torch.no_grad()
def test_z_labs_all_non_causal_reference_differs_on_sliding_layers(inputs):
    drafter = build(["sliding_attention", "full_attention"])
    difference = (golden(drafter, *inputs, zlab_visible) - drafted(drafter, *inputs)).abs().max()
    assert difference > 1e-2  # the two rules give different drafts for the same weights


@torch.no_grad()
def test_without_sliding_layers_sglang_and_z_lab_agree(inputs):
    drafter = build(["full_attention", "full_attention"])
    expected = golden(drafter, *inputs, zlab_visible)
    assert torch.allclose(drafted(drafter, *inputs), expected, atol=1e-5)
    assert torch.allclose(golden(drafter, *inputs, sglang_visible), expected, atol=1e-6)


@torch.no_grad()
def test_an_explicit_is_causal_false_makes_sliding_layers_bidirectional_within_the_window(inputs):
    # A checkpoint's is_causal decides where it is set (z-lab/dflash dflash/model.py at
    # 10129599dffb338ff38cfd235a53ca6d3667b4dd, `_attention_mask`: the window on both sides).
    drafter = build(["sliding_attention", "full_attention"])
    drafter.config.is_causal = False
    bidirectional = DFlashDrafter(drafter.config).float().eval()
    bidirectional.load_state_dict(drafter.state_dict())

    def windowed(layer_type, query, key):
        return layer_type == "full_attention" or abs(query - key) < WINDOW

    assert torch.allclose(drafted(bidirectional, *inputs), golden(drafter, *inputs, windowed), atol=1e-5)
