"""run_retention: the last runs keep their reports, only the newest keep their hidden states, older runs
go; nothing that is not a run, and no run a play holds, is touched; playbooks/retention.yml applies it."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".venv" / "bin"
ENV = {**os.environ, "ANSIBLE_LOCALHOST_WARNING": "false", "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}


def retention(args: dict, tree: Path, check: bool = False) -> dict:
    cmd = [BIN / "ansible", "localhost", "-m", "specops.drafter.run_retention", "-a", json.dumps(args)]
    done = subprocess.run(
        [str(c) for c in cmd] + ["--tree", str(tree)] + (["--check"] if check else []),
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads((tree / "localhost").read_text())
    assert done.returncode == 0, result
    return result


def make_run(runs: Path, name: str, scored_at: float) -> Path:
    run = runs / name
    for stage in ("completions", "hidden_states", "score"):
        (run / stage).mkdir(parents=True)
        (run / stage / "manifest.json").write_text("{}")
    (run / "hidden_states" / "shard-0.safetensors").write_bytes(b"\0" * 4096)
    (run / "score" / "report.json").write_text("{}")
    os.utime(run / "score" / "report.json", (scored_at, scored_at))
    return run


def runs_dir(tmp_path: Path, count: int) -> tuple[Path, list[Path]]:
    runs = tmp_path / "runs"
    # Created newest first, so a directory's own time would order them the wrong way round.
    made = [make_run(runs, f"job-{i}", 1_000_000 + 1000 * i) for i in reversed(range(count))]
    return runs, sorted(made, key=lambda run: run.name, reverse=True)


def test_the_last_runs_keep_their_reports_the_newest_its_hidden_states_older_runs_go(tmp_path):
    runs, (newest, second, third, oldest) = runs_dir(tmp_path, 4)
    result = retention({"path": str(runs), "keep_runs": 3, "keep_hidden_states": 1}, tmp_path)
    assert result["changed"] is True
    assert result["runs"] == [str(newest), str(second), str(third), str(oldest)]
    assert result["removed_runs"] == [str(oldest)] and not oldest.exists()
    assert result["removed_hidden_states"] == [str(second / "hidden_states"), str(third / "hidden_states")]
    assert (newest / "hidden_states").is_dir()
    for kept in (second, third):
        assert (kept / "score" / "report.json").is_file() and (kept / "completions").is_dir()
    assert result["freed_bytes"] >= 3 * 4096


def test_a_second_pass_changes_nothing_deleting_hidden_states_does_not_make_a_run_new(tmp_path):
    runs, _ = runs_dir(tmp_path, 4)
    retention({"path": str(runs), "keep_runs": 3, "keep_hidden_states": 1}, tmp_path)
    again = retention({"path": str(runs), "keep_runs": 3, "keep_hidden_states": 1}, tmp_path)
    assert again["changed"] is False and again["removed_runs"] == [] and again["removed_hidden_states"] == []


def test_check_mode_reports_what_it_would_delete_and_deletes_nothing(tmp_path):
    runs, made = runs_dir(tmp_path, 3)
    result = retention({"path": str(runs), "keep_runs": 1, "keep_hidden_states": 1}, tmp_path, check=True)
    assert result["changed"] is True and len(result["removed_runs"]) == 2
    assert all(run.is_dir() for run in made)


def test_directories_that_are_not_runs_and_excluded_runs_are_left_alone(tmp_path):
    runs, (newest, second) = runs_dir(tmp_path, 2)
    (runs / "notes").mkdir()
    (runs / "notes" / "keep.txt").write_text("mine")
    result = retention(
        {"path": str(runs), "keep_runs": 0, "keep_hidden_states": 0, "exclude": [str(second)]}, tmp_path
    )
    assert result["removed_runs"] == [str(newest)]
    assert (runs / "notes" / "keep.txt").is_file() and (second / "hidden_states").is_dir()


def test_a_run_whose_lock_a_play_holds_is_not_touched(tmp_path):
    runs, (newest, older) = runs_dir(tmp_path, 2)
    lock = older / ".specops.lock"
    lock.write_text("{}")
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = retention({"path": str(runs), "keep_runs": 1, "keep_hidden_states": 1}, tmp_path)
    assert older.is_dir() and result["removed_runs"] == []
    assert result["left_alone"] == [{"path": str(older), "reason": "a running play holds its lock"}]


def test_playbooks_retention_yml_applies_the_role_to_the_gpu_hosts(tmp_path):
    runs, (newest, older) = runs_dir(tmp_path, 2)
    done = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "playbooks/retention.yml",
            "-e",
            json.dumps({"run_retention_runs_dir": str(runs), "run_retention_keep_runs": 1}),
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert newest.is_dir() and not older.exists()
    assert "2 runs in" in done.stdout
