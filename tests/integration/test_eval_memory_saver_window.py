"""The memory-saver window on the local default: the server process is kept, no request in flight at
the pause is lost, and neither of the server's keys appears in anything the play prints, records or logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

from conftest import ADMIN_API_KEY, API_KEY

from specops.window import render_markdown

REPO = Path(__file__).resolve().parents[2]


def keys_in(text: str) -> list[str]:
    return [name for name, key in (("api key", API_KEY), ("admin key", ADMIN_API_KEY)) if key in text]


def test_memory_saver_window_keeps_the_server_process_and_loses_no_request_in_flight(
    memory_saver_site, served, tmp_path
):
    """Short, long, streaming and constrained requests in flight while eval.yml pauses, releases and
    resumes the server: SGLang 0.5.23's {"mode": "retract"} sends running requests back to the queue, so
    every one completes after the resume (an abort-mode pause would have answered them cut short). The
    server has an api key and an admin key: the window opens pause, flush, release and resume with the
    admin key, and no key shows in the play's output (-v), the run's records, the state directory or the
    logs."""
    site = memory_saver_site
    run_dir = site.seed_run_dir(served.run_dir, site.work_dir / "run-in-flight")  # only the window is new
    pid_before = site.server_pid()
    stop, rows = tmp_path / "stop", tmp_path / "requests.jsonl"
    client_argv = [
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
        "short,long,stream,constrained",
        "--concurrency",
        "3",
        "--max-seconds",
        "1500",
        "--long-max-new-tokens",
        "48",
        "--timeout",
        "900",
        "--api-key",
        API_KEY,
    ]
    client = None
    # Up to and through the window, with the scoring placed inside it (after the extraction, before the
    # resume): the window's record and the report it wrote are what the test reads.
    play = site.popen(
        "eval.yml",
        args=("--tags", "prefetch,extract", "-v"),
        specops_run_dir=str(run_dir),
        specops_score_placement="window",
    )
    output = ""
    try:
        # The requests run from a few tasks before the pause until the window's record: every one of them
        # is a generation on this machine's CPU, so none is sent while the play does the rest.
        for line in play.stdout:
            output += line
            if client is None and "TASK [Stage prepare-window: draw the window's token" in line:
                client = subprocess.Popen(
                    client_argv,
                    cwd=REPO,
                    env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                    stdout=subprocess.PIPE,
                    text=True,
                )
            elif "TASK [Stage record: write the window's record" in line:
                stop.touch()
        play.wait(timeout=1800)
    finally:
        if play.poll() is None:
            play.kill()
            play.wait()
        stop.touch()
        summary = json.loads(client.communicate(timeout=900)[0].splitlines()[-1]) if client else None
    result = SimpleNamespace(rc=play.returncode, output=output)
    assert client is not None, output[-4000:]
    assert result.rc == 0, result.output[-6000:]
    assert site.server_pid() == pid_before
    assert site.health_generate_status() == 200
    record = json.loads((run_dir / "hidden_states" / "window.json").read_text())
    assert record["pause_mode"] == "retract" and record["server_version"] == "0.5.23"
    assert record["started_instead"] is False
    # The memory plan kept the weights on the (simulated 16 GiB) device: only the KV cache and graphs went.
    # The window was one task (sglang_service's state window): release, the extraction told go, the scoring
    # (started ahead, waiting for the extraction's end) on the freed device, the guard's resume the moment
    # the scoring said its scores were computed (before its reports), all without a task of the play between.
    stages = [stage["stage"] for stage in record["stages"]]
    assert stages[0] == "window" and not {"stop-server", "extract", "score"} & set(stages), stages
    assert output.count("TASK [Stage window: release, extract (and score where placed here), resume") == 1
    assert (record["resumed_by"] or "").startswith("guard"), record
    step = record["step_stages"]
    assert step["work_s"] > 0 and abs(step["downtime_s"] - record["downtime_s"]) < 0.01, (step, record)
    # The scoring is a stage of the downtime of its own, after the extraction's outputs were written.
    accounted = record["accounted"]
    assert accounted["scoring_s"] > 0 and accounted["outputs_and_device_release_s"] >= 0, accounted
    finished = list(run_dir.glob("score.*.state"))
    assert len(finished) == 1 and json.loads(finished[0].read_text())["state"] == "finished", finished
    assert "scoring runs inside the window on cpu" in " ".join(result.output.split())
    report = json.loads((run_dir / "score" / "report.json").read_text())
    assert report["placement"]["where"] == "window", report["placement"]
    assert report["placement"]["why"].startswith("forced: specops_score_placement is window")
    assert report["placement"]["seconds"] > 0
    assert "layer_offset" not in [d["name"] for d in report["diagnostics"]]
    plan = record["memory_plan"]
    assert plan["choice"] == "kv_cache" and plan["tags"] == ["kv_cache", "cuda_graph"], plan
    assert plan["fits_beside_weights"] and "weights stay on the GPU" in plan["reason"]
    assert record["release_s"] is not None and 0 <= record["release_s"] <= record["downtime_s"]
    assert "Released: kv_cache, cuda_graph (the weights stayed on the GPU" in render_markdown(record)
    # Requests were in flight when the service was paused, of every kind, and none was lost or cut short.
    down_at = datetime.fromisoformat(record["down_at"].replace("Z", "+00:00")).timestamp()
    answered = [json.loads(line) for line in rows.read_text().splitlines()]
    across = {r["kind"] for r in answered if r["start"] <= down_at <= r["start"] + r["latency_s"]}
    assert across, ("no request was in flight at the pause", summary)
    assert summary["failed"] == 0 and summary["incomplete"] == 0, summary
    # Constrained requests (regex) wait a second in the grammar queue, which SGLang's release needs empty
    # (0.5.23 managers/scheduler.py:5369-5372) and which drains only while scheduling: they went through.
    assert any(r["kind"] == "constrained" and r["complete"] for r in answered), summary
    # weights proven after the resume (/weights_checker, 0.5.23)
    assert record.get("weights_check", {}).get("matched") is True, record
    # No key anywhere specops writes: the play's output, the run directory, the site's state and logs.
    # The server's own log carries them only in SGLang's line of its arguments (0.5.23
    # entrypoints/engine.py:311); specops's line there (the launch's argv) shows them redacted.
    assert not keys_in(result.output), keys_in(result.output)
    server_log = site.work_dir / "sglang.log"
    for path in [*run_dir.rglob("*"), *site.work_dir.rglob("*")]:
        if path.is_file() and path != server_log:
            assert not keys_in(path.read_text(errors="replace")), path
    leaking = [line for line in server_log.read_text().splitlines() if keys_in(line)]
    assert leaking and all("server_args=" in line for line in leaking), leaking
