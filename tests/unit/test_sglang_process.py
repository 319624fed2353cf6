"""The sglang_service role's host helper: readiness watches our server, a resume happens once, the
window guard brings the server back (stopping the window's work first), launches are validated."""

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

from specops.devserver.launch import SRC_DIR, free_port, http_status

# A run started in the background inherits SIGINT ignored, and exec keeps it ignored; with a
# handler here the processes these tests start begin with the default, so their Ctrl-C reaches them.
signal.signal(signal.SIGINT, signal.default_int_handler)

HELPER = Path(__file__).resolve().parents[2] / "roles/sglang_service/files/sglang_process.py"
SLEEPER = "import time; time.sleep(300)"


def helper(*argv: str, timeout: float = 120) -> tuple[int, dict]:
    done = subprocess.run(
        [sys.executable, str(HELPER), *argv], capture_output=True, text=True, timeout=timeout
    )
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


class Site:
    """A run directory with a spec, as the role writes it; stops whatever the spec started."""

    def __init__(self, root: Path, argv: list[str], environment: dict[str, str] | None = None):
        self.root = root
        self.spec = root / "server.json"
        self.log = root / "server.log"
        self.marker = root / "server.released"
        self.spec.write_text(
            json.dumps(
                {
                    "argv": argv,
                    "environment": environment or {},
                    "pid_file": str(root / "server.pid"),
                    "log_file": str(self.log),
                    "tree_file": str(root / "server.tree.json"),
                }
            )
        )

    def run(self, command: str, *argv: str, timeout: float = 120) -> tuple[int, dict]:
        return helper(command, "--spec", str(self.spec), *argv, timeout=timeout)

    def pid(self) -> int | None:
        return self.run("status")[1]["pid"]

    def cleanup(self) -> None:
        self.run("disarm")
        self.run("stop", "--timeout", "5")


@pytest.fixture
def site_factory(tmp_path):
    sites: list[Site] = []

    def make(argv: list[str], **kwargs) -> Site:
        root = tmp_path / f"site{len(sites)}"
        root.mkdir()
        sites.append(Site(root, argv, **kwargs))
        return sites[-1]

    yield make
    for site in sites:
        site.cleanup()


