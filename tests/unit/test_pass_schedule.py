"""A step's pass sizes from the leading matches of the step before."""

from __future__ import annotations

import torch

from specops.score.pass_schedule import PassSchedule


def test_nothing_is_expected_before_a_step_is_recorded():
    assert PassSchedule(15, torch.device("cpu")).expected(256) is None


def test_room_follows_the_share_of_blocks_that_matched_that_far_with_a_margin():
    schedule = PassSchedule(4, torch.device("cpu"))
    schedule.record(torch.tensor([0, 2, 2, 4]))
    # Blocks matching up to position p: 4, 3, 3, 1, 1 of 4. For 8 blocks the same shares, with room for
    # two binomial spreads and one more: at p = 3, 2 + 2 * sqrt(8 * 0.25 * 0.75) + 1 -> 6.
    assert schedule.expected(8) == [8, 8, 8, 6, 6]
    assert schedule.expected(64) == [64, 56, 56, 24, 24]
    # A position no block reached still gets room for one.
    schedule.record(torch.tensor([1, 1]))
    assert schedule.expected(2) == [2, 2, 1, 1, 1]


def test_room_never_falls_below_what_the_recorded_step_itself_needed():
    generator = torch.Generator().manual_seed(0)
    runs = torch.randint(0, 16, (256,), generator=generator)
    schedule = PassSchedule(15, torch.device("cpu"))
    schedule.record(runs)
    room = schedule.expected(256)
    assert all(room[p] >= int((runs >= p).sum()) for p in range(16))
    assert room[0] == 256
