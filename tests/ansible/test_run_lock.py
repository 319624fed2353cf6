"""run_lock: one run at a time per run directory; a second run is told who holds it;
no lock outlives its holder."""

import os
import signal
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
