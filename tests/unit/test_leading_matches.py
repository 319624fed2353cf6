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

    def states(rows, first, last):
        asked.append((rows.tolist(), first, last))
        return hidden[rows, first:last]

    assert torch.equal(leading_matches(head, states, targets, positions_per_pass=3), runs.clamp_max(7))
    assert [(first, last) for _, first, last in asked] == [(0, 3), (3, 6), (6, 7)][: len(asked)]
    for rows, first, _ in asked:
        assert rows == [b for b in range(30) if runs[b] >= first]


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
