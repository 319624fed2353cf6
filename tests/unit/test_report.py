"""The score report: figures from acceptance lengths, report.json's fields, Markdown and plots."""

from __future__ import annotations

import json
import re

import pytest

from specops import plots
from specops import report as rep

BLOCK = 4


def scores(sequences: dict[str, list[int]], block_size: int = BLOCK) -> dict:
    return {
        "block_size": block_size,
        "sequences": [{"id": key, "accept_lengths": lengths} for key, lengths in sequences.items()],
    }


def diagnostic(name: str, status: str, message: str = "finding") -> dict:
    return {"name": name, "status": status, "message": message, "details": {}}


RUN = {
    "target": "/m/target",
    "drafter": "/m/drafter",
    "reference_drafter": "/m/ref",
    "hidden_states": "/r/hidden_states",
    "hidden_state_backend": {"gated_delta_rule": "fla"},
    "device": "cpu",
    "dtype": "float32",
    "versions": {"torch": "2.13.0"},
}


@pytest.fixture
def report() -> dict:
    drafter = scores({"a": [1, 2, 1], "b": [4, 1]})
    reference = scores({"a": [4, 4, 4], "b": [3, 4]})
    online = {"a": {"tau": 3.9, "verify_ct": 10, "completion_tokens": 39}}
    return rep.build_report(
        RUN,
        drafter,
        reference,
        online,
        [
            diagnostic("layer_offset", "warning", "shift +1 scores higher"),
            diagnostic("backend", "ok"),
            diagnostic("vocabulary", "skipped"),
        ],
    )


def test_tau_pools_every_verify_step_like_sglangs_accept_length():
    summary = rep.summarize(scores({"a": [1, 1, 1, 1], "b": [4]})["sequences"], BLOCK)
    assert summary["tau"] == pytest.approx(8 / 5)  # not the mean of per-prompt taus (2.5)
    assert (summary["steps"], summary["tokens"]) == (5, 8)


def test_histogram_counts_steps_per_acceptance_length():
    assert rep.histogram([1, 1, 3, 4], BLOCK) == {"length": [1, 2, 3, 4], "count": [2, 0, 1, 1]}


def test_histogram_rejects_a_length_beyond_the_block():
    with pytest.raises(ValueError, match="outside 1..4"):
        rep.histogram([5], BLOCK)


def test_acceptance_by_position_is_the_share_of_steps_accepting_each_draft_token():
    by_pos = rep.acceptance_by_position([1, 2, 4, 4], BLOCK)
    assert by_pos["position"] == [1, 2, 3]
    assert by_pos["rate"] == [0.75, 0.5, 0.5]
    assert by_pos["conditional"] == [0.75, pytest.approx(2 / 3), 1.0]


def test_report_json_has_the_documented_fields(report):
    assert report["schema_version"] == rep.SCHEMA_VERSION
    assert {
        "target",
        "drafter",
        "reference_drafter",
        "hidden_state_backend",
        "device",
        "dtype",
        "versions",
    } <= set(report["run"])
    assert {"tau", "steps", "tokens", "histogram", "acceptance_by_position"} <= set(report["overall"])
    assert {"tau", "steps", "tokens", "histogram", "acceptance_by_position"} <= set(report["reference"])
    for row in report["per_prompt"]:
        assert {"id", "tau", "steps", "reference_tau", "online_tau"} <= set(row)
    assert [d["status"] for d in report["diagnostics"]] == ["warning", "ok", "skipped"]
    json.dumps(report)  # plain data all the way down


def test_per_prompt_rows_pair_drafter_reference_and_online_tau_by_id(report):
    row_a, row_b = report["per_prompt"]
    assert (row_a["id"], row_a["tau"], row_a["reference_tau"], row_a["online_tau"]) == ("a", 4 / 3, 4.0, 3.9)
    assert row_b["online_tau"] is None
    assert row_b["ratio"] == pytest.approx(2.5 / 3.5)


