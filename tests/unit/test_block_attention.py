"""The fast paths of the scoring engine against the plain ones they replace.

- every attention kernel of specops.score.block_attention against the reference, for each layer rule;
- the drafter's fused projections and its first layer's mask rows projected once against the plain
  forward;
- the head's argmax over vocabulary chunks against one argmax over the whole vocabulary, ties and NaN
  included;
- the CPU's group budget from the host's available memory.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from transformers import Qwen3Config  # noqa: E402

import specops.score.acceptance as acceptance  # noqa: E402
import specops.score.block_attention as block_attention  # noqa: E402
from specops.score.drafter import DFlashDrafter  # noqa: E402
from specops.score.kernels import reference  # noqa: E402
from specops.score.target_head import TargetHead  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK, WINDOW = 32, 4, 2, 8, 4, 3
RULES = {
    "full": (["full_attention", "full_attention"], None),
    "sliding (causal, windowed)": (["sliding_attention", "full_attention"], None),
    "sliding, is_causal false": (["sliding_attention", "full_attention"], False),
    "causal": (["full_attention", "full_attention"], True),
}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(layer_types: list[str], is_causal: bool | None = None, seed: int = 0) -> DFlashDrafter:
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
    if is_causal is not None:
        config.is_causal = is_causal
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config).float().eval()
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.normal_(0, 0.3)
    return drafter


def inputs(batch: int = 5, length: int = 21, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, length, 2, HIDDEN, generator=generator)
    blocks = torch.randn(batch, 1, BLOCK, HIDDEN, generator=generator)
    # The first and last anchors a walk can reach, and some between.
    starts = torch.tensor([[1], [length - 2], [7], [2], [13]])[:batch]
    return features, blocks, starts


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kernel", [k for k in block_attention.KERNELS if k != "reference"])
@torch.inference_mode()
def test_every_attention_kernel_equals_the_reference(rule, kernel, monkeypatch):
    drafter = build(*RULES[rule])
    features, blocks, starts = inputs()
    length = features.shape[1]
    context = drafter.context_kv(features, block_slots=True)
    assert context[0][0].shape[-2] % block_attention.SLOT_ALIGNMENT == 0
    attn = drafter.decoder_layers[0].self_attn
    positions = starts[..., None] + torch.arange(BLOCK)
    cos, sin = drafter.rope(positions, blocks)
    q, k_blk, v_blk = attn.qkv(blocks, cos, sin)
    expected = block_attention.reference(attn, q, k_blk, v_blk, starts, *context[0])
    fast = block_attention.KERNELS[kernel](attn, q, k_blk, v_blk, starts, *context[0], length)
    assert torch.allclose(fast, expected, atol=1e-5)
    # The whole drafter: the engine's call (slots, the kernel) against the plain one.
    monkeypatch.setattr(block_attention, "KERNEL", kernel)
    got = drafter.finish(*drafter.trunk(blocks, starts, context, length))
    plain = drafter(blocks, starts, drafter.context_kv(features))
    assert torch.allclose(got, plain, atol=1e-5)


@torch.inference_mode()
def test_several_blocks_per_sequence_fall_back_to_the_reference(monkeypatch):
    drafter = build(*RULES["full"])
    features, _, _ = inputs()
    blocks = torch.randn(5, 3, BLOCK, HIDDEN)
    starts = torch.tensor([[1, 5, 9]] * 5)
    plain = drafter(blocks, starts, drafter.context_kv(features))
    monkeypatch.setattr(block_attention, "KERNEL", "sdpa")
    slotted = drafter.finish(
        *drafter.trunk(blocks, starts, drafter.context_kv(features, block_slots=True), 21)
    )
    assert torch.allclose(slotted, plain, atol=1e-5)


def test_an_unknown_kernel_is_named(monkeypatch):
    drafter = build(*RULES["full"])
    features, blocks, starts = inputs()
    monkeypatch.setattr(block_attention, "KERNEL", "flash-4")
    with pytest.raises(ValueError, match="flash-4"), torch.inference_mode():
        drafter(blocks, starts, drafter.context_kv(features))


def varlen_on_the_cpu(calls: list, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, seqused_k):
    """FlashAttention's variable-length forward stated plainly: each sequence's queries against its first
    seqused_k keys, no mask; with each row's log-sum-exp [heads, total_q] (+inf and zeros for a row with no
    key, as the kernel marks it). Records the key counts it was given."""
    calls.append(seqused_k.tolist())
    out = torch.zeros_like(query)
    lse = torch.full((query.shape[1], query.shape[0]), float("inf"))
    for i in range(len(cu_seq_q) - 1):
        rows = slice(int(cu_seq_q[i]), int(cu_seq_q[i + 1]))
        first, used = int(cu_seq_k[i]), int(seqused_k[i])
        if used == 0:
            continue
        q = query[rows].transpose(0, 1)  # [heads, rows, d]
        k = key[first : first + used].transpose(0, 1)
        v = value[first : first + used].transpose(0, 1)
        scores = q @ k.transpose(-1, -2) * scale
        out[rows] = (scores.softmax(dim=-1) @ v).transpose(0, 1)
        lse[:, rows] = scores.logsumexp(dim=-1)
    return out, lse


def on_token_major_cpu(monkeypatch) -> list:
    """The CPU laid out token-major as CUDA devices are, float32 standing for bf16, and the variable-length
    kernel's call stated plainly: what is tested is everything around the call. Returns its calls."""
    monkeypatch.setattr(block_attention, "TOKEN_MAJOR_DEVICES", ("cpu",))
    monkeypatch.setattr(block_attention, "FLASH_DTYPES", (torch.float32,))
    monkeypatch.setattr(block_attention, "FLASH_UNAVAILABLE", None)
    monkeypatch.setattr(block_attention, "MERGE_FAILED", None)
    calls: list = []
    monkeypatch.setattr(block_attention, "varlen_attention", lambda *a: varlen_on_the_cpu(calls, *a))
    return calls


