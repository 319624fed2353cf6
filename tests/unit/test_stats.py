"""Intervals and paired comparisons of tau, against cases with a known answer and against scipy."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from specops import stats

# scipy lives in the test tools' environment, not the ML one: transformers imports it into every
# process that loads a model when it is installed (requirements/ml-dev.txt).
REPO = Path(__file__).resolve().parents[2]
TEST_TOOLS_PYTHON = Path(os.environ.get("SPECOPS_TEST_TOOLS_PYTHON", REPO / ".venv" / "bin" / "python"))
SCIPY_BOOTSTRAP = """
import json, sys
import numpy as np
from scipy import stats
job = json.load(sys.stdin)
statistic = eval(job.pop("statistic"))
data = tuple(np.asarray(sample) for sample in job.pop("samples"))
seed = job.pop("seed")
interval = stats.bootstrap(data, statistic, rng=np.random.default_rng(seed), **job).confidence_interval
print(json.dumps([interval.low, interval.high]))
"""


def scipy_bootstrap(samples, statistic: str, seed: int, **options) -> tuple[float, float]:
    """scipy.stats.bootstrap's interval, computed by the test tools' Python (make venv builds it)."""
    assert TEST_TOOLS_PYTHON.exists(), f"{TEST_TOOLS_PYTHON} is missing: `make venv` builds it"
    job = {"samples": [list(map(float, s)) for s in samples], "statistic": statistic, "seed": seed, **options}
    done = subprocess.run(
        [str(TEST_TOOLS_PYTHON), "-c", SCIPY_BOOTSTRAP],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=True,
    )
    low, high = json.loads(done.stdout)
    return low, high


def prompts(n: int, seed: int = 1, shift: float = 0.0, noise: float = 0.3) -> tuple[np.ndarray, ...]:
    """n completions scored by two drafters: per-prompt difficulty shared, drafter b's tau higher by
    `shift` on average and off by `noise` on each prompt. Returns tokens, steps_a, steps_b."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(60, 400, size=n).astype(float)
    difficulty = rng.uniform(2.0, 5.0, size=n)
    tau_b = np.clip(difficulty + shift + rng.normal(0, noise, size=n), 1.05, None)
    # Whole verify steps, as a walk would count them.
    steps_a = np.maximum(1, np.round(tokens / difficulty))
    steps_b = np.maximum(1, np.round(tokens / tau_b))
    return tokens, steps_a, steps_b


def test_tau_is_the_ratio_of_sums_not_the_mean_of_ratios():
    assert stats.pooled_tau([4, 1], [1, 1]) == 2.5
    assert stats.pooled_tau([8, 2], [4, 1]) == 2.0  # per prompt 2 and 2; (8 + 2) / 5
    assert stats.pooled_tau([0], [0]) is None


def test_interval_holds_the_pooled_tau_and_is_reproducible():
    tokens, steps, _ = prompts(80)
    interval = stats.tau_interval(tokens, steps)
    assert interval is not None and interval[0] < stats.pooled_tau(tokens, steps) < interval[1]
    assert stats.tau_interval(tokens, steps) == interval
    assert stats.tau_interval(tokens, steps, seed=1) != interval


def test_prompts_that_all_have_one_tau_give_a_zero_width_interval():
    assert stats.tau_interval([30, 60, 90, 3, 6], [10, 20, 30, 1, 2]) == pytest.approx([3.0, 3.0])


def test_too_few_prompts_give_no_interval_and_no_verdict():
    few = stats.MIN_PROMPTS - 1
    assert stats.tau_interval([30] * few, [10] * few) is None
    comparison = stats.paired_comparison([30] * few, [10] * few, [30] * few, [5] * few)
    assert comparison["interval"] is None and comparison["verdict"] == stats.UNRESOLVED
    assert comparison["wins"] == {"first": 0, "second": few, "ties": 0}


def test_prompts_without_a_verify_step_are_left_out():
    assert stats.tau_interval([30, 0, 60, 3, 6, 9], [10, 0, 20, 1, 2, 3]) == pytest.approx([3.0, 3.0])
    assert stats.paired_comparison([30, 0], [10, 0], [30, 0], [5, 0])["n_prompts"] == 1


def test_the_interval_agrees_with_scipys_bootstrap_over_prompts():
    tokens, steps, _ = prompts(60, seed=7)
    ours = stats.tau_interval(tokens, steps, resamples=20000)
    low, high = scipy_bootstrap(
        (tokens, steps),
        "lambda t, s, axis: t.sum(axis=axis) / s.sum(axis=axis)",
        seed=123,
        paired=True,
        vectorized=True,
        n_resamples=20000,
        confidence_level=stats.CONFIDENCE,
        method="percentile",
    )
    # Two independent Monte Carlo runs of one bootstrap: equal within a few percent of the width.
    assert ours == pytest.approx([low, high], abs=0.03 * (high - low))


