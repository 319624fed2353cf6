"""The run history: one index line per scoring run, safe under concurrent writers; each run's directory."""

from __future__ import annotations

import datetime
import json
import multiprocessing
from pathlib import Path

from specops import history as hist


def summary(tau: float, interval: list[float] | None = None) -> dict:
    return {
        "drafters": [
            {"name": "step-1", "overall": {"tau": tau, "interval": interval}, "run": {"drafter": "/d/step-1"}}
        ],
        "reference": {"tau": 4.0, "interval": [3.9, 4.1]},
    }


def test_run_ids_sort_by_time_and_name_the_inputs():
    early = hist.new_run_id("abcdef0123", datetime.datetime(2026, 12, 1, 9, 0, tzinfo=datetime.timezone.utc))
    late = hist.new_run_id("00000000ff", datetime.datetime(2026, 12, 1, 10, 0, tzinfo=datetime.timezone.utc))
    assert early == "20261201T090000Z-abcdef01" and early < late


def test_entries_carry_tau_per_drafter_and_the_reference(tmp_path):
    hist.append(tmp_path, hist.entry("r1", summary(2.5)))
    (run,) = hist.read(tmp_path)
    assert (run["run_id"], run["tau"], run["reference_tau"]) == ("r1", {"step-1": 2.5}, 4.0)


def test_entries_carry_each_taus_interval(tmp_path):
    hist.append(tmp_path, hist.entry("r1", summary(2.5, [2.4, 2.6])))
    (run,) = hist.read(tmp_path)
    assert (run["interval"], run["reference_interval"]) == ({"step-1": [2.4, 2.6]}, [3.9, 4.1])


def _append_many(directory: str, writer: int) -> None:
    from pathlib import Path

    for n in range(50):
        hist.append(Path(directory), {"run_id": f"w{writer}-{n}", "tau": {"d": float(n)}, "pad": "x" * 5000})


def test_concurrent_writers_lose_and_interleave_no_line(tmp_path):
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pool.starmap(_append_many, [(str(tmp_path), w) for w in range(4)])
    lines = (tmp_path / hist.INDEX).read_text().splitlines()
    assert len(lines) == 200
    expected = {f"w{w}-{n}" for w in range(4) for n in range(50)}
    assert {json.loads(line)["run_id"] for line in lines} == expected


def test_a_line_cut_short_by_a_crash_is_skipped(tmp_path):
    hist.append(tmp_path, {"run_id": "ok", "tau": {}})
    with open(tmp_path / hist.INDEX, "a") as handle:
        handle.write('{"run_id": "cut')
    assert [r["run_id"] for r in hist.read(tmp_path)] == ["ok"]


def test_each_run_keeps_its_own_directory(tmp_path):
    out = tmp_path / "score"
    (out / "drafters" / "a").mkdir(parents=True)
    (out / "report.md").write_text("# r1")
    (out / "drafters" / "a" / "report.json").write_text("{}")
    kept = hist.keep_run(tmp_path / "history", "r1", [out / "report.md", out / "drafters"])
    assert (kept / "report.md").read_text() == "# r1" and (kept / "drafters/a/report.json").is_file()
    assert not list((tmp_path / "history").glob(".*.tmp"))


def test_trend_lists_every_drafter_name_in_first_seen_order(tmp_path):
    runs = [{"run_id": "1", "tau": {"b": 1.0}}, {"run_id": "2", "tau": {"a": 2.0, "b": 1.5}}]
    assert hist.trend(runs, "2", tmp_path / hist.INDEX)["drafters"] == ["b", "a"]


def run(run_id: str, tau: float, interval: list[float] | None) -> dict:
    return {"run_id": run_id, "tau": {"step-1": tau}, "interval": {"step-1": interval}}


def test_a_change_within_the_noise_of_two_runs_is_not_flagged():
    runs = [run("1", 2.5, [2.3, 2.7]), run("2", 2.6, [2.4, 2.8])]
    assert hist.changes(runs, "2") == []


def test_a_change_outside_the_noise_is_flagged_against_the_drafters_previous_run():
    runs = [run("1", 2.5, [2.45, 2.55]), {"run_id": "2", "tau": {"other": 1.0}}, run("3", 2.0, [1.95, 2.05])]
    (change,) = hist.changes(runs, "3")
    assert (change["direction"], change["before"], change["after"]) == ("down", 2.5, 2.0)
    assert change["run_id"] == "3"
    assert change["previous_run_id"] == "1"
    assert hist.trend(runs, "3", Path("index.jsonl"))["changes"] == [change]


def test_runs_kept_before_intervals_are_never_flagged():
    runs = [{"run_id": "1", "tau": {"step-1": 1.0}}, run("2", 3.0, [2.9, 3.1])]
    assert hist.changes(runs, "2") == []