def merge_on_the_cpu(monkeypatch, kernel=reference.attend_block) -> None:
    """BLOCK_KEYS "merged" applying on the CPU, with kernel (the torch statement) as the Triton kernel."""
    monkeypatch.setattr(block_attention, "BLOCK_KEYS", "merged")
    # Only the merge is told it applies (the drafter's other Triton kernels stay off on the CPU).
    monkeypatch.setattr(block_attention, "_merge_applies", lambda q: block_attention.MERGE_FAILED is None)
    module = SimpleNamespace(attend_block=kernel)
    monkeypatch.setitem(sys.modules, "specops.score.kernels.attend_block", module)


@pytest.mark.parametrize("rule", RULES)
@torch.inference_mode()
def test_the_variable_length_kernel_reads_the_context_before_each_block_and_puts_the_buffers_back(
    rule, monkeypatch
):
    calls = on_token_major_cpu(monkeypatch)
    monkeypatch.setattr(block_attention, "BLOCK_KEYS", "in_context")
    drafter = build(*RULES[rule])
    features, blocks, starts = inputs()
    length = features.shape[1]
    context = drafter.context_kv(features, block_slots=True)
    ctx_k, ctx_v = context[0]
    assert block_attention.token_major(ctx_k) and not ctx_k.is_contiguous()
    assert torch.equal(
        ctx_k,
        drafter.context_kv(features)[0][0]
        .new_zeros(ctx_k.shape)
        .index_copy(-2, torch.arange(length), drafter.context_kv(features)[0][0]),
    )
    before = (ctx_k.clone(), ctx_v.clone())
    attn = drafter.decoder_layers[0].self_attn
    positions = starts[..., None] + torch.arange(BLOCK)
    cos, sin = drafter.rope(positions, blocks)
    q, k_blk, v_blk = attn.qkv(blocks, cos, sin)
    expected = block_attention.reference(attn, q, k_blk, v_blk, starts, ctx_k, ctx_v)
    got = block_attention.flash(attn, q, k_blk, v_blk, starts, ctx_k, ctx_v, length)
    assert torch.allclose(got, expected, atol=1e-5)
    # Full attention reads start + block keys per sequence and puts back what it moved; a causal or
    # windowed layer falls back to a kernel that writes its block into the spare slots only.
    full = rule == "full"
    kept = slice(None) if full else slice(0, length)
    assert torch.equal(ctx_k[..., kept, :], before[0][..., kept, :])
    assert torch.equal(ctx_v[..., kept, :], before[1][..., kept, :])
    assert calls == ([(starts[:, 0] + BLOCK).tolist()] if full else [])
    # The whole drafter through the engine's call, and the layout kept when finished sequences leave.
    monkeypatch.setattr(block_attention, "KERNEL", "flash")
    plain = drafter(blocks, starts, drafter.context_kv(features))
    assert torch.allclose(drafter.finish(*drafter.trunk(blocks, starts, context, length)), plain, atol=1e-5)
    keep = torch.tensor([4, 1, 2])
    kept = [
        (block_attention.select_sequences(k, keep), block_attention.select_sequences(v, keep))
        for k, v in context
    ]
    assert all(block_attention.token_major(k) and block_attention.token_major(v) for k, v in kept)
    assert torch.equal(kept[0][0], ctx_k[keep])
    again = drafter.finish(*drafter.trunk(blocks[keep], starts[keep], kept, length))
    assert torch.allclose(again, plain[keep], atol=1e-5)
    # The call above, then each layer that sees its whole block and the context before it, twice.
    plain_layers = sum(
        not a.self_attn.is_causal and a.self_attn.sliding_window is None for a in drafter.layers
    )
    assert len(calls) == int(full) + 2 * plain_layers
    assert block_attention.FLASH_UNAVAILABLE is None


