"""eval.yml end to end on the local default: the report, check mode, rescoring and idempotence.

Failures are in test_eval_when_a_stage_fails.py and the memory-saver window in
test_eval_memory_saver_window.py: the integration suite runs its files side by side, and the files of
one worker share its finished run."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import REPO


def test_eval_writes_a_report_with_tau_per_prompt_and_overall(first_run, local_default):
    report = json.loads((local_default.run_dir / "score" / "report.json").read_text())
    prompts = [
        json.loads(line)["id"]
        for line in (local_default.run_dir / "completions" / "completions.jsonl").read_text().splitlines()
    ]
    assert [row["id"] for row in report["per_prompt"]] == prompts
    assert all(row["tau"] >= 1.0 for row in report["per_prompt"])
    assert report["overall"]["tau"] >= 1.0
    markdown = (local_default.run_dir / "score" / "report.md").read_text()
    assert "tau" in markdown.lower() and ".png" in markdown


def test_eval_reports_the_service_window_with_its_stages(first_run, local_default):
    window = json.loads((local_default.run_dir / "score" / "report.json").read_text())["window"]
    # The environment was verified beside the serving server, before the window (the extraction waited).
    stages = [s["stage"] for s in window["stages"]]
    assert stages == ["stop-server", "release-gpus", "extract", "start-server"]
    # The stages are the play's marks; the downtime is the service's own moments, inside that span.
    assert window["play_span_s"] == pytest.approx(sum(s["s"] for s in window["stages"]), abs=0.01)
    assert window["measured_by"] == "service"
    assert 0 < window["compute_s"] < window["downtime_s"] <= window["play_span_s"]
    assert window["server_start_s"] is not None and 0 < window["server_start_s"] < window["downtime_s"]
    assert "## Service window" in (local_default.run_dir / "score" / "report.md").read_text()


def test_the_stop_window_took_down_sglangs_process_tree_and_freed_its_devices(first_run, local_default):
    """The local default runs --tp-size 2: the window's stop recorded the launcher and its three children
    (two scheduler ranks, each holding its device file, and the detokenizer), gpu_release found none of
    them left, and the server started after the window is the same tree again."""
    recorded = json.loads((local_default.work_dir / "sglang.pid.d" / "tree.json").read_text())
    assert len(recorded) == 4, recorded
    pid = local_default.server_pid()
    children = {}
    for entry in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
                children[Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0].decode()] = int(entry)
        except OSError:
            continue
    assert sorted(children) == ["sglang::detokenizer", "sglang::scheduler_TP0", "sglang::scheduler_TP1"]
    for rank in (0, 1):
        fds = Path(f"/proc/{children[f'sglang::scheduler_TP{rank}']}/fd")
        held = {os.readlink(fd) for fd in fds.iterdir()}
        assert str(local_default.work_dir / "devices" / f"nvidia{rank}") in held


def test_check_mode_on_a_fresh_run_directory_says_what_a_run_would_do_and_touches_nothing(served, tmp_path):
    pid_before = served.server_pid()
    result = served.play("eval.yml", args=("--check",), specops_run_dir=str(tmp_path / "never-run"))
    assert result.rc == 0, result.output[-6000:]
    assert "check mode: the completions are not fetched yet" in result.output
    # The window's tasks are listed, and every one of them skipped.
    window = re.compile(r"TASK \[Stage window: take the service off the GPUs[^\n]*\n(\w+):")
    window_task = window.search(result.output)
    assert window_task and window_task.group(1) == "skipping", result.output[-6000:]
    assert served.server_pid() == pid_before and served.health_generate_status() == 200
    # Check mode writes nothing on the host: no run directory, no server state, no guard.
    assert not (tmp_path / "never-run").exists()


def test_a_successful_run_prints_no_failure_looking_retry_lines(first_run):
    assert "FAILED - RETRYING" not in first_run.output


def test_the_scoring_run_is_kept_and_appended_to_the_history(first_run, local_default):
    history = local_default.work_dir / "history"
    runs = [json.loads(line) for line in (history / "index.jsonl").read_text().splitlines()]
    assert runs and (history / runs[-1]["run_id"] / "report.md").is_file()


def test_tags_score_rescores_on_a_scoring_host_without_touching_the_service_and_brings_the_report_back(
    first_run, local_default, tmp_path
):
    # A second inventory host, reached locally, whose files live under its own root: what is sent lands
    # there at the GPU host's paths, is checked against its sha256 and scored there; the report comes back.
    # --tags score runs no stage that touches the service or extracts.
    inventory = tmp_path / "scoring.yml"
    inventory.write_text(
        json.dumps(
            {
                "all": {
                    "hosts": {
                        "scorer": {
                            "ansible_connection": "local",
                            "ansible_python_interpreter": "{{ ansible_playbook_python }}",
                        }
                    }
                }
            }
        )
    )
    root = tmp_path / "scoring"
    history = (local_default.work_dir / "history" / "index.jsonl").read_text().splitlines()
    pid_before = local_default.server_pid()
    result = local_default.play(
        "eval.yml",
        args=("-i", str(REPO / "inventory" / "local"), "-i", str(inventory), "--tags", "score"),
        specops_score_placement="host",
        specops_scoring_host="scorer",
        specops_scoring_device="cpu",
        specops_scoring_dir=str(root),
        specops_scoring_transit_dir=str(tmp_path / "transit"),
    )
    assert result.rc == 0, result.output[-6000:]
    assert "verify that every file arrived with its sha256 on scorer" in result.output
    assert "Score the drafter on the extracted hidden states" in result.output
    assert "sglang_service" not in result.output and "Extract the target" not in result.output
    assert local_default.server_pid() == pid_before
    run_dir = local_default.run_dir
    landed = root / "localhost" / str(run_dir).lstrip("/")
    assert (landed / "hidden_states" / "manifest.json").is_file()
    scored_there = json.loads((landed / "score" / "report.json").read_text())
    assert scored_there["placement"]["where"] == "host" and scored_there["placement"]["host"] == "scorer"
    report = json.loads((run_dir / "score" / "report.json").read_text())
    assert report["placement"]["host"] == "scorer" and report["placement"]["device"] == "cpu"
    assert report["placement"]["why"] == "forced: specops_score_placement is host (scorer)"
    assert "scored on **scorer** (cpu)" in (run_dir / "score" / "report.md").read_text()
    # The report brought back is refreshed here with the history (scored once, on the scoring host).
    after = (local_default.work_dir / "history" / "index.jsonl").read_text().splitlines()
    assert len(after) == len(history) + 1
    assert not list((tmp_path / "transit").iterdir()), "the files staged on the control node are removed"


def test_eval_leaves_the_service_ready(first_run, local_default):
    assert local_default.health_generate_status() == 200


def test_second_run_changes_nothing_and_keeps_the_server_up(first_run, local_default):
    pid_before = local_default.server_pid()
    result = local_default.play("eval.yml")
    assert result.rc == 0, result.output[-6000:]
    changed = {host: counts["changed"] for host, counts in result.recap.items()}
    assert changed and not any(changed.values()), result.output[-4000:]
    assert local_default.server_pid() == pid_before
    assert local_default.health_generate_status() == 200
