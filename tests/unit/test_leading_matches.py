"""The head over a few positions at a time gives the leading matches of the head over all of them."""

from __future__ import annotations

import pytest
import torch

import specops.score.leading_matches as matching
from specops.score.leading_matches import leading_matches
from specops.score.target_head import TargetHead


@pytest.mark.parametrize("min_rows", [0, 64])
@pytest.mark.parametrize("per_pass", [1, 2, 3, 4, 15])
def test_leading_matches_equal_the_full_heads(per_pass, min_rows, monkeypatch):
    monkeypatch.setattr(matching, "MIN_ROWS_PER_PASS", {"cpu": min_rows})
    generator = torch.Generator().manual_seed(0)
    head = TargetHead(torch.randn(64, 16, generator=generator), torch.randn(64, 16, generator=generator))
    hidden = torch.randn(40, 15, 16, generator=generator)
    drafts = head.argmax(hidden)
    # Targets that follow the drafts for a random number of positions, then differ.
    runs = torch.randint(0, 16, (40,), generator=generator)
    targets = torch.where(torch.arange(15) < runs[:, None], drafts, (drafts + 1) % 64)
    expected = (head.argmax(hidden) == targets).long().cumprod(dim=-1).sum(dim=-1)
    assert torch.equal(expected, runs.clamp_max(15))
    assert torch.equal(leading_matches(head, hidden, targets, positions_per_pass=per_pass), expected)


def test_blocks_past_their_first_mismatch_never_reach_the_head(monkeypatch):
    monkeypatch.setattr(matching, "MIN_ROWS_PER_PASS", {})
    head = TargetHead(torch.eye(4), torch.eye(4))
    hidden = torch.eye(4)[torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])]  # drafts 0, 1, 2, 3 in both blocks
    targets = torch.tensor([[0, 1, 2, 3], [9, 1, 2, 3]])
    rows = []
    argmax = TargetHead.argmax
    monkeypatch.setattr(
        TargetHead, "argmax", lambda self, h, *a: rows.append(h.shape[0]) or argmax(self, h, *a)
    )
    assert leading_matches(head, hidden, targets, positions_per_pass=2).tolist() == [4, 0]
    assert rows == [2, 1]


def test_draft_states_given_as_a_function_are_asked_for_the_matching_blocks_only(monkeypatch):
    monkeypatch.setattr(matching, "MIN_ROWS_PER_PASS", {})
    generator = torch.Generator().manual_seed(1)
    head = TargetHead(torch.randn(64, 16, generator=generator), torch.randn(64, 16, generator=generator))
    hidden = torch.randn(30, 7, 16, generator=generator)
    drafts = head.argmax(hidden)
    runs = torch.randint(0, 8, (30,), generator=generator)
    targets = torch.where(torch.arange(7) < runs[:, None], drafts, (drafts + 1) % 64)
    asked = []

    def states(rows, positions):
        asked.append((rows.tolist(), positions.tolist()))
        return hidden[rows[:, None], positions]

    assert torch.equal(leading_matches(head, states, targets, positions_per_pass=3), runs.clamp_max(7))
    spans = [[0, 1, 2], [3, 4, 5], [6]][: len(asked)]
    for (rows, positions), span in zip(asked, spans, strict=True):
        assert rows == [b for b in range(30) if runs[b] >= span[0]]
        assert positions == [span] * len(rows)


def test_a_pass_over_few_blocks_widens_to_the_rows_that_cost_no_more(monkeypatch):
    monkeypatch.setattr(matching, "MIN_ROWS_PER_PASS", {"cpu": 4})
    head = TargetHead(torch.eye(6), torch.eye(6))
    hidden = torch.eye(6)[torch.arange(6).expand(2, 6)]  # drafts 0..5 in both blocks
    targets = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 9, 4, 5]])
    shapes = []
    argmax = TargetHead.argmax
    monkeypatch.setattr(
        TargetHead, "argmax", lambda self, h, *a: shapes.append(tuple(h.shape[:2])) or argmax(self, h, *a)
    )
    assert leading_matches(head, hidden, targets, positions_per_pass=1).tolist() == [6, 3]
    # Two blocks: passes of 2 positions; the one left after the mismatch takes the last 2 in one pass.
    assert shapes == [(2, 2), (2, 2), (1, 2)]