def test_the_paired_difference_agrees_with_scipys_bootstrap():
    tokens, steps_a, steps_b = prompts(60, seed=8, shift=0.2)
    ours = stats.paired_comparison(tokens, steps_a, tokens, steps_b, resamples=20000)["interval"]
    low, high = scipy_bootstrap(
        (tokens, steps_a, steps_b),
        "lambda t, sa, sb, axis: t.sum(axis=axis) / sa.sum(axis=axis) - t.sum(axis=axis) / sb.sum(axis=axis)",
        seed=321,
        paired=True,
        vectorized=True,
        n_resamples=20000,
        method="percentile",
    )
    assert ours == pytest.approx([low, high], abs=0.03 * (high - low))


def test_identical_drafters_show_no_difference():
    tokens, steps, _ = prompts(200)
    comparison = stats.paired_comparison(tokens, steps, tokens, steps)
    assert comparison["difference"] == 0.0 and comparison["interval"] == [0.0, 0.0]
    assert comparison["verdict"] == stats.UNRESOLVED
    assert comparison["wins"] == {"first": 0, "second": 0, "ties": 200}
    assert comparison["prompts_needed"]["observed"] is None


def test_a_planted_shift_well_above_the_noise_is_found_with_its_size():
    tokens, steps_a, steps_b = prompts(400, shift=0.5, noise=0.2)
    comparison = stats.paired_comparison(tokens, steps_b, tokens, steps_a)
    assert comparison["verdict"] == stats.BETTER
    low, high = comparison["interval"]
    assert low < 0.5 < high and high - low < 0.2
    assert comparison["wins"]["first"] > 0.9 * 400
    assert stats.paired_comparison(tokens, steps_a, tokens, steps_b)["verdict"] == stats.WORSE


def test_pairing_resolves_a_shift_that_separate_intervals_cannot():
    tokens, steps_a, steps_b = prompts(100, shift=0.15, noise=0.1)
    a, b = stats.tau_interval(tokens, steps_a), stats.tau_interval(tokens, steps_b)
    assert a is not None and b is not None and a[1] > b[0]  # the taus' intervals overlap
    assert stats.paired_comparison(tokens, steps_b, tokens, steps_a)["verdict"] == stats.BETTER


def test_a_shift_is_resolved_about_as_often_as_planned_at_the_prompts_said_to_be_needed():
    # The planted per-prompt shift moves the pooled tau by less (it weights prompts by their
    # steps): a large sample gives the true pooled difference and per-prompt spread.
    population = stats.paired_comparison(*interleave(prompts(20000, seed=99, shift=0.1)), resamples=10)
    needed = stats.prompts_needed(population["spread"], population["difference"])
    assert needed is not None and 50 < needed < 1000
    resolved = [
        stats.paired_comparison(*interleave(prompts(needed, seed=s, shift=0.1)), resamples=1000)["verdict"]
        for s in range(120)
    ]
    # Planned power 80%; 120 trials put the observed share within about +-0.1 of it.
    assert 0.68 <= resolved.count(stats.BETTER) / len(resolved) <= 0.92


def interleave(data: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """(tokens, steps_a, steps_b) as paired_comparison's (tokens_b, steps_b, tokens_a, steps_a)."""
    tokens, steps_a, steps_b = data
    return tokens, steps_b, tokens, steps_a


def test_a_smaller_difference_needs_more_prompts():
    # ((1.96 + 0.84) * spread / difference) ** 2, rounded up: 784.9 and 196.2.
    assert (stats.prompts_needed(1.0, 0.1), stats.prompts_needed(1.0, 0.2)) == (785, 197)
    assert stats.prompts_needed(0.0, 0.1) is None and stats.prompts_needed(1.0, 0.0) is None


def test_wins_compare_per_prompt_taus_exactly():
    comparison = stats.paired_comparison([10, 10, 9], [5, 4, 3], [10, 10, 9], [5, 5, 4])
    assert comparison["wins"] == {"first": 2, "second": 0, "ties": 1}
    assert comparison["win_shares"] == {"first": 2 / 3, "second": 0.0, "ties": 1 / 3}


def test_a_change_between_runs_is_flagged_only_outside_the_noise():
    assert stats.run_change(3.0, [2.8, 3.2], 3.1, [2.9, 3.3]) is None
    assert stats.run_change(3.0, [2.9, 3.1], 3.5, [3.4, 3.6]) == stats.UP
    assert stats.run_change(3.5, [3.4, 3.6], 3.0, [2.9, 3.1]) == stats.DOWN
    assert stats.run_change(3.0, None, 3.5, [3.4, 3.6]) is None
