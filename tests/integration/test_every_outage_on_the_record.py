"""Every outage on the record, and none taken that is not needed (docs/faults.md): a play lost inside its
window, a run refused by another run's window, two runs of one server back to back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from test_faults import guard_processes, said

REPO = Path(__file__).resolve().parents[2]
# The guard's grace for the killed control node: longer than a loaded machine's gap between two tasks.
GRACE_S = 20


def lock_is_free(path: Path) -> bool:
    import fcntl

    with open(path) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


def test_a_control_node_killed_in_the_window_neither_blocks_the_rerun_nor_hides_its_outage(served):
    """The control node dies inside the window (ansible-playbook and its workers SIGKILLed): the guard brings
    the service back, the run lock lapses with the play once the guard is done, and the rerun proceeds and
    reports the outage. The run directory also holds an earlier run's start signal (stopped, go), which the
    new extraction must not take for its own."""
    site = served
    run_dir = site.seed_run_dir(site.run_dir, site.work_dir / "run-control-node-killed")
    (run_dir / "extract.start").write_text(json.dumps({"signal": "go"}))
    (run_dir / "extract.start.state").write_text(
        json.dumps({"state": "stopped", "pid": 1, "at": time.time() - 3600})
    )
    # The guard fires this long after the window's work is left without its play. Between two of the
    # window's tasks no process carries the token: a grace shorter than the longest such gap on a loaded
    # machine fires while the play is alive (at 3 s it started the server during release-gpus).
    extra = site.extra_vars(specops_run_dir=str(run_dir), sglang_service_guard_grace=GRACE_S)
    play = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            str(REPO / "playbooks" / "eval.yml"),
            "-e",
            json.dumps(extra),
            # The environment is the shared run's: every stage but its own.
            "--tags",
            "prefetch,extract",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
    )
    output = ""
    killed_at = None
    try:
        for line in play.stdout:
            output += line
            if "TASK [Stage extract: extract the target" in line:
                os.killpg(play.pid, signal.SIGKILL)
                killed_at = time.time()
                break
    finally:
        if play.poll() is None:
            os.killpg(play.pid, signal.SIGKILL)
        play.wait()
    result = SimpleNamespace(output=output)
    assert killed_at is not None, output[-4000:]
    # The earlier run's signal was not read as this extraction's: it waited for the GPUs.
    assert "the extraction waits for the GPUs (pid" in said(result), output[-4000:]
    assert "could not wait for the GPUs" not in said(result)

    # A bound for a loaded machine, not an expectation: the guard fires GRACE_S after the work is left alone.
    lock = run_dir / ".specops.lock"
    deadline = time.monotonic() + 600
    while not (site.health_generate_status() == 200 and not guard_processes(site) and lock_is_free(lock)):
        assert time.monotonic() < deadline, (
            "the guard did not bring the service back, or the run lock stayed held"
        )
        time.sleep(1)

    rerun = site.play("eval.yml", specops_run_dir=str(run_dir), args=("--tags", "prefetch,extract,score"))
    assert rerun.rc == 0, rerun.output[-6000:]
    assert "was taken down by a play that was lost, and its guard brought it back" in said(rerun)
    assert site.health_generate_status() == 200
    report = json.loads((run_dir / "score" / "report.json").read_text())
    [outage] = report["outages"]
    assert outage["down_at"] < outage["ready_at"] and outage["downtime_s"] > 0
    assert f"the window's work is gone and the play did not disarm within {GRACE_S} s" in outage["cause"]
    assert str(run_dir) in outage["owner"]
    assert "## Outages the guard ended" in (run_dir / "score" / "report.md").read_text()
    # The rerun's own window is on the record beside it.
    assert report["window"]["taken"] is True


def test_the_same_work_right_after_is_taken_over_and_other_work_says_it_takes_the_service_down_again(
    served, tmp_path
):
    """Two runs against one server back to back: the same work (target, layers, completions' tokens) opens
    no second window; other work does, and says whose window it follows and what differs."""
    site = served
    same = site.seed_run_dir(site.run_dir, site.work_dir / "run-same-work")
    pid = site.server_pid()
    result = site.play(
        "eval.yml",
        specops_run_dir=str(same),
        specops_reuse_extractions=True,
        args=("--tags", "prefetch,extract"),
    )
    assert result.rc == 0, result.output[-6000:]
    assert "(the same inputs) was taken over: no window for it" in said(result), result.output[-6000:]
    assert site.server_pid() == pid and site.health_generate_status() == 200  # never stopped
    assert not (same / "hidden_states" / "window.json").exists()
    shared = json.loads((site.run_dir / "hidden_states" / "manifest.json").read_text())
    taken = json.loads((same / "hidden_states" / "manifest.json").read_text())
    assert taken["inputs_fingerprint"] == shared["inputs_fingerprint"] and taken["files"] == shared["files"]

    # Other work: other completions (two prompts, shorter), so other hidden states.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join((REPO / "prompts" / "coding.jsonl").read_text().splitlines(keepends=True)[:2]))
    other = site.work_dir / "run-other-work"
    result = site.play(
        "eval.yml",
        specops_run_dir=str(other),
        specops_prompts=str(prompts),
        specops_max_new_tokens=16,
        specops_reuse_extractions=True,
        args=("--tags", "prefetch,extract"),
    )
    assert result.rc == 0, result.output[-6000:]
    assert "WARNING: the service is taken down a second time:" in said(result), result.output[-6000:]
    # The last extraction noted on the host: the shared run's, or another site's of the session (the host
    # cache is shared); whichever it is, its completions were not these.
    assert "this run needs other work (" in said(result) and "the completions' tokens" in said(result)
    window = json.loads((other / "hidden_states" / "window.json").read_text())
    assert (
        "the completions' tokens" in window["follows"]["differs"] and window["follows"]["same_work"] is False
    )
    assert site.server_pid() != pid and site.health_generate_status() == 200


def test_a_run_refused_at_the_stop_by_another_runs_window_says_it_took_nothing_down(served, tmp_path):
    """Another run takes the server's window after this run's `serve` and before its stop: this run's stop is
    refused, it brings nothing back and arms no guard, and its message says so (not 'start-server' and a
    guard that 'stays armed')."""
    site = served
    run_dir = site.seed_run_dir(site.run_dir, site.work_dir / "run-refused-at-the-stop")
    lock = site.work_dir / "sglang.pid.d" / "window.lock"
    # The other run's guard: a live process, so the lock is not stale.
    other_guard = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    starttime = int(Path(f"/proc/{other_guard.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    # Nothing prepared ahead of a window that will not open: no prewarm, no extraction started early.
    extra = site.extra_vars(
        specops_run_dir=str(run_dir), specops_prestart_extraction=False, extract_hidden_states_prewarm=False
    )
    play = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            str(REPO / "playbooks" / "eval.yml"),
            "-e",
            json.dumps(extra),
            "--tags",
            "prefetch,extract",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
    )
    output = ""
    pid = site.server_pid()
    try:
        for line in play.stdout:
            output += line
            if "TASK [Stage extract-plan:" in line and not lock.exists():
                lock.write_text(
                    json.dumps(
                        {
                            "token": "another-run",
                            "owner": "/srv/another-run (eval.yml, control node b)",
                            "since": time.time(),
                            "guard": {"pid": other_guard.pid, "starttime": starttime},
                        }
                    )
                )
        play.wait(timeout=600)
    finally:
        if play.poll() is None:
            play.kill()
            play.wait()
        lock.unlink(missing_ok=True)
        other_guard.kill()
        other_guard.wait()
    result = SimpleNamespace(output=output)
    assert play.returncode != 0
    assert "specops stage 'stop-server' failed" in said(result), output[-4000:]
    assert "/srv/another-run (eval.yml, control node b)" in said(result)
    assert "the service was not taken down by this run and it armed no guard" in said(result)
    assert "stays armed" not in said(result) and "specops stage 'start-server'" not in said(result)
    assert site.server_pid() == pid and site.health_generate_status() == 200
    assert guard_processes(site) == []
