"""The closest call of an offline walk: the smallest logit margin that decided any of its drafts."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from test_drafter_sliding import HIDDEN, build, one_thread  # noqa: E402, F401 (an autouse fixture)

from specops.score.acceptance import SequenceInput, offline_acceptance  # noqa: E402
from specops.score.margins import closest_call  # noqa: E402
from specops.score.sequential_acceptance import SequentialDrafter  # noqa: E402
from specops.score.target_head import TargetHead  # noqa: E402

VOCAB, LENGTH, PROMPT = 64, 40, 6


@pytest.fixture
def walked():
    torch.manual_seed(3)
    drafter = build(["full_attention", "full_attention"])
    head = TargetHead(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN))
    # A target that repeats a short loop: the drafts match sometimes, so steps differ in length.
    ids = torch.tensor([5, 9, 12, 7, 3, 21] + [11, 30, 2, 45] * 9)[:LENGTH]
    sequence = SequenceInput("p", ids, torch.randn(LENGTH, 2, HIDDEN), PROMPT)
    (result,) = offline_acceptance(drafter, head, [sequence])
    return drafter, head, sequence, result


def naive_closest(drafter, head, sequence, result) -> float:
    """Every step drafted again one block at a time, margins taken by their definition."""
    oracle = SequentialDrafter(drafter, head, sequence.features)
    ids = sequence.input_ids.tolist()
    margins = []
    for start, length in zip(result.block_starts, result.accept_lengths, strict=True):
        logits = head.logits(oracle.block_hidden(ids[start], start))
        accepted = length - 1
        for j in range(1, min(accepted + 1, drafter.block_size - 1, len(ids) - 1 - start) + 1):
            row = logits[j - 1].tolist()
            best = max(row)
            if j <= accepted:
                margins.append(best - sorted(row)[-2])
            else:
                margins.append(best - row[ids[start + j]])
    return min(margins)


@torch.no_grad()
def test_closest_call_equals_the_margins_taken_one_block_at_a_time(walked):
    drafter, head, sequence, result = walked
    found = closest_call(drafter, head, sequence, result.block_starts, result.accept_lengths)
    assert found["closest"] == pytest.approx(naive_closest(drafter, head, sequence, result), abs=1e-4)
    assert found["block_start"] in result.block_starts and found["closest"] >= 0


@torch.no_grad()
def test_a_walk_without_steps_has_no_closest_call(walked):
    drafter, head, sequence, _ = walked
    assert closest_call(drafter, head, sequence, [], [])["closest"] is None
