"""eval.yml end to end on the local default: the report, idempotence, and the service surviving failure."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


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


def test_tags_score_rescores_without_touching_the_service(first_run, local_default):
    pid_before = local_default.server_pid()
    result = local_default.play("eval.yml", args=("--tags", "score"), score_drafter_force=True)
    assert result.rc == 0, result.output[-6000:]
    assert "Score the drafter on the extracted hidden states" in result.output
    assert "sglang_service" not in result.output and "Extract the target" not in result.output
    assert local_default.server_pid() == pid_before


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


def test_failed_extraction_names_the_stage_and_the_service_comes_back(first_run, local_default, tmp_path):
    # Truncated weights pass the input checks (config and tensor index are intact) and fail only when
    # the extraction loads the model: inside the GPU window, with the service down, when the extraction
    # is not started ahead of the window (started ahead, it fails before the stop).
    good = local_default.models_dir / "target"
    broken = tmp_path / "truncated-target"
    shutil.copytree(good, broken)
    weights = broken / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    pid_before = local_default.server_pid()
    result = local_default.play(
        "eval.yml",
        specops_run_dir=str(local_default.work_dir / "run-broken"),
        specops_target_model=str(broken),
        sglang_service_model_path=str(good),
        specops_prestart_extraction=False,
    )
    assert result.rc != 0
    assert "specops stage 'extract' failed" in result.output, result.output[-4000:]
    assert "the service was brought back" in result.output
    assert local_default.server_pid() != pid_before, "the window should have stopped the server"
    assert local_default.health_generate_status() == 200


def test_bad_layer_id_fails_before_the_service_is_touched(first_run, local_default):
    pid_before = local_default.server_pid()
    run_dir = local_default.seed_run_dir(local_default.run_dir, local_default.work_dir / "run-bad-layer")
    result = local_default.play(
        "eval.yml",
        specops_run_dir=str(run_dir),
        extract_hidden_states_layer_ids=[99],
    )
    assert result.rc != 0
    assert "specops stage 'extract' failed" in result.output
    assert "99" in result.output and "the service was not taken down" in result.output
    assert local_default.server_pid() == pid_before
    assert local_default.health_generate_status() == 200


def test_mistyped_target_model_is_refused_before_the_healthy_server_is_restarted(first_run, local_default):
    pid_before = local_default.server_pid()
    result = local_default.play(
        "eval.yml",
        specops_run_dir=str(local_default.work_dir / "run-typo"),
        specops_target_model=str(local_default.models_dir / "Qwen3.6-27b"),
    )
    assert result.rc != 0
    assert "specops stage 'serve' failed" in result.output, result.output[-4000:]
    assert "sglang_service_model_path" in result.output and "does not exist" in result.output
    assert "the service was not taken down" in result.output
    assert local_default.server_pid() == pid_before
    assert local_default.health_generate_status() == 200


def test_memory_saver_window_keeps_the_server_process_and_loses_no_request_in_flight(
    memory_saver_site, served, tmp_path
):
    """Short, long and streaming requests in flight while eval.yml pauses, releases and resumes the
    server: SGLang 0.5.23's {"mode": "retract"} sends running requests back to the queue, so every one
    completes after the resume (an abort-mode pause would have answered them cut short)."""
    site = memory_saver_site
    run_dir = site.seed_run_dir(served.run_dir, site.work_dir / "run-in-flight")  # only the window is new
    pid_before = site.server_pid()
    stop, rows = tmp_path / "stop", tmp_path / "requests.jsonl"
    client = subprocess.Popen(
        [
            sys.executable.replace("/.venv/", "/.venv-ml/"),
            "-m",
            "specops.loadgen",
            "--url",
            f"http://127.0.0.1:{site.port}",
            "--out",
            str(rows),
            "--stop-file",
            str(stop),
            "--kinds",
            "short,long,stream",
            "--concurrency",
            "3",
            "--max-seconds",
            "1500",
            "--long-max-new-tokens",
            "48",
            "--timeout",
            "900",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # Up to and through the window: the window's record is what the test reads, scoring adds nothing.
        result = site.play("eval.yml", args=("--tags", "prefetch,extract"), specops_run_dir=str(run_dir))
    finally:
        stop.touch()
        summary = json.loads(client.communicate(timeout=900)[0].splitlines()[-1])
    assert result.rc == 0, result.output[-6000:]
    assert site.server_pid() == pid_before
    assert site.health_generate_status() == 200
    record = json.loads((run_dir / "hidden_states" / "window.json").read_text())
    assert record["pause_mode"] == "retract" and record["server_version"] == "0.5.23"
    assert record["started_instead"] is False
    # Requests were in flight when the service was paused, of every kind, and none was lost or cut short.
    down_at = datetime.fromisoformat(record["down_at"].replace("Z", "+00:00")).timestamp()
    answered = [json.loads(line) for line in rows.read_text().splitlines()]
    across = {r["kind"] for r in answered if r["start"] <= down_at <= r["start"] + r["latency_s"]}
    assert across, ("no request was in flight at the pause", summary)
    assert summary["failed"] == 0 and summary["incomplete"] == 0, summary
