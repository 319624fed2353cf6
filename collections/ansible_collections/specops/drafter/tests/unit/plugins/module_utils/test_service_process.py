# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The process backend's stop and launch run at once, as the play and its guard run them."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import os
import sys
import threading
import time

from ansible_collections.specops.drafter.plugins.module_utils.common import procfs
from ansible_collections.specops.drafter.plugins.module_utils.service.service_process import ProcessServer

# A server whose leader exits at SIGTERM at once while a child of its group takes a second longer. SGLang's
# scheduler processes die with their parent (PR_SET_PDEATHSIG SIGKILL: sglang 0.5.23,
# srt/utils/common.py:3432-3437), but a process holding GPU memory can take seconds to go while it is freed.
LINGERING_CHILD = """
import os, signal, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time\\n"
    "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), sys.exit(0)))\\n"
    "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid()))\\n"
    "os.rename(sys.argv[1] + '.tmp', sys.argv[1])\\n"
    "time.sleep(300)", sys.argv[1]])
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
time.sleep(300)
"""
SLEEPER = "import time; time.sleep(300)"


def server(tmp_path, code, *args):
    return ProcessServer({"argv": [sys.executable, "-c", code] + [str(arg) for arg in args],
                          "pid_file": str(tmp_path / "server.pid"), "log_file": str(tmp_path / "server.log")})


def wait_for(condition, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not condition():
        time.sleep(0.01)
    return condition()


def test_a_launch_while_a_stop_is_under_way_waits_for_the_whole_group_and_keeps_its_pid_file(tmp_path):
    child_file = tmp_path / "child.pid"
    old = server(tmp_path, LINGERING_CHILD, child_file)
    old_pid = old.launch()
    assert wait_for(child_file.exists)
    child = int(child_file.read_text())
    child_started = procfs.start_time(child)

    stopper = threading.Thread(target=old.stop, args=(60.0,))
    stopper.start()
    # The guard's side: once the leader is gone it launches the new server.
    assert wait_for(lambda: old.running_pid() is None)
    new = server(tmp_path, SLEEPER)
    new_pid = new.launch()
    stopper.join()
    try:
        assert not procfs.is_same_process(child, child_started)  # the old group was gone before the launch
        assert new_pid != old_pid and new.running_pid() == new_pid  # the stop left the new pid file alone
    finally:
        new.stop(10.0)


def test_a_launch_with_our_server_running_starts_no_second_one(tmp_path):
    first = server(tmp_path, SLEEPER)
    pid = first.launch()
    try:
        assert first.launch() == pid
        assert len(procfs.group_members(pid)) == 1
    finally:
        first.stop(10.0)
    assert first.running_pid() is None and not os.path.exists(first.pid_file)
