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
    assert rep.verdict(report) == "drafter tau 3.00 vs reference 12.33 (0.24x)"


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
    assert "| step-1 | 1.80 | 0.47x | 0.400 | 1.50x | layer_offset |" in markdown
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
        {"run_id": "2", "tau": {"step-1": 1.8, "step-2": 1.7}, "reference_tau": 3.8},
    ]
    assert plots.render_trend(runs, ["step-1", "step-2"], tmp_path) == rep.PLOT_TAU_TREND
    for name in (rep.PLOT_TAU_BY_DRAFTER, rep.PLOT_TAU_TREND):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
