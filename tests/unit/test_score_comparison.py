"""Several drafters scored in one run and into one history: their directories, the comparison
table, the paired comparisons, the history's lines and trend."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
from score_data import request_for

from specops import report as rep
from specops import score, stats

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def many(fixture_models, run_dir, tmp_path_factory) -> SimpleNamespace:
    """Two drafters (the second a copy sharing the first's directory name) scored twice into one history."""
    root = tmp_path_factory.mktemp("many")
    twin = root / "twin" / fixture_models.drafter.name
    shutil.copytree(fixture_models.drafter, twin)
    request = request_for(
        fixture_models,
        run_dir,
        root / "score",
        drafter=[str(fixture_models.drafter), str(twin)],
        history=str(root / "history"),
        diagnostics=["acceptance"],
    )
    first = score.run(request)
    second = score.run({**request, "force": True})
    return SimpleNamespace(
        root=root,
        out=root / "score",
        first=first,
        second=second,
        names=[fixture_models.drafter.name, f"{fixture_models.drafter.name}-2"],
    )


def test_each_drafter_gets_its_own_directory_under_a_unique_name(many):
    assert sorted(p.name for p in (many.out / "drafters").iterdir()) == sorted(many.names)
    for name in many.names:
        own = json.loads((many.out / "drafters" / name / "report.json").read_text())
        assert own["name"] == name and own["overall"]["tau"] >= 1.0


def test_the_summary_compares_every_drafter_in_one_table(many):
    summary = json.loads((many.out / "report.json").read_text())
    assert [row["name"] for row in summary["comparison"]] == many.names
    markdown = (many.out / "report.md").read_text()
    assert all(f"| {name} | " in markdown for name in many.names)
    assert [d["name"] for d in many.second["drafters"]] == many.names


def test_identical_drafters_score_the_same(many):
    taus = [row["tau"] for row in many.second["drafters"]]
    assert taus[0] == taus[1]


def test_identical_drafters_are_paired_with_every_prompt_a_tie(many):
    pair = next(p for p in many.second["pairs"] if p["names"] == many.names)
    assert pair["difference"] == 0.0 and pair["verdict"] == stats.UNRESOLVED
    assert pair["wins"] == {"first": 0, "second": 0, "ties": pair["n_prompts"]}


def test_a_forced_rerun_of_the_same_inputs_flags_no_change_in_the_history(many):
    runs = [json.loads(line) for line in (many.root / "history" / "index.jsonl").read_text().splitlines()]
    assert all(set(run["interval"]) == set(many.names) for run in runs)
    assert many.second["changes"] == []


def test_every_scoring_run_is_appended_to_the_history_and_kept(many):
    lines = (many.root / "history" / "index.jsonl").read_text().splitlines()
    runs = [json.loads(line) for line in lines]
    assert [r["run_id"] for r in runs] == [many.first["run_id"], many.second["run_id"]]
    assert set(runs[0]["tau"]) == set(many.names)
    for run in runs:
        assert (many.root / "history" / run["run_id"] / "report.md").is_file()


def test_the_report_and_the_result_show_the_trend(many):
    assert (many.out / rep.PLOT_TAU_TREND).is_file()
    assert "## History" in (many.out / "report.md").read_text()
    assert [t["run_id"] for t in many.second["trend"]] == [many.first["run_id"], many.second["run_id"]]


def test_an_up_to_date_rerun_appends_nothing(many, fixture_models, run_dir):
    request = request_for(
        fixture_models,
        run_dir,
        many.out,
        drafter=[str(fixture_models.drafter), str(many.root / "twin" / fixture_models.drafter.name)],
        history=str(many.root / "history"),
        diagnostics=["acceptance"],
    )
    assert score.run(request)["changed"] is False
    assert len((many.root / "history" / "index.jsonl").read_text().splitlines()) == 2
