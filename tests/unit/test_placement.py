"""Where scoring runs, decided before the window from the plan: the window where the downtime budget
holds the extraction and the scoring, else the bounded CPU, said with the reason and the estimate."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specops import placement
from specops.stage import StageError

MODELS = Path(os.environ.get("SPECOPS_TEST_MODELS", ".work/test-models"))


def test_auto_scores_in_the_window_when_extraction_and_scoring_fit_the_budget():
    where, why = placement.choose("auto", window_seconds=30, extraction_seconds=60, budget_seconds=600)
    assert where == "window"
    assert why == (
        "auto: the window with scoring fits the downtime budget of 600 s "
        "(extraction 60 s + scoring 30 s = 90 s)"
    )


def test_auto_falls_back_to_the_bounded_cpu_when_the_budget_is_too_small_and_says_why():
    where, why = placement.choose("auto", window_seconds=300, extraction_seconds=400, budget_seconds=600)
    assert where == "cpu"
    assert "would not fit the downtime budget of 600 s (extraction 400 s + scoring 300 s = 700 s)" in why


def test_a_forced_window_that_does_not_fit_is_refused_before_the_service_is_touched():
    with pytest.raises(StageError, match="scoring in the window does not fit the downtime budget of 600 s"):
        placement.choose("window", window_seconds=300, extraction_seconds=400, budget_seconds=600)


def test_without_a_window_it_scores_on_the_cpu_whatever_was_asked():
    where, why = placement.choose("window", 1, 1, 0, window_taken=False)
    assert where == "cpu" and "no window is taken" in why


def test_auto_scores_on_the_named_scoring_host_when_the_window_would_not_fit():
    where, why = placement.choose("auto", 300, 400, 600, scoring_host="scorer-1")
    assert where == "host"
    assert why.endswith("(extraction 400 s + scoring 300 s = 700 s), so it scores on scorer-1")


def test_without_a_scoring_host_auto_says_none_is_named_when_it_falls_back_to_the_cpu():
    where, why = placement.choose("auto", 300, 400, 600)
    assert where == "cpu" and "no scoring host is named (specops_scoring_host)" in why


def test_a_forced_scoring_host_that_is_not_named_is_refused_before_the_service_is_touched():
    with pytest.raises(StageError, match="specops_score_placement is host but no scoring host is named"):
        placement.choose("host", 1, 1, 600)


def test_a_forced_scoring_host_is_kept_even_when_the_window_would_fit_or_is_not_taken():
    assert placement.choose("host", 1, 1, 600, scoring_host="s") == (
        "host",
        "forced: specops_score_placement is host (s)",
    )
    assert placement.choose("auto", 1, 1, 600, window_taken=False, scoring_host="s")[0] == "host"


def test_the_forced_cpu_placement_is_kept_even_when_the_window_would_fit():
    assert placement.choose("cpu", 1, 1, 600) == ("cpu", "forced: specops_score_placement is cpu")


@pytest.mark.skipif(not (MODELS / "target").is_dir(), reason="needs the test models")
def test_the_plan_estimates_from_the_shapes_and_puts_the_layer_offsets_after_the_window(tmp_path):
    completions = tmp_path / "completions"
    completions.mkdir()
    rows = [{"id": "a", "output_ids": list(range(40))}, {"id": "b", "output_ids": list(range(24))}]
    (completions / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    request = {
        "placement": "auto",
        "device": "cpu",
        "target": str(MODELS / "target"),
        "drafters": [str(MODELS / "drafter")],
        "reference_drafter": str(MODELS / "reference_drafter"),
        "completions": str(completions),
        "diagnostics": ["acceptance", "layer_offset"],
        "extraction_seconds": 5,
        "budget_seconds": 3600,
    }
    planned = placement.plan(request)
    estimate = planned["estimate"]
    head = placement.head_parameters(MODELS / "target")
    drafter = placement.safetensors_parameters(MODELS / "drafter")
    reference = placement.safetensors_parameters(MODELS / "reference_drafter")
    assert estimate["tokens"] == 64 and drafter > 0 and reference > 0
    assert estimate["passes"] == {"scores": 2, "layer_offset": 2}
    assert estimate["score_flops"] == 2 * 64 * (drafter + head) + 2 * 64 * (reference + head)
    assert estimate["layer_offset_flops"] == 2 * 2 * 64 * (drafter + head)
    assert planned["placement"] == "window" and planned["device"] == "cpu"
    # The window holds the drafter's and the reference's passes; the CPU after it the layer offsets.
    # Each scoring process also starts and reads the head and the drafters, whatever the completions.
    weights = placement.safetensors_bytes(MODELS / "drafter") + placement.safetensors_bytes(
        MODELS / "reference_drafter"
    )
    assert estimate["load_bytes"] == 4 * head + weights
    load = placement.STARTUP_SECONDS + placement.LOAD_SECONDS_PER_GIB * estimate["load_bytes"] / 2**30
    assert estimate["load_seconds"] == round(load, 1) and load >= placement.STARTUP_SECONDS
    rate = estimate["window_throughput"]
    assert planned["window_seconds"] == round(load + estimate["score_flops"] / rate, 1)
    assert planned["cpu_seconds"] == round(
        load + estimate["layer_offset_flops"] / estimate["cpu_throughput"], 1
    )

    # A budget smaller than the extraction alone: the bounded CPU takes every pass.
    fallback = placement.plan({**request, "budget_seconds": 4})
    assert fallback["placement"] == "cpu" and fallback["window_seconds"] == 0.0
    assert "would not fit the downtime budget of 4 s" in fallback["why"]

    # With a scoring host named, the same budget sends every pass there, on its device.
    shipped = placement.plan(
        {**request, "budget_seconds": 4, "scoring_host": "scorer", "scoring_device": "cuda"}
    )
    assert shipped["placement"] == "host" and shipped["host"] == "scorer" and shipped["device"] == "cuda"
    assert shipped["cpu_seconds"] == 0.0 and shipped["window_seconds"] == 0.0
    assert shipped["host_seconds"] == round(
        load + (estimate["score_flops"] + estimate["layer_offset_flops"]) / placement.GPU_FLOPS, 1
    )