def test_passes_on_the_cpu_keep_their_width():
    assert matching.MIN_ROWS_PER_PASS.get("cpu", 0) == 0


def _planted(blocks: int, positions: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    head = TargetHead(torch.randn(64, 16, generator=generator), torch.randn(64, 16, generator=generator))
    hidden = torch.randn(blocks, positions, 16, generator=generator)
    drafts = head.argmax(hidden)
    runs = torch.randint(0, positions + 1, (blocks,), generator=generator)
    targets = torch.where(torch.arange(positions) < runs[:, None], drafts, (drafts + 1) % 64)
    return head, hidden, targets, runs


def _at_least(runs: torch.Tensor, positions: int) -> list[int]:
    return [int((runs >= p).sum()) for p in range(positions + 1)]


@pytest.mark.parametrize("min_rows", [0, 40])
@pytest.mark.parametrize("per_pass", [1, 3, 4])
@pytest.mark.parametrize("room", ["exact", "none", "all", "random", "short"])
def test_scheduled_passes_give_the_waited_passes_counts_whatever_room_they_make(
    room, per_pass, min_rows, monkeypatch
):
    monkeypatch.setattr(matching, "MIN_ROWS_PER_PASS", {"cpu": min_rows})
    head, hidden, targets, runs = _planted(40, 15, seed=per_pass + min_rows)
    at_least = _at_least(runs, 15)
    widths = [per_pass] * (15 // per_pass) + ([15 % per_pass] if 15 % per_pass else [])
    starts = [sum(widths[:i]) for i in range(len(widths))]
    generator = torch.Generator().manual_seed(3)
    plan = {
        "exact": [(at_least[first], width) for first, width in zip(starts, widths, strict=True)],
        "none": [(1, width) for width in widths],
        "all": [(40, width) for width in widths],
        "random": [(int(torch.randint(1, 41, (), generator=generator)), width) for width in widths],
        "short": [(40, 2)],
    }[room]
    waited = leading_matches(head, hidden, targets, positions_per_pass=per_pass)
    scheduled = leading_matches(head, hidden, targets, positions_per_pass=per_pass, plan=plan)
    assert torch.equal(waited, runs)
    assert torch.equal(scheduled, runs)


def test_a_schedule_with_room_for_every_matching_block_leaves_nothing_to_wait_for(monkeypatch):
    monkeypatch.setattr(matching, "MIN_ROWS_PER_PASS", {})
    head, hidden, targets, runs = _planted(40, 15, seed=5)
    asked = []

    def states(rows, positions):
        asked.append(positions[:, 0].tolist())
        return hidden[rows[:, None], positions]

    at_least = _at_least(runs, 15)
    plan = [(at_least[first], 3) for first in (0, 3, 6, 9, 12)]
    assert torch.equal(leading_matches(head, states, targets, plan=plan), runs)
    # Five scheduled passes of 3 positions, each matching block at the pass's own position: none was
    # left behind, so no waited pass followed.
    assert [len(p) for p in asked] == [n for n, _ in plan]
    for first, starts in zip((0, 3, 6, 9, 12), asked, strict=True):
        assert starts[: at_least[first]] == [first] * at_least[first]


def test_blocks_a_schedule_had_no_room_for_are_taken_later_at_their_own_position(monkeypatch):
    monkeypatch.setattr(matching, "MIN_ROWS_PER_PASS", {})
    head, hidden, targets, _ = _planted(6, 6, seed=0)
    targets = head.argmax(hidden)  # every block matches all 6 positions
    asked = []

    def states(rows, positions):
        asked.append((rows.tolist(), positions.tolist()))
        return hidden[rows[:, None], positions]

    runs = leading_matches(head, states, targets, positions_per_pass=3, plan=[(6, 3), (2, 3)])
    assert runs.tolist() == [6] * 6
    assert asked[0] == (list(range(6)), [[0, 1, 2]] * 6)
    # Room for 2 at the second pass: blocks 0 and 1 finish; 2-5 go through one waited pass from position 3.
    assert asked[1] == ([0, 1], [[3, 4, 5]] * 2)
    assert asked[2] == ([2, 3, 4, 5], [[3, 4, 5]] * 4)
    assert len(asked) == 3
