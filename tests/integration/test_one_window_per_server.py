"""Two evaluations of one server, from two run directories (two people, two drafters): the second is
refused at once, naming the window that holds the server, and touches neither the server nor the
first run's guard; the first run brings the service back as if alone."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from test_prestarted_extraction import is_extraction, read_state


def wait_for(condition, what: str, limit: float = 1800.0):
    # A bound for a hung run, not an expectation: a loaded machine only makes this slower.
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"never saw {what}")


def test_a_second_evaluation_of_a_server_in_its_window_is_refused_naming_the_holder(served, tmp_path):
    site = served
    first_dir = site.seed_run_dir(site.run_dir, tmp_path / "first")
    second_dir = site.seed_run_dir(site.run_dir, tmp_path / "second")
    lock = Path(str(site.work_dir / "sglang.pid") + ".d") / "window.lock"
    outcome: dict = {}
    first = threading.Thread(
        target=lambda: outcome.update(first=site.play("eval.yml", specops_run_dir=str(first_dir))),
        daemon=True,
    )
    first.start()
    # Hold the first run inside its window: its extraction waits for the GPUs, stopped where it stands.
    state = wait_for(
        lambda: (
            read_state(first_dir / "extract.start").get("state") == "waiting"
            and read_state(first_dir / "extract.start")
        ),
        "the first run's extraction waiting",
    )
    extraction = state["pid"]
    os.kill(extraction, signal.SIGSTOP)
    try:
        holder = wait_for(lambda: lock.is_file() and json.loads(lock.read_text()), "the first run's window")
        assert str(first_dir) in json.dumps(holder["owner"])

        second = site.play("eval.yml", specops_run_dir=str(second_dir), args=("--tags", "prefetch"))
        assert second.rc != 0
        said = second.output
        assert "specops stage 'serve' failed" in said, said[-4000:]
        assert str(first_dir) in said, said[-4000:]
        # Nothing of the first run's window was touched: the server is still down, the lock and guard its own.
        assert site.health_generate_status() != 200
        assert json.loads(lock.read_text())["token"] == holder["token"]
    finally:
        if is_extraction(extraction):
            os.kill(extraction, signal.SIGCONT)
    first.join()
    assert outcome["first"].rc == 0, outcome["first"].output[-6000:]
    assert site.health_generate_status() == 200
    assert not lock.exists() or not json.loads(lock.read_text()).get("token")
