"""How many blocks a step's head passes should expect still matching at each draft position.

A group walks the same completions step after step, so how far its blocks' drafts match changes little
from one step to the next. The leading matches of the last step give, for each position p, the share of
blocks that matched every position before p; the next step's pass at p is sized for that share of its
blocks and a margin of MARGIN_SPREADS binomial spreads (`leading_matches`, scheduled). The counts come
back from the device with the step's own synchronization, never waited for on their own.
"""

from __future__ import annotations

import math

import torch

# Devices whose head passes are scheduled: there a host synchronization leaves the device idle while the
# next pass is launched. On the CPU a pass waited for costs nothing, and a scheduled one's spare rows do.
SCHEDULED_DEVICES: tuple[str, ...] = ("cuda",)
# Spreads above the expected count a pass makes room for: a block left out waits for a later pass or,
# at the schedule's end, for a waited one (a synchronization).
MARGIN_SPREADS = 2.0


class PassSchedule:
    """`record` a step's leading matches [N] (0..positions); `expected(blocks)` for the next step."""

    def __init__(self, positions: int, device: torch.device):
        self.positions = positions
        self.pinned = device.type == "cuda"
        self._counts: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def record(self, runs: torch.Tensor) -> None:
        flat = runs.flatten()
        counts = torch.zeros(self.positions + 1, dtype=torch.long, device=flat.device)
        # index_add_, not bincount: bincount on CUDA reads the largest value back first (a synchronization).
        counts.index_add_(0, flat, torch.ones_like(flat))
        if not self.pinned:
            self._counts = counts
            return
        if self._counts is None:
            self._counts = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self._copied = torch.cuda.Event()
        self._counts.copy_(counts, non_blocking=True)
        assert self._copied is not None
        self._copied.record()

    def plan(self, blocks: int, per_pass: int, min_rows: int) -> list[tuple[int, int]] | None:
        """The next step's passes over `blocks` blocks as (blocks to take, positions): each pass as wide as a
        waited pass would be for the expected count (`leading_matches.pass_width`), with room for
        MARGIN_SPREADS binomial spreads more, or for as many as fill min_rows rows, where a pass of fewer
        rows costs the same. None before the first record."""
        if self._counts is None:
            return None
        if self._copied is not None:
            self._copied.synchronize()
        counts = self._counts.tolist()
        total = sum(counts)
        if total == 0:
            return None
        passes, first = [], 0
        while first < self.positions:
            share = sum(counts[first:]) / total
            mean = blocks * share
            width = min(pass_width(per_pass, min_rows, round(mean)), self.positions - first)
            room = math.ceil(mean + MARGIN_SPREADS * math.sqrt(mean * (1 - share))) + 1
            passes.append((min(blocks, max(1, room, min_rows // width)), width))
            first += width
        return passes


def pass_width(per_pass: int, min_rows: int, blocks: int) -> int:
    """Positions per head pass over `blocks` blocks: per_pass, widened to about min_rows rows for few."""
    return max(per_pass, min_rows // max(1, blocks))
