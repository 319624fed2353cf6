"""score_drafter as a host runs it: check mode changes nothing, a run writes the report, a rerun is a no-op.

The ML environment (.venv-ml) builds the fixture models and their hidden states; the module runs
`python -m specops.score` there with the checkout's package first on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from module_call import call_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ML_PYTHON = ROOT / ".venv-ml/bin/python"

pytestmark = pytest.mark.skipif(not ML_PYTHON.exists(), reason="needs the ML environment (.venv-ml)")


def ml_env() -> dict:
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT / "src"),
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("score_module")
    fixtures = Path(os.environ.get("SPECOPS_FIXTURES", root / "fixtures"))
    subprocess.run(
        [str(ML_PYTHON), str(ROOT / "tests/unit/score_data.py"), str(fixtures), str(root / "run")],
        check=True,
        env=ml_env(),
        capture_output=True,
        timeout=900,
    )
    return {
        "python": str(ML_PYTHON),
        "hidden_states": str(root / "run/hidden_states"),
        "completions": str(root / "run/completions"),
        "target": str(fixtures / "target"),
        "drafter": str(fixtures / "drafter"),
        "out_dir": str(root / "run/score"),
        "device": "cpu",
        "dtype": "float32",
        "diagnostics": ["backend", "vocabulary"],
    }


def run_module(args: dict, tmp_path: Path, check: bool = False) -> dict:
    """Run specops.drafter.score_drafter as a host runs it (module_call); its result, with failed set."""
    return call_module("score_drafter", args, check=check, env=ml_env())


def test_check_mode_run_and_rerun(run, tmp_path):
    planned = run_module(run, tmp_path, check=True)
    assert planned["changed"] is True and planned["tau"] is None and not planned["failed"]
    assert not Path(run["out_dir"]).exists()

    first = run_module(run, tmp_path)
    assert first["changed"] is True, first.get("msg")
    assert first["tau"] >= 1.0 and first["n_prompts"] == 2 and first["reference_tau"] is None
    assert first["verdict"].startswith(f"drafter tau {first['tau']:.2f}")
    assert Path(first["report_md"]).is_file() and all(Path(p).is_file() for p in first["plots"])

    again = run_module(run, tmp_path)
    assert again["changed"] is False and again["tau"] == first["tau"]


def test_a_missing_hidden_state_directory_fails_with_its_path(run, tmp_path):
    result = run_module({**run, "hidden_states": str(tmp_path / "nowhere")}, tmp_path)
    assert result.get("failed") is True
    assert "nowhere is not a directory" in result["msg"]


def test_bounded_scoring_runs_at_the_nice_value_and_thread_count_it_was_given(run, tmp_path):
    """Without systemd as PID 1 (this container), the fallback runs: `nice -n` and bounded threads; the
    stage reads its own nice value, cgroup cpu.max and torch's thread count and puts them in the report."""
    base_nice = os.getpriority(os.PRIO_PROCESS, 0)
    args = {**run, "out_dir": str(tmp_path / "bounded"), "cpu_bounds": {"nice": 7, "threads": 1}}
    args["placement"] = {"where": "cpu", "why": "forced: specops_score_placement is cpu"}
    result = run_module(args, tmp_path)
    assert result["changed"] is True, result.get("msg")
    placed = result["placement"]
    assert placed["where"] == "cpu" and placed["why"] == "forced: specops_score_placement is cpu"
    assert placed["bounds"]["nice"] == min(19, base_nice + 7)
    assert placed["bounds"]["threads"] == 1 and placed["bounds"]["omp_num_threads"] == "1"
    assert placed["seconds"] > 0
    # The fallback enforces no quota: the stage's cgroup is the test's own.
    assert placed["bounds"]["cgroup"] == Path("/proc/self/cgroup").read_text().split("0::")[-1].split()[0]
    report = Path(result["report_md"]).read_text()
    assert "## Where scoring ran" in report and f"nice {min(19, base_nice + 7)}" in report


def test_a_report_scored_in_the_window_is_refreshed_after_it_without_scoring_again(run, tmp_path):
    """Placement window: the window scores the drafter without the layer offsets; after the window the
    stage finds those scores, runs only the diagnostics left for it, and keeps where the scores were made."""
    out = str(tmp_path / "window")
    in_window = {**run, "out_dir": out, "diagnostics": ["backend", "vocabulary"]}
    in_window["placement"] = {"where": "window", "why": "auto: fits", "estimated_seconds": 1.0}
    first = run_module(in_window, tmp_path)
    assert first["changed"] is True and first["placement"]["where"] == "window", first.get("msg")

    after = {**run, "out_dir": out, "diagnostics": ["backend", "vocabulary", "layer_offset"]}
    after["placement"] = {"where": "cpu", "why": "a rescore would say this"}
    after["history"] = str(tmp_path / "history")
    second = run_module(after, tmp_path)
    assert second["changed"] is True, second.get("msg")
    # The scores were reused: the placement (and the scoring's time) are the window's.
    assert second["placement"]["where"] == "window"
    assert second["placement"]["seconds"] == first["placement"]["seconds"]
    assert second["tau"] == first["tau"] and second["history_index"]
    report = json.loads(Path(second["report_json"]).read_text())
    assert "layer_offset" in [d["name"] for d in report["diagnostics"]]
    assert second["placement"]["after_window"]["where"] == "cpu"
