"""specops.drafter.sglang_service as a host runs it, against the development server: states and the guard.

The development server runs from .venv-ml with the memory saver; every test starts its own server
through the module's process backend, so a test never inherits another's window.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from specops.devserver.launch import free_port, http_status

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_service_site import FIXTURES, ML_PYTHON, Site, module_env, wait_for, window  # noqa: E402

pytestmark = pytest.mark.skipif(not ML_PYTHON.exists(), reason="needs the ML environment (.venv-ml)")

MEMORY_SAVER = ("--enable-memory-saver", "--enable-weights-cpu-backup")
SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


@pytest.fixture(scope="module", autouse=True)
def fixture_models():
    if not (FIXTURES / "target/config.json").exists():
        subprocess.run(
            [
                str(ML_PYTHON),
                "-c",
                "import sys; from specops.fixtures import build_fixtures; "
                "build_fixtures(sys.argv[1], train_reference=False)",
                str(FIXTURES),
            ],
            check=True,
            env=dict(os.environ, PYTHONPATH="src"),
            timeout=900,
        )


@pytest.fixture
def site_factory(tmp_path):
    sites: list[Site] = []

    def make(*flags: str, argv: list[str] | None = None) -> Site:
        sites.append(Site(tmp_path / f"site{len(sites)}", *flags, argv=argv))
        return sites[-1]

    yield make
    for site in sites:
        site.cleanup()


@pytest.fixture
def serving(site_factory) -> Site:
    site = site_factory(*MEMORY_SAVER)
    started = site.run("started")
    assert started["changed"] and not started["failed"], started.get("msg")
    return site


# -- memory saver ----------------------------------------------------------------------------------
def test_released_then_resumed_keeps_the_pid_and_serves(serving):
    pid = serving.pid()
    released = serving.run("released", window=window("w-keep"))
    assert released["changed"] and not released["failed"], released.get("msg")
    assert released["guard"]["armed"] and released["down_at"] and released["pause_mode"]

    resumed = serving.run("resumed", window=window("w-keep"))

    assert resumed["changed"] and not resumed["failed"], resumed.get("msg")
    assert serving.pid() == pid and resumed["pid"] == pid
    assert released["down_at"] < resumed["ready_at"] <= time.time()
    assert http_status(serving.url + "/health_generate") == 200
    assert (
        not (serving.state_dir / "window.lock").exists() and not (serving.state_dir / "guard.json").exists()
    )


def test_a_release_of_weights_without_cpu_backup_is_refused_before_anything_is_touched(site_factory):
    site = site_factory("--enable-memory-saver")
    assert not site.run("started")["failed"]

    refused = site.run("released", window=window("w-nobackup"))

    assert refused["failed"] and "--enable-weights-cpu-backup" in refused["msg"]
    assert "garbage" in refused["msg"] and "sglang_service_release_tags" in refused["msg"]
    assert not (site.state_dir / "window.lock").exists() and not (site.state_dir / "released.json").exists()
    # Not paused: a paused server answers /health_generate 503.
    assert http_status(site.url + "/health_generate") == 200


class FakeSglang(BaseHTTPRequestHandler):
    """SGLang 0.5.23 as far as a release goes, with a pause that fails; records every call."""

    calls: list[tuple[str, object]] = []

    def log_message(self, *args) -> None:
        pass

    def _answer(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.calls.append((self.path, None))
        if self.path in ("/server_info", "/get_server_info"):
            self._answer(
                200, {"version": "0.5.23", "enable_memory_saver": True, "enable_weights_cpu_backup": True}
            )
        else:
            self._answer(200, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        self.calls.append((self.path, body))
        self._answer(500 if self.path == "/pause_generation" else 200, {"error": "scheduler is gone"})


def test_a_pause_that_fails_is_continued_and_the_window_given_back(site_factory):
    FakeSglang.calls = []
    server = HTTPServer(("127.0.0.1", free_port()), FakeSglang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    site = site_factory(argv=SLEEPER)
    try:
        failed = site.run("released", url=f"http://127.0.0.1:{server.server_port}", window=window("w-pause"))
    finally:
        server.shutdown()

    posts = [(path, body) for path, body in FakeSglang.calls if body is not None]
    assert (
        failed["failed"] and "pause_generation" in failed["msg"] and "generation continued" in failed["msg"]
    )
    assert posts[0] == ("/pause_generation", {"mode": "retract"})
    assert ("/continue_generation", {}) in posts and not any("release" in path for path, _ in posts)
    assert not (site.state_dir / "window.lock").exists() and not (site.state_dir / "released.json").exists()


# -- the window lock -------------------------------------------------------------------------------
def test_a_second_runs_window_is_refused_naming_the_holder(serving):
    first = serving.run("released", window=window("w-first"))
    assert first["changed"] and not first["failed"], first.get("msg")

    second = serving.run("stopped", window=window("w-second"))

    assert second["failed"] and "test run w-first" in second["msg"]
    assert second["window_holder"]["token"] == "w-first"
    assert serving.pid() is not None
    assert not serving.run("resumed", window=window("w-first"))["failed"]


# -- the guard -------------------------------------------------------------------------------------
def test_the_guard_fires_after_the_operators_max_downtime_when_it_is_shorter_than_planned(serving):
    before = serving.pid()
    armed = time.monotonic()
    stopped = serving.run("stopped", window=window("w-bound", guard_after=600, max_downtime=2))
    assert stopped["changed"] and stopped["guard"]["fires_in"] == 2

    # Bounds, not expectations, well short of the planned 600 s: the operator's 2 s is what fired it.
    assert wait_for(lambda: serving.pid() not in (None, before), 300), serving.guard_log()
    assert time.monotonic() - armed < 300
    assert "max_downtime" in serving.guard_log()
    assert wait_for(lambda: http_status(serving.url + "/health_generate") == 200, 600)
    assert not (serving.state_dir / "window.lock").exists()


def test_the_guards_resume_after_the_server_was_killed_starts_it(serving):
    released = serving.run("released", window=window("w-killed", max_downtime=8))
    assert released["changed"], released.get("msg")
    killed = serving.pid()
    os.killpg(killed, signal.SIGKILL)

    assert wait_for(lambda: serving.pid() not in (None, killed), 300), serving.guard_log()
    assert wait_for(lambda: http_status(serving.url + "/health_generate") == 200, 600)
    assert "started_pid" in serving.guard_log() and not (serving.state_dir / "released.json").exists()


def test_exactly_one_resume_when_the_play_and_the_guard_race(serving):
    pid = serving.pid()
    released = serving.run("released", window=window("w-race", max_downtime=1))
    assert released["changed"], released.get("msg")

    resumed = serving.run("resumed", window=window("w-race"))

    assert not resumed["failed"], resumed.get("msg")
    assert wait_for(
        lambda: "guard" in serving.guard_log() or not (serving.state_dir / "guard.json").exists(), 120
    )
    time.sleep(2)
    assert serving.pid() == pid, (
        "a second resume would have crashed the scheduler:\n" + serving.log.read_text()
    )
    assert http_status(serving.url + "/health_generate") == 200


def test_the_guard_fires_soon_after_the_windows_work_is_gone(serving):
    token = "w-work"
    work = subprocess.Popen(SLEEPER, env={**os.environ, "SPECOPS_WINDOW_TOKEN": token})
    # Planned downtime and the operator's bound an hour away: only the work's end can make it fire.
    stopped = serving.run(
        "stopped",
        window=window(token, guard_grace=1, guard_after=3600, max_downtime=3600),
        env=module_env(SPECOPS_WINDOW_TOKEN=token),
    )
    assert stopped["changed"], stopped.get("msg")
    time.sleep(3)
    assert serving.pid() is None, "the guard must wait while the window's work runs"

    work.send_signal(signal.SIGINT)
    work.wait(120)

    # Bounds, not expectations: a loaded machine stretches the guard's look and the server's launch.
    assert wait_for(lambda: serving.pid() is not None, 600), serving.guard_log()
    assert "window's work is gone" in serving.guard_log()


def test_a_windows_start_that_fails_arms_the_guard_again(serving):
    stopped = serving.run("stopped", window=window("w-again", max_downtime=600))
    assert stopped["changed"] and serving.pid() is None
    crashing = dict(serving.args("started")["spec"], argv=[sys.executable, "-c", "import sys; sys.exit(3)"])

    failed = serving.run("started", window=window("w-again", max_downtime=600), spec=crashing)

    assert failed["failed"] and "the guard is armed again" in failed["msg"], failed.get("msg")
    guard = failed["guard"]["pid"]
    assert Path(f"/proc/{guard}").exists() and _state(guard) != "Z"
    assert json.loads((serving.state_dir / "window.lock").read_text())["token"] == "w-again"
    # The play's next start (its rerun) takes over from that guard and ends the window.
    started = serving.run("started", window=window("w-again"))
    assert not started["failed"] and started["guard"]["disarmed"] is True, started.get("msg")
    assert not (serving.state_dir / "window.lock").exists()


def test_a_disarmed_guard_never_acts(serving):
    stopped = serving.run("stopped", window=window("w-disarm", max_downtime=600))
    assert stopped["changed"] and serving.pid() is None
    guard = stopped["guard"]["pid"]

    started = serving.run("started", window=window("w-disarm"))

    assert started["guard"]["disarmed"] is True
    # The window's own start finds the server down by design: nothing to announce.
    assert started["found_down"] is False
    assert wait_for(lambda: not Path(f"/proc/{guard}").exists() or _state(guard) == "Z", 120)
    assert "fired" not in serving.guard_log()
    assert not (serving.state_dir / "window.lock").exists()


# -- check mode ------------------------------------------------------------------------------------
def _files(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under a directory with its size and modification time."""
    if not directory.exists():
        return {}
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*") if p.is_file()}


