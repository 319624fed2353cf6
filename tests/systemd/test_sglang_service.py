"""The sglang_service role on a real systemd host: a Debian root booted with systemd-nspawn.

Needs root (systemd-nspawn) and, the first time, about 3 minutes of debootstrap from the Debian
mirror apt uses; the root is cached in .work/nspawn/rootfs. The scenario lives in the role, in
roles/sglang_service/molecule/default/; its vars/nspawn.yml holds the server's settings (port 30123,
max_downtime 20 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from nspawn_host import (
    INVENTORY,
    ROOT,
    SCENARIO,
    SETTINGS,
    http_status,
    in_container,
    molecule,
    molecule_env,
    nspawn_unusable,
)

PORT = SETTINGS["sglang_service_port"]
MAX_DOWNTIME = SETTINGS["sglang_service_max_downtime"]
URL = f"http://127.0.0.1:{PORT}"
# The development server loads its model, waits its startup delay, then warms up: ~20 s after the
# unit starts on an idle machine, much longer on a loaded one. Only the wait for it is bounded by this
# (generously); when the guard acted is read from systemd, not from how soon the server answered.
STARTUP_ALLOWANCE = 30.0
# How late after max_downtime the guard may start the unit: the timer's accuracy and the guard's own
# steps, none of which waits for the server.
GUARD_LATENESS = 30.0


pytestmark = [
    pytest.mark.systemd,
    pytest.mark.slow,
    pytest.mark.skipif(nspawn_unusable() is not None, reason=str(nspawn_unusable())),
]


def _window(mode: str, seconds: int, **popen: object) -> subprocess.Popen[str]:
    """Start the scenario's GPU-window play (roles/sglang_service/molecule/default/window.yml)."""
    return subprocess.Popen(
        [
            str(ROOT / ".venv" / "bin" / "ansible-playbook"),
            "-i",
            str(INVENTORY),
            str(SCENARIO / "window.yml"),
            "-e",
            f"sglang_window_mode={mode}",
            "-e",
            f"sglang_window_seconds={seconds}",
        ],
        cwd=ROOT,
        env=molecule_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def _health() -> int:
    """The status of /health_generate; -1 when nothing answers."""
    return http_status(f"{URL}/health_generate")


def _journal() -> str:
    return in_container(
        "journalctl",
        "--no-pager",
        "--lines=60",
        "--unit=sglang-qwen.service",
        "--unit=sglang-qwen-guard.service",
    )


def _unit_moment(unit: str, moment: str) -> float:
    """A moment systemd recorded for the unit (e.g. ExecMainStart, InactiveEnter), in seconds."""
    value = in_container("systemctl", "show", f"--property={moment}TimestampMonotonic", "--value", unit)
    return int(value) / 1e6


def _main_pid() -> int:
    return int(in_container("systemctl", "show", "--property=MainPID", "--value", "sglang-qwen.service"))


def _generate() -> dict:
    body = json.dumps({"text": "def add(a, b):", "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
    request = urllib.request.Request(
        f"{URL}/generate", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def _wait(condition, timeout: float, step: float = 0.25) -> float | None:
    """Seconds until condition() held, or None after timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if condition():
            return time.monotonic() - start
        time.sleep(step)
    return None


def test_molecule_scenario_converges_idempotently_and_verifies():
    # destroy, syntax, create, converge, idempotence (changed=0), verify, destroy
    done = molecule("test")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    for step in ("converge", "idempotence", "verify"):
        assert f"{step}: Executed: Successful" in done.stdout + done.stderr, f"molecule did not run {step}"


def _lines_until(stream, marker: str, seen: list[str]) -> None:
    for line in stream:
        seen.append(line)
        if marker in line:
            return


def test_the_guard_brings_the_server_back_when_the_play_dies(converged_host):
    play = _window("stop", 600, start_new_session=True)
    seen: list[str] = []
    reader = threading.Thread(
        target=_lines_until, args=(play.stdout, "TASK [The GPU work]", seen), daemon=True
    )
    reader.start()
    try:
        reader.join(timeout=240)
        assert not reader.is_alive(), "the play never reached its GPU work:\n" + "".join(seen[-80:])
        assert _health() == -1, "the server still answers during the GPU work"
        down_at = time.monotonic()
        # Losing the control node now means the play never runs its `start`.
        os.killpg(play.pid, signal.SIGKILL)
        play.wait(timeout=30)
    finally:
        if play.poll() is None:
            os.killpg(play.pid, signal.SIGKILL)
            play.wait(timeout=30)
    assert in_container("systemctl", "is-active", "sglang-qwen-guard.service") == "active", _journal()
    # Read while the guard runs: its transient unit is collected once it has acted.
    armed_at = _unit_moment("sglang-qwen-guard.service", "ExecMainStart")

    patience = MAX_DOWNTIME + GUARD_LATENESS + 4 * STARTUP_ALLOWANCE
    back = _wait(lambda: _health() == 200, timeout=patience, step=0.5)
    assert back is not None, f"the server was not back {patience:.0f} s after the play died\n{_journal()}"
    downtime = time.monotonic() - down_at
    # The guard's deadline runs from its arming: both moments as systemd recorded them.
    started_after = _unit_moment("sglang-qwen.service", "ExecMainStart") - armed_at
    print(
        f"guard: unit started {started_after:.1f} s after the guard was armed, server down for "
        f"{downtime:.1f} s after the play died (max_downtime {MAX_DOWNTIME} s)"
    )
    # Started by the guard at its deadline: not earlier (nothing else started it), not much later.
    assert MAX_DOWNTIME - 10 <= started_after <= MAX_DOWNTIME + GUARD_LATENESS, _journal()
    assert in_container("systemctl", "is-active", "sglang-qwen.service") == "active"
    # After the server answers, the guard still writes the outage it ended (for the next run's record),
    # then exits: it is done soon after, not necessarily at the first 200.
    guard_done = _wait(
        lambda: in_container("systemctl", "is-active", "sglang-qwen-guard.service") != "active",
        timeout=4 * STARTUP_ALLOWANCE,
        step=0.5,
    )
    assert guard_done is not None, _journal()


def test_memory_saver_keeps_the_server_process_across_the_gpu_window(converged_host):
    assert _wait(lambda: _health() == 200, timeout=120) is not None
    pid_before = _main_pid()
    play = _window("memory_saver", 3)
    output, _ = play.communicate(timeout=600)
    assert play.returncode == 0, output[-6000:]
    assert _main_pid() == pid_before
    assert _health() == 200
    assert _generate()["meta_info"]["completion_tokens"] >= 1
    # No GPU here: the role says so instead of claiming the memory dropped.
    assert "GPU memory could not be checked: nvidia-smi is not available" in output
    assert in_container("systemctl", "is-active", "sglang-qwen-guard.service") != "active"


def _gpu_release_in_container(**args: object) -> tuple[int, dict]:
    """Run the gpu_release module inside the container, through the scenario's nsenter inventory."""
    with tempfile.TemporaryDirectory() as tree:
        done = subprocess.run(
            [
                str(ROOT / ".venv" / "bin" / "ansible"),
                "-i",
                str(INVENTORY),
                "nspawn",
                "-m",
                "specops.drafter.gpu_release",
                "-a",
                json.dumps(args),
                "--tree",
                tree,
            ],
            cwd=ROOT,
            env=molecule_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        results = [json.loads(p.read_text()) for p in Path(tree).iterdir()]
    assert results, done.stdout[-3000:] + done.stderr[-3000:]
    return done.returncode, results[0]


def test_gpu_release_kills_a_units_processes_by_cgroup_and_spares_another_tenant(converged_host):
    # Two services hold the same stand-in device file: the unit named to gpu_release, and another
    # tenant's. Only the named unit's process may die; the other is reported and left alone.
    hold = "import time; handle = open('/tmp/specops-gpu/nvidia0'); time.sleep(600)"
    in_container("mkdir", "-p", "/tmp/specops-gpu")
    in_container("touch", "/tmp/specops-gpu/nvidia0")
    for unit in ("specops-holder", "other-tenant"):
        in_container(
            "systemd-run", f"--unit={unit}", "--property=KillMode=process", "/usr/bin/python3", "-c", hold
        )
    try:
        assert _wait(lambda: in_container("systemctl", "is-active", "specops-holder") == "active", 10)
        holder = int(in_container("systemctl", "show", "--property=MainPID", "--value", "specops-holder"))
        tenant = int(in_container("systemctl", "show", "--property=MainPID", "--value", "other-tenant"))
        assert _wait(lambda: bool(in_container("ls", f"/proc/{holder}/fd")), 10)
        rc, result = _gpu_release_in_container(
            unit="specops-holder",
            patterns=["specops-no-such-command-line"],
            device_pattern="/tmp/specops-gpu/nvidia*",
            allow_foreign=True,
            grace=2,
            nvml="false",
        )
        assert rc == 0, result
        cgroup = in_container("cat", f"/proc/{holder}/cgroup")
        assert [k["pid"] for k in result["killed"]] == [holder], (result, cgroup)
        assert result["unit_cgroup"].endswith("specops-holder.service")
        assert tenant in [f["pid"] for f in result["foreign"]]
        assert in_container("cat", f"/proc/{tenant}/comm") == "python3", "the other tenant must survive"
        assert in_container("systemctl", "is-active", "specops-holder") != "active"
    finally:
        for unit in ("specops-holder", "other-tenant"):
            in_container("systemctl", "stop", unit)


def test_gpu_release_names_a_unit_that_does_not_exist(converged_host):
    rc, result = _gpu_release_in_container(
        unit="no-such-unit", device_pattern="/tmp/specops-gpu/nvidia*", nvml="false"
    )
    assert rc != 0
    assert "'no-such-unit.service' does not exist" in result["msg"]
