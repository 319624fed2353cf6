"""The Triton kernels' surroundings, on the CPU (the kernels themselves need a GPU:
benchmarks/score_triton_check.py compares them with `specops.score.kernels.reference` there).

- the order the head's argmax follows inside a tile, and the combine of the tiles, against torch.argmax
  (ties, NaN, -inf, tiles that do not divide the vocabulary);
- the rule that picks a kernel or the torch path (CUDA, half precision, no gradient, triton importable);
- the engine's wiring: with the references standing in for the kernels, the head's tokens and the
  drafter's outputs are those of the torch paths, and the torch paths stay where a kernel does not apply.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

import specops.score.block_attention as block_attention  # noqa: E402
import specops.score.drafter_ops as drafter_ops  # noqa: E402
import specops.score.kernels as kernels  # noqa: E402
import specops.score.target_head as target_head  # noqa: E402
from specops.score.drafter import DFlashDrafter  # noqa: E402
from specops.score.drafter_ops import RMSNorm, apply_rope, per_token  # noqa: E402
from specops.score.kernels import reference  # noqa: E402
from specops.score.kernels.argmax_order import combine_partials  # noqa: E402
from specops.score.target_head import TargetHead  # noqa: E402

NAN, INF = float("nan"), float("inf")


def stand_in(device: str = "cuda", dtype=torch.bfloat16, requires_grad: bool = False):
    """What `kernels.applies` reads of a tensor, for a CUDA tensor on a machine without one."""
    return SimpleNamespace(device=torch.device(device), dtype=dtype, requires_grad=requires_grad)


class Calls:
    """A kernel's launcher replaced by its reference, counting calls."""

    def __init__(self, fn=None):
        self.fn, self.count = fn, 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        if self.fn is None:
            raise AssertionError("the kernel ran where the torch path should have")
        return self.fn(*args, **kwargs)


@pytest.fixture
def kernels_apply(monkeypatch):
    """`kernels.applies` says yes to CPU tensors, so the engine's kernel branches run on the CPU (no kernel
    has failed to build yet in this test)."""
    monkeypatch.setattr(kernels, "applies", lambda *tensors: True)
    monkeypatch.setattr(drafter_ops, "TRITON_FAILED", None)


def install(monkeypatch, module: str, **launchers) -> None:
    monkeypatch.setitem(sys.modules, f"specops.score.kernels.{module}", SimpleNamespace(**launchers))


# ---------------------------------------------------------------------------------------------
# The argmax's order and the combine of its tiles
# ---------------------------------------------------------------------------------------------


