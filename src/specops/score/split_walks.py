"""Walks of one completion started inside its range, so that the frontier's batch stays full to the end.

The frontier (`specops.score.acceptance`) walks every completion of a group in lockstep, one block each
per forward. Completions differ in tau, so their walks differ in steps, and the forwards after most walks
ended run a few blocks each, bound by reading the weights rather than by arithmetic. How many there are
depends on the spread of tau: on the H200 one group of 256 completions of 1,000 tokens took 185 forwards
for 167 steps on average (benchmarks/score_real_h200.json).

The step from a position depends on that position alone (the block there, the context before it, the
target's tokens after it), whoever takes it. So when walks end, the batch is filled again with new walks
that start in the middle of the longest ranges still ahead of a walk: a walk that lands where another
walk of its completion stood stops there (that walk's steps from there are its own), and each
completion's walk is read back from the steps all its walks took, from its prompt's end
(`acceptance.walks_from_steps`). The lengths
are those of one walk; what it costs is the steps a walk takes past a split before it lands on the new
walk's path (about tau of them). The frontier splits walks on the devices in
`acceptance.SPLIT_DEVICES`: none, since on the H200 it saved 9 of 185 forwards and no time (see there).
"""

from __future__ import annotations

import torch

# A range is split only with at least this many positions ahead of its walk: the new walk then saves
# more steps than the walk behind it takes to land on the new walk's path.
MIN_SPLIT_POSITIONS = 64


class SplitWalks:
    """Per walk (a row of the frontier's batch): its sequence and the end of the range it walks alone;
    per sequence and position: whether a walk stood there."""

    def __init__(self, starts: torch.Tensor, lengths: torch.Tensor, width: int):
        device = starts.device
        self.capacity, self.width = starts.shape[0], width
        self.sequence = torch.arange(self.capacity, device=device)
        # Where the next walk of the same sequence starts, or the sequence's end.
        self.limits = lengths - 1
        # One slot past the positions: where rows that take no step write.
        self.stood = torch.zeros(self.capacity * width + 1, dtype=torch.bool, device=device)
        self.claimed = torch.full((self.capacity * width + 1,), -1, dtype=torch.long, device=device)
        self.stood[self._slots(starts)] = True

    def _slots(self, starts: torch.Tensor, moving: torch.Tensor | None = None) -> torch.Tensor:
        slots = self.sequence * self.width + starts
        return slots if moving is None else torch.where(moving, slots, self.capacity * self.width)

    def refill(self, keep: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows to keep (walks going on) and new walks in the longest ranges, up to the capacity.

        keep: rows still walking; starts: every row's start. Returns (index, starts): index selects
        the batch's rows (a new walk repeats its sequence's row), starts are the new batch's starts.
        One host read of the kept walks' ranges.
        """
        starts, limits, sequence = starts[keep], self.limits[keep], self.sequence[keep]
        room = self.capacity - keep.shape[0]
        ahead = (limits - starts).tolist()
        order = sorted(range(len(ahead)), key=lambda i: -ahead[i])
        parents = [i for i in order[:room] if ahead[i] >= MIN_SPLIT_POSITIONS]
        if not parents:
            self.limits, self.sequence = limits, sequence
            return keep, starts
        chosen = torch.tensor(parents, device=keep.device)
        middle = starts[chosen] + (limits[chosen] - starts[chosen]) // 2
        self.limits = torch.cat([limits.index_copy(0, chosen, middle), limits[chosen]])
        self.sequence = torch.cat([sequence, sequence[chosen]])
        starts = torch.cat([starts, middle])
        moving = torch.ones_like(starts, dtype=torch.bool)
        moving[: keep.shape[0]] = False
        self.stood[self._slots(starts, moving)] = True
        return torch.cat([keep, keep[chosen]]), starts

    def land(self, starts: torch.Tensor, walking: torch.Tensor) -> torch.Tensor:
        """After a step to starts: which walks go on. A walk stops where a walk of its sequence stood
        (its steps from there are recorded), and of walks landing on one position in the same step, one
        goes on. No host sync."""
        slots = self._slots(starts, walking)
        walking = walking & ~self.stood[slots]
        slots = self._slots(starts, walking)
        rows = torch.arange(starts.shape[0], device=starts.device)
        self.claimed.index_put_((slots,), rows)
        walking = walking & (self.claimed[slots] == rows)
        self.stood[self._slots(starts, walking)] = True
        return walking