def test_ratio_is_drafter_tau_over_reference_tau(report):
    assert report["ratio"] == pytest.approx((9 / 5) / (19 / 5))


def test_verdict_names_both_taus_and_the_ratio():
    report = rep.build_report(RUN, scores({"a": [3, 3, 3]}, 16), scores({"a": [12, 13, 12]}, 16))
    # One prompt: no interval, so no difference can be shown.
    assert rep.verdict(report) == (
        "drafter tau 3.00 vs reference 12.33 (0.24x): no difference shown at this size"
    )


def five_prompts(lengths: list[int], block_size: int = BLOCK) -> dict:
    """Five prompts, each walked with `lengths` and one more step of its own."""
    return scores({f"p{k}": [*lengths, 1 + k % block_size] for k in range(5)}, block_size)


def test_verdict_gives_each_tau_its_interval_and_the_paired_verdict():
    report = rep.build_report(RUN, five_prompts([1, 1, 1], 16), five_prompts([4, 4, 5], 16))
    assert re.fullmatch(
        r"drafter tau \d\.\d\d \[\d\.\d\d, \d\.\d\d\] vs reference \d\.\d\d \[\d\.\d\d, \d\.\d\d\] "
        r"\(0\.\d\dx\): worse",
        rep.verdict(report),
    )
    low, high = report["overall"]["interval"]
    assert low <= report["overall"]["tau"] <= high


def test_the_comparison_with_the_reference_is_paired_on_the_prompts_both_scored():
    drafter = five_prompts([4, 4])
    reference = {**five_prompts([4, 4]), "sequences": five_prompts([4, 4])["sequences"][:4]}
    paired = rep.build_report(RUN, drafter, reference)["vs_reference"]
    assert paired["n_prompts"] == 4 and paired["wins"] == {"first": 0, "second": 0, "ties": 4}
    assert paired["difference"] == 0.0


def test_verdict_without_reference_says_so():
    report = rep.build_report(RUN, scores({"a": [2, 2]}))
    assert rep.verdict(report) == "drafter tau 2.00 (no reference drafter given)"


def test_verdict_counts_the_warning_diagnostics(report):
    assert rep.verdict(report).endswith("; SGLang online tau 3.90; 1 diagnostic warn: layer_offset")


def test_warnings_list_only_warning_diagnostics(report):
    assert report["warnings"] == ["layer_offset: shift +1 scores higher"]


def test_unknown_diagnostic_status_is_refused():
    with pytest.raises(ValueError, match="not one of ok, warning, inconclusive, skipped"):
        rep.build_report(RUN, scores({"a": [1]}), diagnostics=[diagnostic("backend", "bad")])


def test_markdown_starts_with_the_verdict(report):
    markdown = rep.render_markdown(report)
    first_text = [line for line in markdown.splitlines() if line and not line.startswith("#")][0]
    assert first_text == f"**{rep.verdict(report)}**"


def test_markdown_embeds_every_plot_with_a_relative_link(report):
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", rep.render_markdown(report))
    assert links == list(rep.PLOT_FILES)


def test_markdown_states_each_diagnostic_finding(report):
    markdown = rep.render_markdown(report)
    assert "**layer_offset: WARNING**: shift +1 scores higher" in markdown
    assert "**vocabulary: skipped**" in markdown


def test_markdown_has_one_table_row_per_prompt(report):
    rows = [
        line
        for line in rep.render_markdown(report).splitlines()
        if line.startswith("| a |") or line.startswith("| b |")
    ]
    assert rows == ["| a | 3 | 1.33 | 4.00 | 0.33 | 3.90 |", "| b | 2 | 2.50 | 3.50 | 0.71 | n/a |"]


def test_plots_are_written_as_png_files(report, tmp_path):
    names = plots.render_plots(report, tmp_path)
    assert names == list(rep.PLOT_FILES)
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.tmp"))