def wait_for(condition, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return condition()


# -- the server process ----------------------------------------------------------------------------
def _live_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid and _state(int(entry.name)) not in ("Z", "X", "gone"):
                    members.append(int(entry.name))
            except OSError:
                continue
    return members


def test_a_second_start_with_the_same_spec_changes_nothing(site_factory):
    site = site_factory([sys.executable, "-c", SLEEPER])
    first = site.run("start")[1]
    second = site.run("start")[1]

    assert first["changed"] is True and second["changed"] is False
    assert second["pid"] == first["pid"]


def test_a_pid_file_naming_a_later_process_is_not_our_server(site_factory):
    site = site_factory([sys.executable, "-c", SLEEPER])
    ours = site.run("start")[1]["pid"]
    pid_file = site.root / "server.pid"
    pid_file.write_text(f"{os.getpid()}\n")  # alive, but started at another time: a recycled pid
    try:
        assert site.run("status")[1]["running"] is False
    finally:
        pid_file.write_text(f"{ours}\n")
    assert site.pid() == ours


def test_stop_ends_every_process_of_the_servers_group(site_factory):
    site = site_factory([sys.executable, "-c", "import os, time; os.fork(); time.sleep(300)"])
    pid = site.run("start")[1]["pid"]
    assert wait_for(lambda: len(_live_members(pid)) == 2, 10)

    rc, result = site.run("stop", "--timeout", "5")

    assert rc == 0 and result["changed"] is True
    assert wait_for(lambda: not _live_members(pid), 10)


# -- readiness ---------------------------------------------------------------------------------
def test_ready_fails_at_once_with_the_log_when_our_server_exits(site_factory):
    site = site_factory(
        [sys.executable, "-c", "import sys, time; time.sleep(1); print('no config.json'); sys.exit(3)"]
    )
    site.run("start")
    started = time.monotonic()
    rc, result = site.run(
        "ready", "--url", f"http://127.0.0.1:{free_port()}", "--timeout", "300", "--delay", "0.2"
    )

    assert rc == 2 and time.monotonic() - started < 30
    assert "has exited" in result["msg"] and "no config.json" in result["msg"]


class Answer200(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_ready_refuses_an_answer_from_a_process_that_is_not_our_server(site_factory):
    foreign = HTTPServer(("127.0.0.1", 0), Answer200)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    site = site_factory([sys.executable, "-c", SLEEPER])
    site.run("start")
    try:
        rc, result = site.run(
            "ready", "--url", f"http://127.0.0.1:{foreign.server_port}", "--timeout", "60", "--delay", "0.2"
        )
    finally:
        foreign.shutdown()
        foreign.server_close()

    assert rc == 2
    assert f"held by pid {os.getpid()}" in result["msg"] and "not by our server" in result["msg"]
    assert result["port_holder"] == os.getpid() and result["port"] == foreign.server_port


def test_ready_names_the_port_holder_when_our_server_exited_because_the_port_was_taken(site_factory):
    foreign = HTTPServer(("127.0.0.1", 0), Answer200)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    site = site_factory([sys.executable, "-c", "import sys; print('address already in use'); sys.exit(1)"])
    site.run("start")
    try:
        assert wait_for(lambda: site.pid() is None, timeout=30)
        rc, result = site.run(
            "ready", "--url", f"http://127.0.0.1:{foreign.server_port}", "--timeout", "60", "--delay", "0.2"
        )
    finally:
        foreign.shutdown()
        foreign.server_close()

    assert rc == 2 and result["port_holder"] == os.getpid()
    assert "not by our server (it is not running)" in result["msg"]
    assert "address already in use" in result["msg"]


def test_a_start_that_waits_reports_a_server_that_cannot_come_and_the_port_holder_without_failing(
    site_factory,
):
    foreign = HTTPServer(("127.0.0.1", 0), Answer200)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    site = site_factory([sys.executable, "-c", "import sys; print('address already in use'); sys.exit(1)"])
    try:
        url = f"http://127.0.0.1:{foreign.server_port}"
        waits = ("--url", url, "--then-ready", "--ready-timeout", "60", "--delay", "0.2")
        rc, result = site.run("start", *waits)
    finally:
        foreign.shutdown()
        foreign.server_close()

    # The start itself succeeded; the role's readiness step fails on this answer, naming the holder.
    assert rc == 0 and result["changed"] and result["ready"] is False
    assert result["port_holder"] == os.getpid() and "not by our server" in result["ready_msg"]


# -- validation before a restart -----------------------------------------------------------------
def test_validate_names_a_model_path_that_is_not_a_model_directory(site_factory, tmp_path):
    site = site_factory([sys.executable, "-m", "json.tool", "--model-path", str(tmp_path / "Qwen3.6-27b")])
    rc, result = site.run("validate")

    assert rc == 2 and result["changed"] is False
    assert "sglang_service_model_path" in result["msg"] and "does not exist" in result["msg"]


def test_validate_names_a_python_without_the_launcher(site_factory, fixture_models):
    site = site_factory(
        [sys.executable, "-m", "sglang_not_installed", "--model-path", str(fixture_models.target)]
    )
    rc, result = site.run("validate")

    assert rc == 2 and "cannot import the launcher module sglang_not_installed" in result["msg"]


def test_validate_accepts_the_development_server(site_factory, fixture_models):
    site = site_factory(
        [sys.executable, "-m", "specops.devserver", "--model-path", str(fixture_models.target)],
        environment={"PYTHONPATH": str(SRC_DIR)},
    )
    assert site.run("validate")[0] == 0


# -- the window guard ----------------------------------------------------------------------------
def window_work(token: str) -> subprocess.Popen:
    """A stand-in for the extraction: a process that carries the window's token."""
    return subprocess.Popen(
        [sys.executable, "-c", SLEEPER],
        env={**os.environ, "SPECOPS_WINDOW_TOKEN": token},
        start_new_session=True,
    )


def test_guard_fires_soon_after_the_windows_work_is_gone_and_starts_the_server(site_factory):
    site = site_factory([sys.executable, "-c", SLEEPER])
    site.run("start")
    site.run("stop", "--timeout", "5")
    work = window_work("tok-gone")
    site.run("arm", "--after", "600", "--grace", "1", "--work-token", "tok-gone", "--action", "start")
    time.sleep(2)
    assert site.pid() is None, "the guard must wait while the window's work runs"

    work.send_signal(signal.SIGINT)  # Ctrl-C reaches the play's tasks
    work.wait(10)

    assert wait_for(lambda: site.pid() is not None, 30), site.log.read_text()
    assert "window's work is gone" in site.log.read_text()


def test_guard_at_max_downtime_stops_the_windows_work_before_it_starts_the_server(site_factory):
    site = site_factory([sys.executable, "-c", SLEEPER])
    work = window_work("tok-late")
    try:
        site.run("arm", "--after", "2", "--grace", "60", "--work-token", "tok-late", "--action", "start")

        assert wait_for(lambda: site.pid() is not None, 30), site.log.read_text()
        assert work.wait(15) is not None, "the window's work must be stopped before the restart"
    finally:
        if work.poll() is None:
            work.kill()
            work.wait()


def test_detached_work_does_not_hold_the_guard_and_is_stopped_when_it_fires(site_factory):
    # An async job (or a task orphaned by Ctrl-C) carries the token but hangs below PID 1: the
    # play no longer drives it, so it must neither delay the guard nor outlive it.
    site = site_factory([sys.executable, "-c", SLEEPER])
    detach = "import os, time; os.fork() and os._exit(0); print(os.getpid(), flush=True); time.sleep(300)"
    spawner = subprocess.Popen(
        [sys.executable, "-c", detach],
        env={**os.environ, "SPECOPS_WINDOW_TOKEN": "tok-async"},
        stdout=subprocess.PIPE,
        text=True,
    )
    orphan = int(spawner.stdout.readline())
    spawner.wait(10)
    spawner.stdout.close()
    try:
        site.run("arm", "--after", "600", "--grace", "1", "--work-token", "tok-async", "--action", "start")

        assert wait_for(lambda: site.pid() is not None, 30), site.log.read_text()
        assert wait_for(lambda: not Path(f"/proc/{orphan}").exists() or _state(orphan) == "Z", 15)
    finally:
        if Path(f"/proc/{orphan}").exists():
            os.kill(orphan, signal.SIGKILL)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def test_disarmed_guard_never_acts(site_factory):
    site = site_factory([sys.executable, "-c", SLEEPER])
    site.run("arm", "--after", "1", "--action", "start")
    assert site.run("disarm")[1]["changed"] is True
    time.sleep(2.5)
    assert site.pid() is None


# -- memory saver against the strict development server ----------------------------------------
@pytest.fixture
def strict_server(site_factory, fixture_models):
    """A strict development server with the memory saver, started by the helper; its URL."""
    port = free_port()
    site = site_factory(
        [
            sys.executable,
            "-m",
            "specops.devserver",
            "--model-path",
            str(fixture_models.target),
            "--port",
            str(port),
            "--enable-memory-saver",
            "--enable-weights-cpu-backup",
        ],
        environment={"PYTHONPATH": str(SRC_DIR)},
    )
    url = f"http://127.0.0.1:{port}"
    # The start waits for readiness in the same call, as the window's start does.
    rc, result = site.run("start", "--url", url, "--then-ready", "--ready-timeout", "120", "--delay", "0.2")
    assert rc == 0 and result["changed"] and result["ready"], result
    assert result["ready_at"] <= time.time()
    return site, url


def test_release_and_resume_give_the_moments_the_service_went_down_and_answered_again(strict_server):
    site, url = strict_server
    marker = ["--url", url, "--marker", str(site.marker)]
    rc, released = helper("release", *marker)
    assert rc == 0 and released["changed"], released
    rc, resumed = helper("resume", *marker, "--then-ready", "--spec", str(site.spec), "--delay", "0.2")
    assert rc == 0 and resumed["changed"] and resumed["ready"], resumed
    assert released["down_at"] < resumed["ready_at"] <= time.time()
    assert http_status(url + "/health_generate") == 200


def test_guard_and_play_both_resume_and_the_server_survives(strict_server):
    site, url = strict_server
    pid = site.pid()
    rc, released = helper("release", "--url", url, "--marker", str(site.marker), "--delay", "0.2")
    assert rc == 0 and released["changed"] is True and http_status(url + "/health_generate") == 503

    site.run("arm", "--after", "1", "--action", "resume", "--url", url, "--marker", str(site.marker))
    assert wait_for(
        lambda: not site.marker.exists() and not (site.root / "server.released.claimed").exists(), 30
    )
    rc, play_resume = helper("resume", "--url", url, "--marker", str(site.marker))

    assert rc == 0 and play_resume["changed"] is False and "nothing to resume" in play_resume["msg"]
    assert site.pid() == pid, "a second resume would have crashed the scheduler"
    assert wait_for(lambda: http_status(url + "/health_generate") == 200, 30)


def test_release_of_a_server_without_the_memory_saver_is_refused_before_anything(
    site_factory, fixture_models
):
    port = free_port()
    site = site_factory(
        [
            sys.executable,
            "-m",
            "specops.devserver",
            "--model-path",
            str(fixture_models.target),
            "--port",
            str(port),
        ],
        environment={"PYTHONPATH": str(SRC_DIR)},
    )
    site.run("start")
    url = f"http://127.0.0.1:{port}"
    assert site.run("ready", "--url", url, "--timeout", "120", "--delay", "0.2")[0] == 0
    rc, result = helper("release", "--url", url, "--marker", str(site.marker))

    assert rc == 2 and result["changed"] is False and "--enable-memory-saver" in result["msg"]
    assert not site.marker.exists() and http_status(url + "/health_generate") == 200


def test_start_with_nothing_running_refuses_settings_that_cannot_start(site_factory, tmp_path):
    site = site_factory([sys.executable, "-m", "json.tool", "--model-path", str(tmp_path / "Qwen3.6-27b")])
    rc, result = site.run("start", "--timeout", "5")

    assert rc == 2 and result["msg"].startswith("the server cannot start")
    assert "sglang_service_model_path" in result["msg"] and "does not exist" in result["msg"]
