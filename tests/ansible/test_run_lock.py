"""run_lock: one run at a time per run directory; a second run is told who holds it;
no lock outlives its holder."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from module_call import call_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run_lock(args: dict, tree: Path) -> tuple[int, dict]:
    """Run specops.drafter.run_lock as a host runs it (module_call); its exit status and result."""
    result = call_module("run_lock", args, timeout=120)
    return (1 if result["failed"] else 0), result


@pytest.fixture
def lock(tmp_path):
    """A lock path, and the holders the test started, stopped at the end."""
    holders = []
    yield tmp_path / "run" / ".specops.lock", holders
    for pid in holders:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def test_a_second_run_fails_at_once_naming_the_holder(lock, tmp_path):
    path, holders = lock
    rc, first = run_lock({"path": str(path), "owner": {"playbook": "eval one"}}, tmp_path)
    assert rc == 0 and first["changed"] is False, first
    holders.append(first["holder"]["pid"])
    started = time.monotonic()
    rc, second = run_lock({"path": str(path), "owner": {"playbook": "eval two"}}, tmp_path)
    assert rc != 0 and time.monotonic() - started < 60
    holder = first["holder"]
    for detail in (
        f"pid {holder['pid']}",
        f"on host {holder['host']}",
        f"since {holder['started']}",
        "playbook eval one",
    ):
        assert detail in second["msg"], second["msg"]


def test_a_released_lock_can_be_taken_by_the_next_run(lock, tmp_path):
    path, holders = lock
    _, first = run_lock({"path": str(path)}, tmp_path)
    holders.append(first["holder"]["pid"])
    rc, released = run_lock({"path": str(path), "state": "released", "token": first["token"]}, tmp_path)
    assert rc == 0, released
    rc, second = run_lock({"path": str(path)}, tmp_path)
    assert rc == 0, second
    holders.append(second["holder"]["pid"])


def test_release_with_another_runs_token_leaves_the_lock_held(lock, tmp_path):
    path, holders = lock
    _, first = run_lock({"path": str(path)}, tmp_path)
    holders.append(first["holder"]["pid"])
    run_lock({"path": str(path), "state": "released", "token": "not-the-holders"}, tmp_path)
    rc, second = run_lock({"path": str(path)}, tmp_path)
    assert rc != 0 and "is held by another run" in second["msg"]


def test_a_crashed_holder_does_not_keep_the_lock(lock, tmp_path):
    path, holders = lock
    _, first = run_lock({"path": str(path)}, tmp_path)
    os.kill(first["holder"]["pid"], signal.SIGKILL)  # the kernel drops a flock with its last holder
    rc, second = run_lock({"path": str(path)}, tmp_path)
    assert rc == 0, second
    holders.append(second["holder"]["pid"])


def test_the_lock_lapses_after_max_seconds(lock, tmp_path):
    path, holders = lock
    _, first = run_lock({"path": str(path), "max_seconds": 1}, tmp_path)
    holders.append(first["holder"]["pid"])
    time.sleep(2)
    rc, second = run_lock({"path": str(path)}, tmp_path)
    assert rc == 0, second
    holders.append(second["holder"]["pid"])


def test_over_ssh_the_lock_follows_the_session_and_lapses_after_it(lock, tmp_path):
    """The module run through an sshd session (a process titled as OpenSSH titles one): the lock holds while
    the session lives, and lapses lapse_seconds after it is gone with nothing of the run left."""
    path, holders = lock
    args, result = tmp_path / "args.json", tmp_path / "result.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {"path": str(path), "lapse_seconds": 1}}))
    module = "ansible_collections.specops.drafter.plugins.modules.run_lock"
    # exec -a gives the session's shell the title sshd gives a connection; the module runs below it.
    session = subprocess.Popen(
        [
            "bash",
            "-c",
            'exec -a "sshd: tester@notty" bash -c "$0"',
            f"{shlex.quote(sys.executable)} -m {module} {args} > {result}; exec sleep 600",
        ],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "collections"), os.environ.get("PYTHONPATH", "")]),
        },
    )
    try:
        # A bound for a loaded machine, not an expectation: the module answers within a second or two.
        deadline = time.monotonic() + 120
        while not (result.is_file() and result.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        first = json.loads(result.read_text())
        holders.append(first["holder"]["pid"])
        assert first["holder"]["play"]["kind"] == "ssh session", first
        assert first["holder"]["play"]["pid"] == session.pid

        rc, second = run_lock({"path": str(path)}, tmp_path)
        assert rc != 0 and f"its ssh session, pid {session.pid}" in second["msg"], second["msg"]
    finally:
        session.kill()
        session.wait()
    # The holder looks once a second; a bound for a loaded machine, not an expectation.
    deadline = time.monotonic() + 120
    while True:
        rc, third = run_lock({"path": str(path)}, tmp_path)
        if rc == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert rc == 0, third
    holders.append(third["holder"]["pid"])