def untouched_where_plain(drafter, context, before) -> list[bool]:
    """Asserts that the context's buffers of exactly the layers that see their whole block and the
    context before it (no causal rule, no window) are as they were; returns which layers those are."""
    untouched = [
        torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(context, before, strict=True)
    ]
    plain_layers = [not a.self_attn.is_causal and a.self_attn.sliding_window is None for a in drafter.layers]
    assert untouched == plain_layers
    return plain_layers


def first_layer(rule: str):
    """A drafter of the rule, its inputs, its context with block slots (and a copy of it), and the first
    layer's attention with its queries and the block's own keys and values."""
    drafter = build(*RULES[rule])
    features, blocks, starts = inputs()
    context = drafter.context_kv(features, block_slots=True)
    before = [(k.clone(), v.clone()) for k, v in context]
    attn = drafter.decoder_layers[0].self_attn
    cos, sin = drafter.rope(starts[..., None] + torch.arange(BLOCK), blocks)
    q, k_blk, v_blk = attn.qkv(blocks, cos, sin)
    return drafter, features, blocks, starts, features.shape[1], context, before, attn, q, k_blk, v_blk


@pytest.mark.parametrize("rule", RULES)
@torch.inference_mode()
def test_the_merged_block_reads_the_context_before_each_start_and_writes_no_buffer(rule, monkeypatch):
    calls = on_token_major_cpu(monkeypatch)
    merge_on_the_cpu(monkeypatch)
    drafter, features, blocks, starts, length, context, before, attn, q, k_blk, v_blk = first_layer(rule)
    # The queries come out already folded as the kernel reads them: each kv head's groups x block rows.
    assert q[:, 0].permute(0, 3, 1, 2, 4).is_contiguous()
    expected = block_attention.reference(attn, q, k_blk, v_blk, starts, *context[0])
    got = block_attention.flash(attn, q, k_blk, v_blk, starts, *context[0], length)
    assert torch.allclose(got, expected, atol=1e-5)
    full = rule == "full"
    assert calls == ([starts[:, 0].tolist()] if full else [])
    monkeypatch.setattr(block_attention, "KERNEL", "flash")
    plain = drafter(blocks, starts, drafter.context_kv(features))
    assert torch.allclose(drafter.finish(*drafter.trunk(blocks, starts, context, length)), plain, atol=1e-5)
    # Nothing was written into the context's buffers, not even into the spare slots, where no kernel fell
    # back to the masked one.
    untouched_where_plain(drafter, context, before)
    assert block_attention.MERGE_FAILED is None and block_attention.FLASH_UNAVAILABLE is None


def unbuildable(*args):
    raise ImportError("no C compiler to build the Triton kernel")


def warned_and_equal_without_the_kernel(monkeypatch, kernel: str):
    """The engine's call through `kernel` while a Triton kernel in its way fails to build: warned once, and
    the plain forward's result. Returns the drafter and its blocks' starts."""
    drafter = build(*RULES["full"])
    features, blocks, starts = inputs()
    context = drafter.context_kv(features, block_slots=True)
    monkeypatch.setattr(block_attention, "KERNEL", kernel)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        got = drafter.finish(*drafter.trunk(blocks, starts, context, features.shape[1]))
    assert torch.allclose(got, drafter(blocks, starts, drafter.context_kv(features)), atol=1e-5)
    return drafter, starts