def tie_rows(rows: int = 40, vocab: int = 37, seed: int = 0) -> torch.Tensor:
    """Rows of a few distinct values (many exact ties), some NaN, some -inf, one all -inf, one all NaN."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 4, (rows, vocab), generator=generator).float()
    special = torch.rand(rows, vocab, generator=generator)
    values[special < 0.03] = NAN
    values[(special > 0.03) & (special < 0.1)] = -INF
    values[0], values[1] = -INF, NAN
    return values


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_order_folded_in_any_column_order_gives_torch_argmax(seed):
    values = tie_rows(seed=seed)
    expected = values.argmax(dim=-1)
    order = torch.randperm(values.shape[1], generator=torch.Generator().manual_seed(seed))
    indices = torch.arange(values.shape[1], dtype=torch.int32).expand_as(values)[:, order]
    _, found = reference.fold(values[:, order], indices)
    assert found.long().tolist() == expected.tolist()


@pytest.mark.parametrize("block_n", [1, 4, 16, 37, 64])
def test_tiles_folded_then_combined_give_torch_argmax(block_n):
    values = tie_rows(seed=block_n)
    rows, vocab = values.shape
    tiles = -(-vocab // block_n)
    padded = values.new_full((rows, tiles * block_n), -INF)
    padded[:, :vocab] = values
    index = torch.arange(tiles * block_n, dtype=torch.int32).view(1, tiles, block_n).expand(rows, -1, -1)
    partial_values, partial_indices = reference.fold(padded.view(rows, tiles, block_n), index)
    assert combine_partials(partial_values, partial_indices).tolist() == values.argmax(dim=-1).tolist()


def test_combine_takes_the_first_tile_of_equal_maxima_and_the_first_nan():
    values = torch.tensor([[1.0, 3.0, 3.0], [NAN, 5.0, NAN], [-INF, -INF, -INF]])
    indices = torch.tensor([[5, 70, 130], [9, 64, 128], [0, 64, 128]], dtype=torch.int32)
    assert combine_partials(values, indices).tolist() == [70, 9, 0]


def test_reference_head_argmax_equals_the_torch_head_over_ragged_tiles_with_ties():
    # Small integers: every logit is exact whatever the order of the sums, so the ties are exact.
    generator = torch.Generator().manual_seed(3)
    weight = torch.randint(-2, 3, (300, 8), generator=generator).float()
    weight[250] = weight[3] = weight[130] = torch.full((8,), 4.0)  # a tie across three tiles of 128
    hidden = torch.randint(-1, 2, (30, 8), generator=generator).float()
    hidden[0] = 1.0  # leads at 3, 130 and 250
    hidden[1] = 0.0  # every token ties
    head = TargetHead(weight, weight)
    for multiplier in (1.0, 0.5, -2.0):
        expected = head.argmax(hidden, multiplier)
        assert reference.head_argmax(hidden, weight, multiplier, block_n=128).tolist() == expected.tolist()
    assert reference.head_argmax(hidden, weight, 1.0, block_n=128)[:2].tolist() == [3, 0]


# ---------------------------------------------------------------------------------------------
# Which path runs
# ---------------------------------------------------------------------------------------------


def test_kernels_apply_to_cuda_half_tensors_of_one_dtype_without_gradient(monkeypatch):
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    assert kernels.applies(stand_in(), stand_in())
    assert kernels.applies(stand_in(dtype=torch.float16))
    assert not kernels.applies(stand_in(), stand_in(device="cpu"))
    assert not kernels.applies(stand_in(dtype=torch.float32))
    assert not kernels.applies(stand_in(), stand_in(dtype=torch.float16))
    with torch.enable_grad():
        assert not kernels.applies(stand_in(), stand_in(requires_grad=True))
    with torch.no_grad():
        assert kernels.applies(stand_in(), stand_in(requires_grad=True))
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    assert not kernels.applies(stand_in())


def test_a_torch_without_triton_takes_the_torch_paths(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    kernels.triton_available.cache_clear()
    try:
        assert not kernels.triton_available()
        assert not kernels.applies(stand_in())
    finally:
        kernels.triton_available.cache_clear()


def test_the_head_kernel_is_off_and_the_elementwise_kernels_on_where_they_apply():
    # Measured: the Triton head slower than cuBLAS's product and argmax, the elementwise kernels faster.
    assert target_head.ARGMAX_KERNEL == "torch"
    assert drafter_ops.ELEMENTWISE == "triton"
    # Off CUDA they never apply: the CPU runs torch's kernels whatever the switch.
    assert not drafter_ops._triton_applies(stand_in())


# ---------------------------------------------------------------------------------------------
# The head's wiring
# ---------------------------------------------------------------------------------------------


def tied_head(budget: int = 1 << 30) -> tuple[TargetHead, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    weight = torch.randint(-2, 3, (200, 8), generator=generator).float()
    weight[150] = weight[20] = 5.0
    hidden = torch.randint(-1, 2, (3, 7, 8), generator=generator).float()
    hidden[0, 0] = 1.0
    return TargetHead(weight, weight, logits_budget_bytes=budget), hidden


def test_the_head_runs_the_kernel_where_it_applies_with_the_torch_paths_tokens(monkeypatch, kernels_apply):
    # A budget of 4 rows of logits: the 21 rows go to the kernel in 6 launches.
    head, hidden = tied_head(budget=4 * 200 * 4)
    expected = head.argmax(hidden, -0.5)
    calls = Calls(lambda x, weight, multiplier: reference.head_argmax(x, weight, multiplier, block_n=64))
    install(monkeypatch, "head_argmax", head_argmax=calls)
    monkeypatch.setattr(target_head, "ARGMAX_KERNEL", "triton")
    found = head.argmax(hidden, -0.5)
    assert found.shape == (3, 7) and torch.equal(found, expected)
    assert calls.count == 6
    # Row 0 ties at tokens 20 and 150 (different tiles of 64): the lower wins, as on the torch path.
    assert head.argmax(hidden)[0, 0] == 20


def test_the_head_keeps_the_torch_path_with_a_softcap(monkeypatch, kernels_apply):
    head, hidden = tied_head()
    expected = head.argmax(hidden, 1.0, 3.0)
    calls = Calls()
    install(monkeypatch, "head_argmax", head_argmax=calls)
    monkeypatch.setattr(target_head, "ARGMAX_KERNEL", "triton")
    assert torch.equal(head.argmax(hidden, 1.0, 3.0), expected)
    assert calls.count == 0


def test_the_head_on_the_cpu_keeps_the_torch_path_when_switched_to_triton(monkeypatch):
    head, hidden = tied_head()
    expected = head.argmax(hidden)
    calls = Calls()
    install(monkeypatch, "head_argmax", head_argmax=calls)
    monkeypatch.setattr(target_head, "ARGMAX_KERNEL", "triton")
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    assert torch.equal(head.argmax(hidden), expected)
    assert calls.count == 0


# ---------------------------------------------------------------------------------------------
# The drafter's wiring
# ---------------------------------------------------------------------------------------------


def drafter_and_inputs():
    config = Qwen3Config(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        layer_types=["full_attention"] * 2,
        block_size=4,
        dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 1]},
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).float().eval()
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.normal_(0, 0.3)
    drafter.fuse_projections()
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(3, 11, 2, 32, generator=generator)
    blocks = torch.randn(3, 2, 4, 32, generator=generator)
    starts = torch.tensor([[1, 5], [9, 3], [4, 4]])
    return drafter, features, blocks, starts


@torch.inference_mode()
def drafts(drafter, features, blocks, starts) -> torch.Tensor:
    return drafter(blocks, starts, drafter.context_kv(features))


def test_the_drafter_runs_both_elementwise_kernels_where_they_apply_and_matches_eager(
    monkeypatch, kernels_apply
):
    drafter, *inputs = drafter_and_inputs()
    monkeypatch.setattr(drafter_ops, "ELEMENTWISE", "eager")
    expected = drafts(drafter, *inputs)
    norm_rope, silu_mul = Calls(reference.norm_rope), Calls(reference.silu_mul)
    install(monkeypatch, "norm_rope", norm_rope=norm_rope)
    install(monkeypatch, "silu_mul", silu_mul=silu_mul)
    monkeypatch.setattr(drafter_ops, "ELEMENTWISE", "triton")
    found = drafts(drafter, *inputs)
    # float32: the references differ from eager only in where the rotation rounds.
    torch.testing.assert_close(found, expected, atol=1e-5, rtol=1e-5)
    # Per layer: q and k of the blocks, k of the context; the MLP of every layer.
    assert norm_rope.count == 3 * 2 and silu_mul.count == 2


@pytest.mark.parametrize("kernel_applies", [True, False], ids=["norm_rope kernel", "eager"])
@torch.inference_mode()
def test_the_queries_are_written_folded_where_flash_reads_them(monkeypatch, kernel_applies):
    drafter, _, blocks, starts = drafter_and_inputs()
    attn = drafter.decoder_layers[0].self_attn
    cos, sin = drafter.rope(starts[..., None] + torch.arange(4), blocks)
    expected = attn.qkv(blocks, cos, sin)
    assert not expected[0][:, :1].permute(0, 1, 4, 2, 3, 5).is_contiguous()
    norm_rope = Calls(reference.norm_rope)
    install(monkeypatch, "norm_rope", norm_rope=norm_rope)
    monkeypatch.setattr(drafter_ops, "TRITON_FAILED", None)
    monkeypatch.setattr(kernels, "applies", lambda *tensors: kernel_applies)
    monkeypatch.setattr(block_attention, "TOKEN_MAJOR_DEVICES", ("cpu",))
    found = attn.qkv(blocks, cos, sin)
    # [B, m, groups, bs, kv_heads, head_dim] in memory: a kv head's groups x block queries are one run.
    assert found[0].permute(0, 1, 4, 2, 3, 5).is_contiguous()
    for got, want in zip(found, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # The kernel wrote the queries in place (one call with out) and the keys as before.
    assert norm_rope.count == (2 if kernel_applies else 0)
    monkeypatch.setattr(block_attention, "KERNEL", "sdpa")
    assert attn.qkv(blocks, cos, sin)[0].is_contiguous()


def test_the_drafter_keeps_eager_where_the_kernels_do_not_apply(monkeypatch):
    drafter, *inputs = drafter_and_inputs()
    expected = drafts(drafter, *inputs)
    calls = Calls()
    install(monkeypatch, "norm_rope", norm_rope=calls)
    install(monkeypatch, "silu_mul", silu_mul=calls)
    monkeypatch.setattr(drafter_ops, "ELEMENTWISE", "triton")
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    assert torch.equal(drafts(drafter, *inputs), expected)
    assert calls.count == 0


def test_silu_mul_keeps_eager_for_another_activation(monkeypatch, kernels_apply):
    calls = Calls()
    install(monkeypatch, "silu_mul", silu_mul=calls)
    monkeypatch.setattr(drafter_ops, "ELEMENTWISE", "triton")
    gate, up = torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    expected = nn.GELU()(gate) * up
    assert torch.equal(drafter_ops.silu_mul(nn.GELU(), gate.clone(), up), expected)
    assert calls.count == 0


def test_cos_per_token_is_a_view_where_the_token_dimensions_end_alike_and_a_copy_otherwise():
    cos = torch.randn(11, 8)
    rows, _ = per_token(cos, cos, (3, 11))
    assert rows.shape == (11, 8) and rows.data_ptr() == cos.data_ptr()
    rows, _ = per_token(cos[None], cos[None], (3, 11))
    assert rows.shape == (11, 8) and rows.data_ptr() == cos.data_ptr()
    by_sequence = torch.randn(3, 1, 8)
    rows, _ = per_token(by_sequence, by_sequence, (3, 11))
    assert rows.shape == (33, 8) and torch.equal(rows[11 * 2 + 5], by_sequence[2, 0])


# ---------------------------------------------------------------------------------------------
# The references against eager, in bfloat16: the rounding the kernels are allowed to differ by
# ---------------------------------------------------------------------------------------------


def ulps(found: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference in units of bfloat16's last place at each expected value (2^-7 relative)."""
    scale = expected.float().abs().clamp_min(2**-20) * 2**-7
    return float(((found.float() - expected.float()).abs() / scale).max())