def test_plots_are_written_without_reference_or_online_figures(tmp_path):
    report = rep.build_report(RUN, scores({"a": [1, 2], "b": [1]}))
    plots.render_plots(report, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(rep.PLOT_FILES)


def named(report: dict, name: str) -> dict:
    return {
        **report,
        "name": name,
        "plots": list(rep.PLOT_FILES),
        "speedup": {"expected": 1.5, "draft_cost": 0.2, "verify_cost": 1.0},
    }


@pytest.fixture
def summary(report) -> dict:
    model = {
        "formula": "expected speedup = tau / (draft_cost + verify_cost)",
        "assumptions": ["greedy"],
        "reference_expected": 3.0,
    }
    return rep.build_summary(RUN, [named(report, "step-1"), named(report, "step-2")], model)


def test_summary_keeps_the_first_drafters_figures_at_the_top_level(summary, report):
    assert summary["overall"] == report["overall"] and summary["per_prompt"] == report["per_prompt"]
    assert summary["vs_reference"] == report["vs_reference"]
    assert [d["name"] for d in summary["drafters"]] == ["step-1", "step-2"]


def test_comparison_has_one_row_per_drafter_with_position_one_and_speedup(summary):
    row = summary["comparison"][0]
    assert (row["name"], row["position_1"], row["expected_speedup"]) == ("step-1", 0.4, 1.5)
    assert row["warnings"] == ["layer_offset"]


def test_summary_verdict_names_the_best_of_several_drafters(summary):
    assert summary["verdict"].startswith("2 drafters; best step-1 tau 1.80 vs reference 3.80")


def test_summary_markdown_has_a_comparison_table_and_each_drafters_section(summary):
    markdown = rep.render_summary(
        summary, {"step-1": "drafters/step-1/", "step-2": "drafters/step-2/"}, [rep.PLOT_TAU_BY_DRAFTER]
    )
    # Two prompts: too few for an interval, so the reference cell gives no verdict either way.
    row = "| step-1 | 1.80 | 0.47x: no difference shown at this size | 0.400 | 1.50x | layer_offset |"
    assert row in markdown
    assert "## Drafter step-1" in markdown and "## Drafter step-2" in markdown
    assert "](drafters/step-2/tau_per_prompt.png)" in markdown
    assert "expected speedup = tau / (draft_cost + verify_cost)" in markdown


def test_an_optional_section_without_its_template_renders_nothing(summary):
    plain = rep.render_summary(summary, {"step-1": "", "step-2": ""})
    assert rep.render_summary({**summary, "window": {"seconds": 1}}, {"step-1": "", "step-2": ""}) == plain


def test_verdict_names_the_likely_cause_a_diagnosis_found():
    cause = {
        "name": "acceptance",
        "status": "warning",
        "message": "m",
        "details": {"cause": "position-1 acceptance 0.000"},
    }
    report = rep.build_report(RUN, scores({"a": [1, 1]}), scores({"a": [4, 4]}), diagnostics=[cause])
    assert rep.verdict(report).endswith("; likely cause: position-1 acceptance 0.000")


def test_comparison_and_trend_plots_are_png_files(summary, tmp_path):
    assert plots.render_comparison(summary, tmp_path) == rep.PLOT_TAU_BY_DRAFTER
    runs = [
        {"run_id": "1", "tau": {"step-1": 1.5}, "reference_tau": 3.8},
        {
            "run_id": "2",
            "tau": {"step-1": 1.8, "step-2": 1.7},
            "interval": {"step-1": [1.6, 2.0], "step-2": None},
            "reference_tau": 3.8,
            "reference_interval": [3.7, 3.9],
        },
    ]
    change = {"run_id": "2", "drafter": "step-1", "direction": "up", "before": 1.5, "after": 1.8}
    assert plots.render_trend(runs, ["step-1", "step-2"], tmp_path, [change]) == rep.PLOT_TAU_TREND
    for name in (rep.PLOT_TAU_BY_DRAFTER, rep.PLOT_TAU_TREND):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_a_reference_the_comparison_table_says_so():
    summary = rep.build_summary(RUN, [named(rep.build_report(RUN, five_prompts([2, 3])), "solo")])
    row = next(line for line in rep.render_summary(summary, {"solo": ""}).splitlines() if "| solo |" in line)
    assert "| no reference |" in row and "n/a" not in row


def test_the_summary_table_shows_each_tau_with_its_interval():
    summary = rep.build_summary(RUN, [named(rep.build_report(RUN, five_prompts([2, 3])), "solo")])
    low, high = summary["comparison"][0]["interval"]
    assert f"| solo | {summary['comparison'][0]['tau']:.2f} [{low:.2f}, {high:.2f}] |" in rep.render_summary(
        summary, {"solo": ""}
    )


def test_identical_drafters_are_paired_with_no_difference_shown():
    same = rep.build_report(RUN, five_prompts([2, 3]))
    summary = rep.build_summary(RUN, [named(same, "one"), named(same, "two")])
    (pair,) = summary["pairs"]
    assert pair["names"] == ["one", "two"] and pair["verdict"] == "no difference shown at this size"
    assert summary["verdict"].endswith("; vs two: no difference shown at this size")
    row = "| one | two | 5 | 0.00 [0.00, 0.00] | 0 (0%) / 0 (0%) / 5 (100%) | no difference shown"
    assert row in rep.render_summary(summary, {"one": "", "two": ""})


def test_a_comparison_too_small_to_decide_says_how_many_prompts_would():
    drafter = scores({f"p{k}": [2, 3] if k % 2 else [3, 2, 1] for k in range(6)})
    reference = scores({f"p{k}": [3, 3] if k % 3 else [2, 2, 2] for k in range(6)})
    report = rep.build_report(RUN, drafter, reference)
    paired = report["vs_reference"]
    assert paired["verdict"] == "no difference shown at this size"
    needed = paired["prompts_needed"]["observed"]
    assert needed > 6
    assert f"about {needed} prompts would resolve the observed difference" in rep.render_markdown(report)


def test_the_prompts_needed_are_stated_for_the_requested_difference():
    drafter = scores({f"p{k}": [2, 3] if k % 2 else [3, 2, 1] for k in range(6)})
    reference = scores({f"p{k}": [3, 3] if k % 3 else [2, 2, 2] for k in range(6)})
    needed = [
        rep.build_report(RUN, drafter, reference, detectable=size)["vs_reference"]["prompts_needed"]
        for size in (0.1, 0.2)
    ]
    assert [n["detectable"] for n in needed] == [0.1, 0.2]
    assert needed[0]["for_detectable"] > 3 * needed[1]["for_detectable"]
    assert "a difference of 0.20." in rep.render_markdown(
        rep.build_report(RUN, drafter, reference, detectable=0.2)
    )


def test_the_history_table_shows_intervals_and_names_changes_outside_the_noise(summary):
    runs = [
        {"run_id": "r1", "tau": {"step-1": 1.5}, "interval": {"step-1": [1.4, 1.6]}},
        {"run_id": "r2", "tau": {"step-1": 1.8}, "interval": {"step-1": [1.7, 1.9]}},
    ]
    history = {
        "index": "/h/index.jsonl",
        "run_id": "r2",
        "runs": runs,
        "drafters": ["step-1"],
        "changes": [
            {"drafter": "step-1", "direction": "up", "before": 1.5, "after": 1.8, "previous_run_id": "r1"}
        ],
    }
    markdown = rep.render_summary({**summary, "history": history}, {"step-1": "", "step-2": ""})
    assert "| r2 | 1.80 [1.70, 1.90] |" in markdown
    assert "- step-1: up, tau 1.50 in `r1` -> 1.80" in markdown
    quiet = rep.render_summary(
        {**summary, "history": {**history, "changes": []}}, {"step-1": "", "step-2": ""}
    )
    assert "No drafter's tau moved outside the noise" in quiet
