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


def test_ctrl_c_inside_the_window_brings_the_service_back(own_local_default, tmp_path):
    site = own_local_default
    started = site.play("service.yml", sglang_service_state="started")
    assert started.rc == 0, started.output[-4000:]
    pid_before = site.server_pid()
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
    log = (site.work_dir / "sglang.pid.d" / "guard.log").read_text()
    assert "window's work is gone" in log
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
