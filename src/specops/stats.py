"""How sure a tau is: intervals, paired comparisons of drafters, and the prompts a comparison needs.

tau is a ratio of sums, total accepted tokens / total verify steps, pooled over prompts. The verify
steps of one prompt share its completion and its context, so they are not independent draws; the
prompts are. Every interval here therefore resamples prompts, each with its (tokens, steps), and
recomputes the ratio of sums on the resample: a bootstrap over prompts with percentile intervals,
from a fixed seed so that the same figures give the same interval on every run.

Two drafters scored on the same completions are compared on the same resampled prompts (paired):
the prompts' difficulty then cancels out of their difference, which makes the comparison far more
sensitive than two separate intervals would be.

numpy only; plain floats, lists and dicts out, ready for report.json. numpy is imported when a
figure is computed: the control node imports specops.score, and so this module, for the stage's
request schema alone, without numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 4000
SEED = 0
# Fewer prompts than this give no interval (and so no verdict): a bootstrap cannot see the spread
# of so few (two prompts resample to three distinct values), and its intervals come out too narrow.
MIN_PROMPTS = 5
# The normal quantiles the sample-size rule needs (numpy has no inverse normal): a two-sided 95%
# interval, and 80% power, the usual chance of resolving a difference that is really there.
Z_CONFIDENCE = 1.959963984540054
Z_POWER = 0.8416212335729143
# The difference in tau the report always states a sample size for, beside the observed one.
DETECTABLE_DIFFERENCE = 0.1
# The bootstrap draws its resamples in blocks of about this many prompt indices, to bound memory.
BLOCK_ELEMENTS = 2_000_000

BETTER, WORSE, UNRESOLVED = "better", "worse", "no difference shown at this size"
UP, DOWN = "up", "down"

Counts: TypeAlias = "Sequence[float] | np.ndarray"


def _numpy():
    """numpy, imported on first use (the module's docstring says why)."""
    import numpy

    return numpy


def pooled_tau(tokens: Counts, steps: Counts) -> float | None:
    """Total accepted tokens / total verify steps; None without a step."""
    np = _numpy()
    total_steps = float(np.sum(steps))
    return float(np.sum(tokens)) / total_steps if total_steps else None


def _columns(*counts: Counts) -> list[np.ndarray]:
    """The prompts' counts as float arrays, prompts with no verify step left out (they hold no
    step of any tau and would only make a resample's ratio undefined)."""
    np = _numpy()
    arrays = [np.asarray(c, dtype=float) for c in counts]
    if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1:
        raise ValueError(f"per-prompt counts must be 1-d and of one length, got {[a.shape for a in arrays]}")
    stepped = np.all([a > 0 for a in arrays[1::2]], axis=0)
    return [a[stepped] for a in arrays]


def resampled_sums(columns: Sequence[np.ndarray], resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """[resamples, len(columns)]: each column summed over the same prompts drawn with replacement.

    All columns share each resample, which is what pairs two drafters on the same prompts.
    """
    np = _numpy()
    data = np.stack(columns, axis=1)  # [prompts, columns]
    n = len(data)
    rng = np.random.default_rng(seed)
    rows = max(1, BLOCK_ELEMENTS // max(n, 1))
    sums = []
    for start in range(0, resamples, rows):
        indices = rng.integers(0, n, size=(min(rows, resamples - start), n))
        sums.append(data[indices].sum(axis=1))
    return np.concatenate(sums)


def _percentiles(replicates: np.ndarray) -> list[float]:
    np = _numpy()
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(replicates, [tail, 1 - tail])
    return [float(low), float(high)]


def tau_interval(tokens: Counts, steps: Counts, resamples: int = RESAMPLES, seed: int = SEED) -> list | None:
    """The 95% interval of the pooled tau, prompts resampled; None below MIN_PROMPTS prompts."""
    tokens_, steps_ = _columns(tokens, steps)
    if len(tokens_) < MIN_PROMPTS:
        return None
    sums = resampled_sums([tokens_, steps_], resamples, seed)
    return _percentiles(sums[:, 0] / sums[:, 1])


def influence(tokens: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Each prompt's first-order share of the pooled tau's error (the delta method for a ratio of
    sums): the variance of the pooled tau is about var(influence) / prompts."""
    ratio = tokens.sum() / steps.sum()
    return (tokens - ratio * steps) / steps.mean()


def prompts_needed(spread: float, difference: float) -> int | None:
    """Prompts a paired comparison needs for its 95% interval to exclude zero, 80% of the times a
    difference of this size is really there; spread is the standard deviation of the per-prompt
    influence of the difference. None when there is nothing to resolve (no difference, or none
    of the prompts differ)."""
    if not difference or not spread:
        return None
    return max(MIN_PROMPTS, math.ceil(((Z_CONFIDENCE + Z_POWER) * spread / abs(difference)) ** 2))


def _wins(tokens_a: np.ndarray, steps_a: np.ndarray, tokens_b: np.ndarray, steps_b: np.ndarray) -> dict:
    """How many prompts each drafter has the higher tau on, compared without division (exact ties)."""
    np = _numpy()
    a_times, b_times = tokens_a * steps_b, tokens_b * steps_a
    return {
        "first": int(np.sum(a_times > b_times)),
        "second": int(np.sum(a_times < b_times)),
        "ties": int(np.sum(a_times == b_times)),
    }


def paired_comparison(
    tokens_a: Counts,
    steps_a: Counts,
    tokens_b: Counts,
    steps_b: Counts,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    detectable: float = DETECTABLE_DIFFERENCE,
) -> dict[str, Any]:
    """Drafter a against drafter b on the same prompts (the arrays aligned prompt by prompt).

    difference = tau_a - tau_b with its 95% interval, ratio = tau_a / tau_b with its interval,
    both from the same resamples; verdict: a is "better" or "worse" when the difference's interval
    excludes zero, else "no difference shown at this size". wins counts the prompts where each has
    the higher tau (win_shares: the same as shares of the prompts). prompts_needed: how many
    prompts would resolve the observed difference and a difference of `detectable` tau, from the
    observed per-prompt spread.
    """
    np = _numpy()
    ta, sa, tb, sb = _columns(tokens_a, steps_a, tokens_b, steps_b)
    n = len(ta)
    tau_a, tau_b = pooled_tau(ta, sa), pooled_tau(tb, sb)
    difference = tau_a - tau_b if tau_a is not None and tau_b is not None else None
    interval, ratio_interval = None, None
    spread = 0.0
    if n >= MIN_PROMPTS:
        sums = resampled_sums([ta, sa, tb, sb], resamples, seed)
        taus_a, taus_b = sums[:, 0] / sums[:, 1], sums[:, 2] / sums[:, 3]
        interval, ratio_interval = _percentiles(taus_a - taus_b), _percentiles(taus_a / taus_b)
        spread = float(np.std(influence(ta, sa) - influence(tb, sb), ddof=1))
    wins = _wins(ta, sa, tb, sb)
    verdict = UNRESOLVED
    if interval and interval[0] > 0:
        verdict = BETTER
    elif interval and interval[1] < 0:
        verdict = WORSE
    return {
        "n_prompts": n,
        "tau": [tau_a, tau_b],
        "difference": difference,
        "interval": interval,
        "ratio": tau_a / tau_b if tau_a is not None and tau_b else None,
        "ratio_interval": ratio_interval,
        "wins": wins,
        "win_shares": {side: count / n if n else None for side, count in wins.items()},
        "verdict": verdict,
        "spread": spread,
        "prompts_needed": {
            "observed": prompts_needed(spread, difference or 0.0),
            "detectable": detectable,
            "for_detectable": prompts_needed(spread, detectable),
        },
    }


def standard_error(interval: Sequence[float]) -> float:
    """The standard error a 95% interval implies (its half-width over the normal quantile)."""
    return (interval[1] - interval[0]) / (2 * Z_CONFIDENCE)


def run_change(
    before: float | None,
    before_interval: Sequence[float] | None,
    after: float | None,
    after_interval: Sequence[float] | None,
) -> str | None:
    """ "up" or "down" when tau moved between two runs by more than their noise, else None.

    The runs are taken as independent (their intervals combined in quadrature). Runs on the same
    prompts are positively correlated, so this overstates the noise of their difference: a change
    it flags is real, and a small real change may go unflagged.
    """
    if None in (before, after) or not before_interval or not after_interval:
        return None
    assert before is not None and after is not None
    noise = math.hypot(standard_error(before_interval), standard_error(after_interval))
    if abs(after - before) <= Z_CONFIDENCE * noise:
        return None
    return UP if after > before else DOWN
