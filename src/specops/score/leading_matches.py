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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

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

# hidden_at(blocks, first, last) -> the draft states [len(blocks), last - first, hidden] of those blocks
# at draft positions first..last-1.
DraftStates = Callable[[torch.Tensor, int, int], torch.Tensor]


def _states_of(hidden: torch.Tensor) -> DraftStates:
    return lambda rows, first, last: hidden[:, first:last].index_select(0, rows)


def leading_matches(
    head: TargetHead,
    hidden: torch.Tensor | DraftStates,
    targets: torch.Tensor,
    multiplier: float = 1.0,
    softcap: float | None = None,
    positions_per_pass: int | None = None,
    timer: StepTimer | NoTimer | None = None,
) -> torch.Tensor:
    """Leading matches [N] of the drafts of hidden [N, J, H] against targets [N, J] (0..J).

    hidden: the draft states, or a function that computes those of some blocks at some positions
    (`DraftStates`), called once per pass with the blocks still matching. A block leaves the passes
    at its first mismatch; the passes stop when no block is left (one host sync per pass, a few per
    step). positions_per_pass: default DEFAULT_POSITIONS_PER_PASS, read at call time, widened for few
    blocks (MIN_ROWS_PER_PASS); J computes the head over every position at once. timer: the head's
    time goes under "head".
    """
    blocks, positions = targets.shape
    per_pass = positions_per_pass or DEFAULT_POSITIONS_PER_PASS
    timer = timer or NoTimer()
    hidden_at = hidden if callable(hidden) else _states_of(hidden)
    runs = torch.zeros(blocks, dtype=torch.long, device=targets.device)
    alive = torch.arange(blocks, device=targets.device)
    min_rows = MIN_ROWS_PER_PASS.get(targets.device.type, 0)
    first = 0
    while first < positions:
        width = max(per_pass, min_rows // max(1, alive.numel()))
        last = min(first + width, positions)
        states = hidden_at(alive, first, last)
        with timer.span("head"):
            drafts = head.argmax(states, multiplier, softcap)
        # A bool's cumprod counts in int64 itself: no conversion kernel. (Fewer host calls after each
        # read-back measured no gain in the engine: benchmarks/score_pass_host.py.)
        matched = (drafts == targets[:, first:last].index_select(0, alive)).cumprod(dim=-1)
        runs.index_add_(0, alive, matched.sum(dim=-1))
        if last == positions:
            break
        alive = alive.index_select(0, matched[:, -1].nonzero().squeeze(1))
        if alive.numel() == 0:
            break
        first = last
    return runs