@torch.inference_mode()
def test_a_merge_kernel_that_fails_to_build_leaves_the_block_keys_in_the_context_and_says_so(monkeypatch):
    calls = on_token_major_cpu(monkeypatch)

    merge_on_the_cpu(monkeypatch, unbuildable)
    drafter, starts = warned_and_equal_without_the_kernel(monkeypatch, "flash")
    assert "no C compiler" in block_attention.MERGE_FAILED
    # The failed call read the context before the start; then every call writes its block in.
    with_block = (starts[:, 0] + BLOCK).tolist()
    assert calls == [starts[:, 0].tolist(), with_block] + [with_block] * (len(drafter.layers) - 1)


def one_pass_on_the_cpu(monkeypatch, kernel=reference.attend_context) -> list:
    """`triton` applying on the CPU, with kernel (the torch statement) as the Triton kernel; the context
    token-major (`on_token_major_cpu`). Returns the variable-length kernel's calls (of a fallback)."""
    calls = on_token_major_cpu(monkeypatch)
    monkeypatch.setattr(block_attention, "ONE_PASS_FAILED", None)
    monkeypatch.setattr(
        block_attention, "_one_pass_applies", lambda *t: block_attention.ONE_PASS_FAILED is None
    )
    monkeypatch.setitem(
        sys.modules, "specops.score.kernels.attend_context", SimpleNamespace(attend_context=kernel)
    )
    return calls


@pytest.mark.parametrize("rule", RULES)
@torch.inference_mode()
def test_the_one_pass_kernel_reads_the_context_before_each_start_and_its_block_and_writes_no_buffer(
    rule, monkeypatch
):
    kernel_calls: list = []

    def statement(queries, keys, values, starts, *rest):
        kernel_calls.append(starts.tolist())
        return reference.attend_context(queries, keys, values, starts, *rest)

    calls = one_pass_on_the_cpu(monkeypatch, statement)
    merge_on_the_cpu(monkeypatch)
    drafter, features, blocks, starts, length, context, before, attn, q, k_blk, v_blk = first_layer(rule)
    expected = block_attention.reference(attn, q, k_blk, v_blk, starts, *context[0])
    got = block_attention.one_pass(attn, q, k_blk, v_blk, starts, *context[0], length)
    assert torch.allclose(got, expected, atol=1e-5)
    full = rule == "full"
    # A layer with a causal rule or a window is FlashAttention's (then the masked kernel's) to run.
    assert kernel_calls == ([starts[:, 0].tolist()] if full else [])
    assert calls == []
    monkeypatch.setattr(block_attention, "KERNEL", "triton")
    plain = drafter(blocks, starts, drafter.context_kv(features))
    assert torch.allclose(drafter.finish(*drafter.trunk(blocks, starts, context, length)), plain, atol=1e-5)
    plain_layers = untouched_where_plain(drafter, context, before)
    assert len(kernel_calls) == int(full) + sum(plain_layers)
    assert block_attention.ONE_PASS_FAILED is None


@torch.inference_mode()
def test_a_one_pass_kernel_that_fails_to_build_leaves_the_attention_to_flash_attention_and_says_so(
    monkeypatch,
):
    calls = one_pass_on_the_cpu(monkeypatch, unbuildable)
    merge_on_the_cpu(monkeypatch)
    drafter, starts = warned_and_equal_without_the_kernel(monkeypatch, "triton")
    assert "no C compiler" in block_attention.ONE_PASS_FAILED
    # Every layer then went to FlashAttention over the context before each start (the block merged).
    assert calls == [starts[:, 0].tolist()] * len(drafter.layers)