def test_check_mode_writes_nothing(serving):
    # The serving server's state (its process tree, from the real start) stays exactly as it was.
    before = _files(serving.state_dir)
    for state in ("released", "stopped", "restarted"):
        planned = serving.run(state, check=True, window=window("w-check"))
        assert planned["changed"] and not planned["failed"], planned.get("msg")
    assert _files(serving.state_dir) == before
    assert http_status(serving.url + "/health_generate") == 200


# -- the process, readiness and the port -----------------------------------------------------------
def test_a_second_start_with_the_same_spec_changes_nothing(serving):
    pid = serving.pid()
    again = serving.run("started")
    assert again["changed"] is False and again["pid"] == pid and again["found_down"] is False


def test_a_server_found_dead_outside_a_window_is_started_and_said_to_be_found_down(serving):
    killed = serving.pid()
    os.killpg(killed, signal.SIGKILL)
    assert wait_for(lambda: serving.pid() is None, 60)

    planned = serving.run("started", check=True)
    started = serving.run("started")

    assert planned["changed"] and planned["found_down"] and planned["pid"] is None
    assert started["changed"] and started["found_down"] and not started["failed"], started.get("msg")
    assert started["pid"] not in (None, killed) and http_status(serving.url + "/health_generate") == 200


def test_stop_ends_every_process_of_the_servers_tree_and_records_it(site_factory):
    forker = [
        sys.executable,
        "-c",
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)",
    ]
    site = site_factory(argv=forker)
    site.argv = forker
    spec = site.args("started")["spec"]
    from ansible_collections.specops.drafter.plugins.module_utils.service_process import ProcessServer

    server = ProcessServer(spec)
    pid = server.launch()
    time.sleep(1)
    stopped = site.run("stopped", window=window("w-tree"), guard=False)

    recorded = json.loads(Path(stopped["recorded_tree"]).read_text())
    assert stopped["changed"] and len(recorded) == 2 and recorded[0]["pid"] == pid
    assert all(
        not Path(f"/proc/{entry['pid']}").exists() or _state(entry["pid"]) == "Z" for entry in recorded
    )


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def test_started_refuses_an_answer_from_a_process_that_is_not_ours_and_names_the_port_holder(site_factory):
    site = site_factory(*MEMORY_SAVER)
    with subprocess.Popen(
        [
            str(ML_PYTHON),
            "-m",
            "specops.devserver",
            "--model-path",
            str(FIXTURES / "target"),
            "--port",
            str(site.port),
        ],
        env=dict(os.environ, PYTHONPATH="src"),
    ) as stranger:
        try:
            assert wait_for(lambda: http_status(site.url + "/health_generate") == 200, 120)
            refused = site.run("started")
        finally:
            stranger.terminate()
    assert refused["failed"] and refused["port_holder"] == stranger.pid
    assert f"pid {stranger.pid}" in refused["msg"] and site.pid() is None


def test_a_start_with_settings_that_cannot_start_names_the_setting(site_factory, tmp_path):
    site = site_factory(
        argv=[sys.executable, "-m", "json.tool", "--model-path", str(tmp_path / "Qwen3.6-27b")]
    )
    refused = site.run("started")
    assert (
        refused["failed"]
        and "sglang_service_model_path" in refused["msg"]
        and "does not exist" in refused["msg"]
    )
