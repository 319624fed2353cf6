"""A step's head passes planned from the leading matches of the step before."""

from __future__ import annotations

import torch

from specops.score.pass_schedule import PassSchedule, pass_width


def test_nothing_is_planned_before_a_step_is_recorded():
    assert PassSchedule(15, torch.device("cpu")).plan(256, 3, 0) is None


def test_passes_are_as_wide_as_waited_ones_for_the_expected_count_with_room_for_a_margin():
    schedule = PassSchedule(4, torch.device("cpu"))
    schedule.record(torch.tensor([0, 2, 2, 4]))
    # Matching up to position p: 4, 3, 3, 1, 1 of 4 blocks. For 64 blocks: 64 at 0, then 48 expected at 2
    # with room for two binomial spreads and one more, 2 * sqrt(48 * 0.25) -> 56.
    assert schedule.plan(64, 2, 0) == [(64, 2), (56, 2)]
    # Widened where few blocks are expected (rows up to 40), the room filling those rows.
    assert schedule.plan(8, 2, 40) == [(8, 4)]
    assert pass_width(2, 40, 8) == 5
    schedule.record(torch.tensor([1, 1]))
    # No block reached position 2: room for one there.
    assert schedule.plan(2, 2, 0) == [(2, 2), (1, 2)]


def test_room_never_falls_below_what_the_recorded_step_itself_needed():
    generator = torch.Generator().manual_seed(0)
    runs = torch.randint(0, 16, (256,), generator=generator)
    schedule = PassSchedule(15, torch.device("cpu"))
    schedule.record(runs)
    plan = schedule.plan(256, 3, 0)
    assert plan is not None and sum(width for _, width in plan) == 15
    first = 0
    for room, width in plan:
        assert room >= int((runs >= first).sum())
        first += width
