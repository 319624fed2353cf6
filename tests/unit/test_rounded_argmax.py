"""The head's tokens from rounded logits (`specops.score.rounded_argmax`), on the CPU with the kernels'
references in their place (benchmarks/score_triton_check.py compares the kernels with them on a GPU):

- the step below every half-precision value;
- the candidates: every position at or above a row's floor, counted past the room for them;
- the tokens against torch.argmax of float32 logits, close calls and exact ties included, and the rows left
  unsettled (too many close tokens, a NaN);
- the head passes: the same leading matches as float32 logits, a pass with an unsettled row taken again in
  float32, a failure falling back once, and the rule that says where the rounded logits apply.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import specops.score.kernels as kernels  # noqa: E402
import specops.score.leading_matches as matching  # noqa: E402
import specops.score.target_head as target_head  # noqa: E402
from specops.score.kernels import reference  # noqa: E402
from specops.score.leading_matches import leading_matches  # noqa: E402
from specops.score.rounded_argmax import CANDIDATES, rounded_argmax, step_below  # noqa: E402
from specops.score.target_head import TargetHead  # noqa: E402

CHUNK = 64


@pytest.fixture
def references(monkeypatch):
    """The kernels' references in their place (chunks of CHUNK positions), the rounded logits on the CPU."""
    monkeypatch.setitem(
        sys.modules,
        "specops.score.kernels.row_argmax",
        SimpleNamespace(chunk_maxima=lambda logits: reference.chunk_maxima(logits, CHUNK)),
    )
    monkeypatch.setitem(
        sys.modules,
        "specops.score.kernels.near_max",
        SimpleNamespace(near_max=lambda *args: reference.near_max(*args, chunk=CHUNK)),
    )
    monkeypatch.setattr(kernels, "applies", lambda *tensors: True)
    monkeypatch.setattr(target_head, "ROUNDED_DEVICES", ("cpu",))
    monkeypatch.setattr(target_head, "ROUNDED_FAILED", None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_step_below_is_the_next_value_down_for_every_value(dtype):
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    values = every[~every.isnan() & (every != float("-inf"))]
    # Ascending; -0 and +0 are one value, and the negative value of least magnitude comes below it.
    ordered = torch.unique(values.float())
    below = torch.searchsorted(ordered, values.float(), side="left") - 1
    expected = torch.where(below >= 0, ordered[below.clamp_min(0)], float("-inf"))
    assert torch.equal(step_below(values).float(), expected)
    # Nothing lies below -inf or NaN: NaN, a floor no logit reaches (the row is then left unsettled).
    assert step_below(torch.tensor([float("-inf"), float("nan")], dtype=dtype)).isnan().all()


def test_the_reference_finds_every_position_at_or_above_the_floor_and_counts_past_its_room():
    logits = torch.tensor([[1.0, 5.0, 4.0, 5.0, 2.0], [3.0, 3.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0, 9.0]])
    floor = torch.tensor([4.0, 3.0, 10.0])
    found, count = reference.near_max(logits, None, floor, 3, chunk=2)
    assert count.tolist() == [3, 5, 0]
    assert found.tolist() == [[1, 2, 3], [0, 1, 2], [-1, -1, -1]]


def close_calls() -> tuple[torch.Tensor, torch.Tensor]:
    """Integer rows and head (float32 sums exact) whose logits of a few hundred tie in bfloat16 (steps of 2
    and 4 there) but not in float32, and rows of every kind of close call, each on a dimension of its own."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randint(-3, 4, (300, 16), generator=generator).float()
    rows = torch.randint(-3, 4, (40, 16), generator=generator).float()
    weight[:, :4] = 0.0
    rows[:4] = 0.0
    # Row 0 against tokens 10 and 250: 300 and 301, one bfloat16 value: float32 settles it (250).
    weight[10, 0], weight[250, 0] = 300.0, 300.0
    weight[250, 15] = 1.0
    rows[0, 0], rows[0, 15] = 1.0, 1.0
    # Row 1: tokens 20 and 200 equal in float32 too: the lower.
    weight[20, 1], weight[200, 1] = 400.0, 400.0
    rows[1, 1] = 1.0
    # Row 2: six tokens within a step of the top, more than the room for them: unsettled.
    for token in range(100, 106):
        weight[token, 2] = 500.0 + (token - 100) / 4
    rows[2, 2] = 1.0
    # Row 3: a NaN: unsettled.
    rows[3, 3] = float("nan")
    return rows.bfloat16(), weight.bfloat16()


def test_rounded_logits_give_the_float32_argmax_and_leave_the_close_crowds_unsettled(references):
    rows, weight = close_calls()
    tokens, unsettled = rounded_argmax(rows, weight)
    expected = (rows.float() @ weight.float().T).argmax(dim=-1)
    assert tokens[:2].tolist() == [250, 20] and expected[:2].tolist() == [250, 20]
    # The bfloat16 logits alone would have called row 0 a tie (and taken 10).
    assert (rows[:1] @ weight.T)[0, 10] == (rows[:1] @ weight.T)[0, 250]
    assert unsettled[:4].tolist() == [False, False, True, True]
    assert not unsettled[4:].any()
    assert torch.equal(tokens[4:], expected[4:])
    assert CANDIDATES < 6


def matching_head(dtype=torch.bfloat16) -> tuple[TargetHead, torch.Tensor, torch.Tensor]:
    """A head, draft states [40, 15, hidden] and targets that follow the float32 drafts for a random number
    of positions; block 7's states are zero from position 4 (every logit 0: unsettled, token 0)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 16, generator=generator).to(dtype)
    head = TargetHead(weight, weight)
    hidden = torch.randn(40, 15, 16, generator=generator).to(dtype)
    hidden[7, 4:] = 0.0
    drafts = head.argmax(hidden)
    runs = torch.randint(0, 16, (40,), generator=generator)
    runs[7] = 15
    targets = torch.where(torch.arange(15) < runs[:, None], drafts, (drafts + 1) % 300)
    return head, hidden, targets


def test_head_passes_from_rounded_logits_match_the_float32_passes(references, monkeypatch):
    monkeypatch.setattr(matching, "MIN_ROWS_PER_PASS", {})
    head, hidden, targets = matching_head()
    expected = (head.argmax(hidden) == targets).long().cumprod(dim=-1).sum(dim=-1)
    assert torch.equal(leading_matches(head, hidden, targets, positions_per_pass=3), expected)
    # Block 7's zero states are in three rounded passes (from the second; the last is float32 anyway): each
    # is taken again in float32.
    assert head.unsettled_passes == 3
    hidden[7, 4:] = hidden[6, 4:]
    targets[7, 4:] = head.argmax(hidden[7, 4:])
    expected = (head.argmax(hidden) == targets).long().cumprod(dim=-1).sum(dim=-1)
    assert torch.equal(leading_matches(head, hidden, targets, positions_per_pass=3), expected)
    assert head.unsettled_passes == 3


def test_the_passes_take_rounded_logits_except_the_last_of_a_step(references, monkeypatch):
    monkeypatch.setattr(matching, "MIN_ROWS_PER_PASS", {})
    head, hidden, targets = matching_head()
    hidden[7, 4:] = hidden[6, 4:]
    targets = torch.where(targets == head.argmax(hidden), targets, head.argmax(hidden))  # all match
    calls = []
    rounded, exact = TargetHead.rounded_argmax, TargetHead.argmax
    monkeypatch.setattr(
        TargetHead, "rounded_argmax", lambda self, h, *a: calls.append("rounded") or rounded(self, h, *a)
    )
    monkeypatch.setattr(
        TargetHead, "argmax", lambda self, h, *a: calls.append("float32") or exact(self, h, *a)
    )
    assert leading_matches(head, hidden, targets, positions_per_pass=4).tolist() == [15] * 40
    assert calls == ["rounded"] * 3 + ["float32"]


def test_a_rounded_path_that_fails_leaves_the_float32_logits_and_says_so_once(references, monkeypatch):
    head, hidden, _ = matching_head()

    def broken(*args):
        raise RuntimeError("PTX compilation failed")

    monkeypatch.setitem(sys.modules, "specops.score.kernels.near_max", SimpleNamespace(near_max=broken))
    with pytest.warns(RuntimeWarning, match="rounded logits failed"):
        tokens, unsettled = head.rounded_argmax(hidden)
    assert unsettled is None and torch.equal(tokens, head.argmax(hidden))
    assert "PTX compilation failed" in target_head.ROUNDED_FAILED
    assert head.rounded_argmax(hidden)[1] is None


def test_rounded_logits_apply_on_their_devices_to_half_precision_without_multiplier_or_softcap(
    references, monkeypatch
):
    head, hidden, _ = matching_head()
    rows = hidden.flatten(0, 1)
    assert head.rounded_applies(rows, 1.0, None)
    assert not head.rounded_applies(rows, 0.5, None)
    assert not head.rounded_applies(rows, 1.0, 30.0)
    assert not head.rounded_applies(rows.float(), 1.0, None)
    assert not TargetHead(head.embed_weight, head.lm_head_weight, logits_budget_bytes=1024).rounded_applies(
        rows, 1.0, None
    )
    assert not TargetHead(head.embed_weight, head.lm_head_weight, vocab_chunk=64).rounded_applies(
        rows, 1.0, None
    )
    monkeypatch.setattr(target_head, "ROUNDED_DEVICES", ())
    assert not head.rounded_applies(rows, 1.0, None)
    assert head.rounded_argmax(hidden)[1] is None