def test_the_one_pass_statement_equals_the_merged_statement():
    generator = torch.Generator().manual_seed(3)
    B, R, heads, d, bs, slots = 3, 8, 2, 16, 4, 12
    queries = torch.randn(B, R, heads, d, generator=generator)
    keys, values = torch.randn(2, B, slots, heads, d, generator=generator)
    k_blk, v_blk = torch.randn(2, B, bs, heads, d, generator=generator)
    starts = torch.tensor([0, 5, 12])
    got = reference.attend_context(
        queries, keys, values, starts, k_blk, v_blk, 0.25, torch.empty(B, 2, R // 2, heads, d)
    )
    # The same through the context's softmax and its log-sum-exp, merged with the block's keys.
    o_ctx, lse = torch.zeros(B, R, heads, d), torch.full((B, R, heads), float("inf"))
    for b, start in enumerate(starts.tolist()):
        if start:
            scores = torch.einsum("rhd,khd->hrk", queries[b], keys[b, :start]) * 0.25
            o_ctx[b] = torch.einsum("hrk,khd->rhd", scores.softmax(-1), values[b, :start])
            lse[b] = scores.logsumexp(-1).T
    merged = reference.attend_block(
        queries, k_blk, v_blk, o_ctx, lse, 0.25, torch.empty(B, 2, R // 2, heads, d)
    )
    assert torch.allclose(got, merged, atol=1e-5)
    # Row r is written at (r // R_inner, r % R_inner).
    assert torch.equal(got.view(B, R, heads, d)[:, 5], got[:, 1, 1])


def test_the_log_sum_exp_is_read_in_either_layout_flash_attention_returns():
    sequences, rows, heads = 3, 4, 2
    lse = torch.arange(sequences * rows * heads, dtype=torch.float32)
    unpadded = lse.view(heads, sequences * rows)  # FlashAttention >= 2.4: [heads, total_q]
    padded = torch.zeros(sequences, heads, rows + 3)  # earlier: [sequences, heads, max_q]
    padded[..., :rows] = unpadded.view(heads, sequences, rows).transpose(0, 1)
    expected = unpadded.view(heads, sequences, rows).permute(1, 2, 0)
    assert torch.equal(block_attention.lse_rows(unpadded, sequences, rows, heads), expected)
    assert torch.equal(block_attention.lse_rows(padded, sequences, rows, heads), expected)
    with pytest.raises(RuntimeError, match="unknown layout"):
        block_attention.lse_rows(torch.zeros(5), sequences, rows, heads)


@torch.inference_mode()
def test_a_torch_without_the_variable_length_kernel_falls_back_to_the_masked_kernel_and_says_so(monkeypatch):
    monkeypatch.setattr(block_attention, "TOKEN_MAJOR_DEVICES", ("cpu",))
    monkeypatch.setattr(block_attention, "FLASH_DTYPES", (torch.float32,))
    monkeypatch.setattr(block_attention, "FLASH_UNAVAILABLE", None)
    monkeypatch.setattr(block_attention, "BLOCK_KEYS", "in_context")

    def missing(*args):
        raise TypeError("_flash_attention_forward() got an unexpected keyword argument 'seqused_k'")

    monkeypatch.setattr(block_attention, "varlen_attention", missing)
    drafter = build(*RULES["full"])
    features, blocks, starts = inputs()
    context = drafter.context_kv(features, block_slots=True)
    before = [(k.clone(), v.clone()) for k, v in context]
    monkeypatch.setattr(block_attention, "KERNEL", "flash")
    with pytest.warns(RuntimeWarning, match="seqused_k"):
        got = drafter.finish(*drafter.trunk(blocks, starts, context, features.shape[1]))
    assert torch.allclose(got, drafter(blocks, starts, drafter.context_kv(features)), atol=1e-5)
    assert "seqused_k" in block_attention.FLASH_UNAVAILABLE
    length = features.shape[1]
    assert all(
        torch.equal(k[..., :length, :], k0[..., :length, :])
        for (k, _), (k0, _) in zip(context, before, strict=True)
    )


def plain_forward(rule: str):
    """A drafter of the rule before any fusion, with inputs, its weights and its plain forward on them."""
    drafter = build(*RULES[rule])
    features, _, starts = inputs()
    head = TargetHead(torch.randn(64, HIDDEN), torch.randn(64, HIDDEN))
    blocks = drafter.block_embeddings(head.embed, torch.tensor([[3], [5], [7], [9], [11]]))
    state = {name: tensor.clone() for name, tensor in drafter.state_dict().items()}
    plain = drafter(blocks, starts, drafter.context_kv(features))
    return drafter, features, starts, blocks, state, plain


@torch.inference_mode()
def test_fused_projections_and_mask_rows_once_give_the_plain_forward():
    drafter, features, starts, blocks, state, plain = plain_forward("sliding (causal, windowed)")
    drafter.fuse_projections()
    attn = drafter.decoder_layers[0].self_attn
    assert attn.fused_qkv() is not None
    assert attn.q_proj.weight.data_ptr() == attn.fused_qkv()[0].data_ptr()
    assert drafter.state_dict().keys() == state.keys()
    assert all(torch.equal(drafter.state_dict()[name], tensor) for name, tensor in state.items())
    fused = drafter(blocks, starts, drafter.context_kv(features))
    once = drafter.finish(*drafter.trunk(blocks, starts, drafter.context_kv(features), mask_rows_alike=True))
    assert torch.allclose(fused, plain, atol=1e-5)
    assert torch.allclose(once, plain, atol=1e-5)
    # A later .to() fuses again in the new dtype, and the answers stay.
    drafter.to(torch.float64)
    assert attn.fused_qkv() is not None and attn.fused_qkv()[0].dtype == torch.float64
    again = drafter(blocks.double(), starts, drafter.context_kv(features.double()))
    assert torch.allclose(again.float(), plain, atol=1e-5)


@torch.inference_mode()
def test_the_down_projection_is_stored_column_major_where_the_device_is_listed(monkeypatch):
    import specops.score.drafter as drafter_module

    drafter, features, starts, blocks, state, plain = plain_forward("full")
    down = drafter.decoder_layers[0].mlp.down_proj

    def column_major() -> bool:
        weight = down.weight
        return weight.stride() == (1, weight.shape[0])

    assert down.weight.is_contiguous() and not column_major()
    monkeypatch.setattr(drafter_module, "DOWN_COLUMNS_DEVICES", ("cpu",))
    drafter.fuse_projections()
    assert column_major() and all(
        layer.mlp.down_proj.weight.stride(0) == 1 for layer in drafter.decoder_layers
    )
    assert all(torch.equal(drafter.state_dict()[name], tensor) for name, tensor in state.items())
    assert torch.allclose(drafter(blocks, starts, drafter.context_kv(features)), plain, atol=1e-5)
    # A later .to() keeps the layout its device takes; a device not listed takes row-major again.
    drafter.to(torch.float64)
    assert column_major() and down.weight.dtype == torch.float64
    monkeypatch.setattr(drafter_module, "DOWN_COLUMNS_DEVICES", ())
    drafter.fuse_projections()
    assert down.weight.is_contiguous()
    again = drafter(blocks.double(), starts, drafter.context_kv(features.double()))
    assert torch.allclose(again.float(), plain, atol=1e-5)


@torch.inference_mode()
def test_the_mask_rows_are_projected_in_one_product_not_one_per_block():
    # A strided slice of the blocks reaches torch's matmul as a batch of 2-row products, each reading the
    # whole weight: at the real shape slower than the projection of every row.
    drafter = build(*RULES["sliding (causal, windowed)"]).fuse_projections()
    head = TargetHead(torch.randn(64, HIDDEN), torch.randn(64, HIDDEN))
    blocks = drafter.block_embeddings(head.embed, torch.tensor([[3], [5], [7], [9], [11]]))
    attn = drafter.decoder_layers[0].self_attn
    with torch.profiler.profile() as profiled:
        once = attn.projections(blocks, rows_alike=True)
    ops = {event.key for event in profiled.key_averages()}
    assert "aten::mm" in ops or "aten::addmm" in ops
    assert "aten::bmm" not in ops and "aten::baddbmm" not in ops
    assert torch.equal(once, attn.projections(blocks))


def test_a_fused_drafter_still_trains():
    # load_drafter fuses, and the reference drafter fixture is trained from a loaded one.
    drafter = build(*RULES["full"]).fuse_projections()
    with torch.inference_mode():
        assert drafter.decoder_layers[0].self_attn.fused_qkv() is not None
    attn = drafter.decoder_layers[0].self_attn
    assert attn.fused_qkv() is None  # grad mode: the separate linears
    features, blocks, starts = inputs()
    drafter(blocks, starts, drafter.context_kv(features)).square().mean().backward()
    for linear in (attn.q_proj, attn.k_proj, attn.v_proj, drafter.decoder_layers[0].mlp.up_proj):
        assert linear.weight.requires_grad and linear.weight.grad is not None
        assert linear.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 64, 1000])
