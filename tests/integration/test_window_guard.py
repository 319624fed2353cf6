"""Ctrl-C of ansible-playbook inside a GPU window on a host without systemd: the host-side guard
notices the window's work is gone, stops what is left of it and brings the service back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# A run started in the background inherits SIGINT ignored, and exec keeps it ignored; with a
# handler here the processes these tests start begin with the default, so their Ctrl-C reaches them.
signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"

WINDOW = """
- name: A GPU window that is interrupted
  hosts: gpu_hosts
  gather_facts: false
  tasks:
    - name: Take the service down
      ansible.builtin.include_role:
        name: sglang_service
      vars:
        sglang_service_state: stopped
    - name: The window's work
      ansible.builtin.command:
        argv: [sleep, "600"]
      changed_when: false
  environment:
    SPECOPS_WINDOW_TOKEN: "{{ sglang_service_window_token }}"
"""


def test_ctrl_c_inside_the_window_brings_the_service_back(served, tmp_path):
    # The shared site's server: the guard log is read from where it stood before this window.
    site = served
    pid_before = site.server_pid()
    assert pid_before is not None and site.health_generate_status() == 200
    guard_log = site.work_dir / "sglang.pid.d" / "guard.log"
    logged = guard_log.stat().st_size if guard_log.exists() else 0
    playbook = tmp_path / "window.yml"
    playbook.write_text(WINDOW)
    token = f"guard-test-{os.getpid()}"
    # specops_root: the inventory derives it from the playbook's directory, here a temporary one.
    extra = site.extra_vars(
        specops_root=str(REPO),
        sglang_service_window_token=token,
        sglang_service_guard_grace=5,
        sglang_service_max_downtime=3600,
    )
    play = subprocess.Popen(
        [str(ANSIBLE_PLAYBOOK), str(playbook), "-e", json.dumps(extra)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")},
        start_new_session=True,  # a terminal of its own: Ctrl-C reaches its whole process group
    )
    output = ""
    try:
        for line in play.stdout:
            output += line
            if "TASK [The window's work]" in line:
                break
        time.sleep(3)
        assert site.health_generate_status() == -1, "the window must have stopped the service"
        os.killpg(play.pid, signal.SIGINT)  # Ctrl-C: rescue/always never run
        output += play.communicate(timeout=60)[0]
    finally:
        if play.poll() is None:
            os.killpg(play.pid, signal.SIGKILL)
            play.wait()

    deadline = time.monotonic() + 180
    while site.health_generate_status() != 200 and time.monotonic() < deadline:
        time.sleep(1)
    assert site.health_generate_status() == 200, output[-3000:]
    assert site.server_pid() not in (None, pid_before)
    log = guard_log.read_bytes()[logged:].decode(errors="replace")
    assert "window's work is gone" in log, log[-3000:]
    assert not window_work_left(token), "the guard stops the window's work before the restart"


def window_work_left(token: str) -> list[int]:
    left = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if f"SPECOPS_WINDOW_TOKEN={token}".encode() in handle.read().split(b"\0"):
                    left.append(pid)
        except OSError:
            continue
    return left