def test_the_silu_mul_reference_is_eager_rounded_once():
    generator = torch.Generator().manual_seed(5)
    gate, up = (torch.randn(64, 96, generator=generator).bfloat16() * 3 for _ in range(2))
    found = reference.silu_mul(gate, up)
    expected = nn.SiLU()(gate.clone()).mul_(up)
    assert found.dtype == torch.bfloat16 and 0 < ulps(found, expected) <= 2


def test_the_norm_rope_reference_is_eager_with_the_rotation_rounded_once():
    generator = torch.Generator().manual_seed(6)
    tokens, heads, d = 10, 3, 16
    x = torch.randn(tokens, heads, d, generator=generator).bfloat16()
    norm = RMSNorm(d, eps=1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.normal_(1, 0.2, generator=generator)
    angle = torch.randn(5, d // 2, generator=generator).repeat(1, 2)
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    with torch.no_grad():
        found = reference.norm_rope(x, norm.weight, 1e-6, cos, sin)
        # Token t reads row t % 5.
        per_token_cos = cos.repeat(2, 1)[:, None, :]
        per_token_sin = sin.repeat(2, 1)[:, None, :]
        expected = apply_rope(norm(x), per_token_cos, per_token_sin)
    assert found.shape == x.shape and found.dtype == torch.bfloat16
    # Rotations of values near cancellation differ by more than an ulp of the small result: compare
    # against the scale of the inputs (the norm's output, ~1).
    assert 0 < float((found.float() - expected.float()).abs().max()) <= 2 * 2**-7 * 4


def test_a_kernel_that_fails_to_build_leaves_the_drafter_on_eager_and_says_so_once(
    monkeypatch, kernels_apply
):
    drafter, *inputs = drafter_and_inputs()
    monkeypatch.setattr(drafter_ops, "ELEMENTWISE", "eager")
    expected = drafts(drafter, *inputs)

    def broken(*args, **kwargs):
        raise RuntimeError("CompilationError: no C compiler found\nmore detail")

    norm_rope = Calls(broken)
    install(monkeypatch, "norm_rope", norm_rope=norm_rope)
    install(monkeypatch, "silu_mul", silu_mul=Calls())
    monkeypatch.setattr(drafter_ops, "ELEMENTWISE", "triton")
    monkeypatch.setattr(drafter_ops, "TRITON_FAILED", None)
    with pytest.warns(RuntimeWarning, match="no C compiler found") as warned:
        found = drafts(drafter, *inputs)
        again = drafts(drafter, *inputs)
    assert torch.equal(found, expected) and torch.equal(again, expected)
    # The first failure turns the kernels off: one call, one warning, and silu_mul never tried.
    assert norm_rope.count == 1 and len(warned) == 1
    assert drafter_ops.TRITON_FAILED == "RuntimeError: CompilationError: no C compiler found"


# ---- residual sums in the products' epilogues (drafter_ops.add_linear) ------------------------------


@pytest.mark.parametrize("sum_in_product", [True, False])
def test_a_residual_sum_in_the_product_equals_the_separate_sum(monkeypatch, sum_in_product):
    monkeypatch.setattr(drafter_ops, "SUM_IN_PRODUCT", sum_in_product)
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(12, 8, bias=False)
    x = torch.randn(3, 4, 8, generator=generator)
    h = torch.randn(3, 4, 12, generator=generator)
    expected = x + linear(h).detach()
    with torch.inference_mode():
        given = x.clone()
        kept = drafter_ops.add_linear(given, linear, h)
        assert torch.equal(given, x)  # not the caller's to give up: untouched
        assert torch.allclose(kept, expected, atol=1e-6)
        given_up = drafter_ops.add_linear(given, linear, h, in_place=True)
        assert torch.allclose(given_up, expected, atol=1e-6)
        # Into the residual's memory only where the sum is taken in the product.
        assert (given_up.data_ptr() == given.data_ptr()) == sum_in_product
        # A strided residual cannot take it in place: a new tensor, the residual untouched.
        strided = x.transpose(0, 1).contiguous().transpose(0, 1)
        assert not strided.is_contiguous()
        assert torch.allclose(drafter_ops.add_linear(strided, linear, h, in_place=True), expected, atol=1e-6)
        assert torch.equal(strided, x)
    # Under autograd the separate sum, with its gradient.
    leaf = x.clone().requires_grad_()
    drafter_ops.add_linear(leaf, linear, h, in_place=True).sum().backward()
    assert leaf.grad is not None and torch.equal(leaf.grad, torch.ones_like(x))
    with torch.inference_mode():
        biased = nn.Linear(12, 8)
        assert torch.allclose(drafter_ops.add_linear(x.clone(), biased, h, True), x + biased(h), atol=1e-6)