def test_argmax_over_vocabulary_chunks_equals_the_whole_vocabulary(chunk):
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 16, generator=generator)
    hidden = torch.randn(50, 16, generator=generator)
    whole = TargetHead(weight, weight, vocab_chunk=64)
    chunked = TargetHead(weight, weight, vocab_chunk=chunk, logits_budget_bytes=4 * 64 * 7)
    for multiplier, softcap in ((1.0, None), (0.5, 3.0)):
        expected = whole.logits(hidden, multiplier, softcap).argmax(dim=-1)
        assert torch.equal(whole.argmax(hidden, multiplier, softcap), expected)
        assert torch.equal(chunked.argmax(hidden, multiplier, softcap), expected)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8])
def test_argmax_ties_go_to_the_lowest_token_across_chunks(chunk):
    # Small integers: every logit is exact whatever the order of the sums, so the ties are exact.
    rows = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0]])
    weight = rows[torch.tensor([1, 0, 2, 0, 3, 1, 3, 2])]  # 1 ties 3, 0 ties 5, 4 ties 6, 2 ties 7
    hidden = torch.tensor([[2.0, 0, 0], [0, 3, 0], [0, 0, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]])
    expected = (hidden @ weight.T).argmax(dim=-1)
    assert expected.tolist() == [1, 0, 2, 4, 4, 0]  # torch.argmax: the first of the tied maxima
    head = TargetHead(weight, weight, vocab_chunk=chunk)
    assert head.argmax(hidden).tolist() == expected.tolist()


