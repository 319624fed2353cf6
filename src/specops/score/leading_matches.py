"""How many leading drafts of each block equal the target's tokens, computing the head only where needed.

The walk needs, per block, the number of leading draft positions whose greedy token equals the
target's. Positions after the first mismatch never matter, yet the target's lm_head over them is the
largest single matrix product of a step (vocabulary x hidden per position). So the head runs over a
few positions at a time, and only for the blocks whose drafts have matched so far: with acceptance
around 6 of 15 positions, about half of the head's work is skipped. Every position that is computed
gets the same argmax as before (`TargetHead.argmax` row by row), so the counts do not change.

The drafter's own last steps (its last layer's o_proj and MLP, the final norm) also act on each
position alone, so the draft states can be handed over as a function that computes them for just the
blocks and positions a pass needs (`DFlashDrafter.trunk` / `finish`).

Two ways to choose a pass's blocks, same counts:
- waited (off `pass_schedule.SCHEDULED_DEVICES`): after each pass the host reads which blocks still
  match and gives the next pass exactly those. One host synchronization per pass: on a GPU the device
  then idles while the host launches the next pass's first kernels.
- scheduled (`plan`, on SCHEDULED_DEVICES): the host fixes each pass's size and width in advance from
  how many blocks matched that far in the step before (`pass_schedule.PassSchedule`); the device picks
  the still-matching blocks itself, each at its own next position, so nothing is waited for until the
  plan ends. Blocks the plan had no room for stay matching and are taken by a later pass; those left
  at the end go through waited passes (`ScheduledMatches.settle`). Room beyond the matching blocks
  computes rows that count for nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specops.score.pass_schedule import pass_width
from specops.score.step_timer import NoTimer, StepTimer
from specops.score.target_head import TargetHead

# Positions per head pass: small enough to stop soon after a block's first mismatch, large enough that
# each pass's matrix product has many rows.
DEFAULT_POSITIONS_PER_PASS = 3
# Per device type, a pass over fewer blocks widens to about this many rows: below it a GPU's head product is
# bound by reading the head's weights (2.5 GB at the real vocabulary, ~0.8 ms on an H100), not by its
# arithmetic, so the extra positions cost almost nothing and may save a later pass. A CPU's arithmetic is
# slower than its reads down to a few rows: its passes keep their width.
MIN_ROWS_PER_PASS: dict[str, int] = {"cuda": 256}

# hidden_at(blocks [n], positions [n, w]) -> the draft states [n, w, hidden] of those blocks at those
# draft positions (each block's row of positions).
DraftStates = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _states_of(hidden: torch.Tensor) -> DraftStates:
    return lambda rows, positions: hidden[rows[:, None], positions]


class _Passes:
    """The state the passes share: per block its leading matches so far, its next position, and whether it
    is still matching (every position so far matched and positions are left)."""

    def __init__(
        self,
        head: TargetHead,
        hidden_at: DraftStates,
        targets: torch.Tensor,
        multiplier: float,
        softcap: float | None,
        timer: StepTimer | NoTimer,
    ):
        self.head, self.hidden_at, self.targets = head, hidden_at, targets
        self.multiplier, self.softcap, self.timer = multiplier, softcap, timer
        blocks, self.positions = targets.shape
        device = targets.device
        self.runs = torch.zeros(blocks, dtype=torch.long, device=device)
        self.next = torch.zeros(blocks, dtype=torch.long, device=device)
        self.matching = torch.ones(blocks, dtype=torch.bool, device=device)

    def run(self, blocks: torch.Tensor, width: int, chosen: torch.Tensor | None = None) -> torch.Tensor:
        """One pass over blocks [n] at `width` positions from each one's next; chosen [n]: which of them
        are still matching (None: all). Returns the matching mask after the pass."""
        positions = self.next[blocks, None] + torch.arange(width, device=blocks.device)
        inside = positions < self.positions
        positions = positions.clamp_max(self.positions - 1)
        states = self.hidden_at(blocks, positions)
        with self.timer.span("head"):
            drafts = self.head.argmax(states, self.multiplier, self.softcap)
        hit = (drafts == self.targets[blocks[:, None], positions]) & inside
        if chosen is not None:
            hit &= chosen[:, None]
        matched = hit.long().cumprod(dim=-1)
        self.runs.index_add_(0, blocks, matched.sum(dim=-1))
        self.next[blocks] += width
        still = matched[:, -1].bool() & (self.next[blocks] < self.positions)
        self.matching[blocks] = still
        return still


def pass_rule(device: torch.device, positions_per_pass: int | None = None) -> tuple[int, int]:
    """(positions per pass, rows a pass widens to) on this device, read at call time."""
    return positions_per_pass or DEFAULT_POSITIONS_PER_PASS, MIN_ROWS_PER_PASS.get(device.type, 0)


def leading_matches(
    head: TargetHead,
    hidden: torch.Tensor | DraftStates,
    targets: torch.Tensor,
    multiplier: float = 1.0,
    softcap: float | None = None,
    positions_per_pass: int | None = None,
    timer: StepTimer | NoTimer | None = None,
    plan: Sequence[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """Leading matches [N] of the drafts of hidden [N, J, H] against targets [N, J] (0..J).

    hidden: the draft states, or a function that computes those of some blocks at some positions
    (`DraftStates`). A block leaves the passes at its first mismatch. positions_per_pass: default
    DEFAULT_POSITIONS_PER_PASS, read at call time, widened for few blocks (MIN_ROWS_PER_PASS); J computes
    the head over every position at once. timer: the head's time goes under "head". plan: the scheduled
    passes as (blocks to take, positions) (`PassSchedule.plan`; see the module docstring); None waits
    after each pass.
    """
    if plan is not None:
        return planned_matches(
            head, hidden, targets, plan, multiplier, softcap, positions_per_pass, timer
        ).settle()
    blocks, positions = targets.shape
    per_pass, min_rows = pass_rule(targets.device, positions_per_pass)
    hidden_at = hidden if callable(hidden) else _states_of(hidden)
    passes = _Passes(head, hidden_at, targets, multiplier, softcap, timer or NoTimer())
    alive, first = torch.arange(blocks, device=targets.device), 0
    while alive.numel():
        width = min(pass_width(per_pass, min_rows, alive.numel()), positions - first)
        still = passes.run(alive, width)
        first += width
        alive = alive[still]
    return passes.runs


class ScheduledMatches:
    """The counts after a plan's passes, before the blocks it had no room for are settled. `left`: a
    device flag, read with the caller's own synchronization; `settle()` runs waited passes for those
    blocks (reading which they are is a synchronization) and returns the counts; `settle(False)` returns
    them as they are, where the caller read that none is left."""

    def __init__(self, passes: _Passes, per_pass: int, min_rows: int):
        self.passes, self.per_pass, self.min_rows = passes, per_pass, min_rows
        self.runs = passes.runs
        self.left = passes.matching.any()

    def settle(self, left: bool = True) -> torch.Tensor:
        passes = self.passes
        alive = passes.matching.nonzero().squeeze(1) if left else passes.matching[:0]
        while alive.numel():
            first = int(passes.next[alive].min())
            width = min(pass_width(self.per_pass, self.min_rows, alive.numel()), passes.positions - first)
            alive = alive[passes.run(alive, width)]
        return passes.runs


def planned_matches(
    head: TargetHead,
    hidden: torch.Tensor | DraftStates,
    targets: torch.Tensor,
    plan: Sequence[tuple[int, int]],
    multiplier: float = 1.0,
    softcap: float | None = None,
    positions_per_pass: int | None = None,
    timer: StepTimer | NoTimer | None = None,
) -> ScheduledMatches:
    """`leading_matches` with a plan, its passes queued without a host synchronization and the blocks it
    had no room for not yet settled."""
    blocks = targets.shape[0]
    per_pass, min_rows = pass_rule(targets.device, positions_per_pass)
    hidden_at = hidden if callable(hidden) else _states_of(hidden)
    passes = _Passes(head, hidden_at, targets, multiplier, softcap, timer or NoTimer())
    every = torch.arange(blocks, device=targets.device)
    for n, width in plan:
        if n >= blocks:
            passes.run(every, width, passes.matching)
        else:
            # The still-matching blocks first, in order (a stable sort: no host synchronization).
            chosen = torch.argsort((~passes.matching).to(torch.int8), stable=True)[:n]
            passes.run(chosen, width, passes.matching[chosen])
    return ScheduledMatches(passes, per_pass, min_rows)