@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_argmax_takes_the_first_nan_as_torch_argmax_does(chunk):
    weight = torch.eye(4)
    hidden = torch.tensor([[1.0, float("nan"), 5.0, float("nan")], [1.0, 2.0, 5.0, float("nan")]])
    expected = (hidden @ weight.T).argmax(dim=-1)
    assert torch.equal(TargetHead(weight, weight, vocab_chunk=chunk).argmax(hidden), expected)


def test_the_cpu_group_budget_is_a_share_of_the_hosts_available_memory(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    assert acceptance.available_host_memory(str(meminfo)) == 20000000 * 1024
    (tmp_path / "empty").write_text("MemTotal: 1 kB\n")
    assert acceptance.available_host_memory(str(tmp_path / "empty")) is None
    assert acceptance.available_host_memory(str(tmp_path / "missing")) is None
    monkeypatch.setattr(acceptance, "available_host_memory", lambda: 20000000 * 1024)
    budget = acceptance.default_memory_budget(torch.device("cpu"))
    assert budget == int(acceptance.CPU_MEMORY_SHARE * 20000000 * 1024)
    monkeypatch.setattr(acceptance, "available_host_memory", lambda: 1 << 30)
    assert acceptance.default_memory_budget(torch.device("cpu")) == acceptance.CPU_MEMORY_BUDGET
    monkeypatch.setattr(acceptance, "available_host_memory", lambda: None)
    assert acceptance.default_memory_budget(torch.device("cpu")) == acceptance.CPU_MEMORY_BUDGET


def test_a_group_without_written_scores_may_take_most_of_the_budget(monkeypatch):
    drafter = build(*RULES["full"])
    items = [
        acceptance.SequenceInput(f"c{i}", torch.zeros(21, dtype=torch.long), torch.zeros(21, 2, HIDDEN), 3)
        for i in range(8)
    ]
    resident = acceptance._sequence_bytes(drafter, 21)
    per_sequence = resident + acceptance._block_bytes(drafter, 21, scores=False)
    # Room for all eight in FUSED_SHARE of the budget, for fewer than eight in half of it.
    budget = int(8 * per_sequence / acceptance.FUSED_SHARE) + 1
    assert acceptance._block_bytes(drafter, 21) > acceptance._block_bytes(drafter, 21, scores=False)
    assert len(acceptance.group_indices(drafter, items, budget, scores=False)) == 1
    assert len(acceptance.group_indices(drafter, items, budget)) > 1
    # Only a GPU's frontier with a fused kernel writes no scores.
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not acceptance.writes_scores(cuda, "frontier")
    assert acceptance.writes_scores(cuda, "all-anchors") and acceptance.writes_scores(cpu, "frontier")
    monkeypatch.setattr(block_attention, "KERNEL", "reference")
    assert acceptance.writes_scores(cuda, "frontier")
