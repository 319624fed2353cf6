# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""procfs: identity by pid + start time, trees, listeners and the window token, read from the real /proc."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import os
import socket
import subprocess
import sys
import time

from ansible_collections.specops.drafter.plugins.module_utils.common import procfs
from ansible_collections.specops.drafter.plugins.module_utils.service import readiness


def test_a_process_is_known_by_pid_and_start_time():
    me = os.getpid()
    started = procfs.start_time(me)
    assert procfs.is_same_process(me, started) and not procfs.is_same_process(me, started + 1)


def test_the_tree_holds_the_children_and_the_token_marks_the_windows_work():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             env=dict(os.environ, SPECOPS_WINDOW_TOKEN="tok-procfs"))
    try:
        assert child.pid in procfs.process_tree(os.getpid())
        assert procfs.token_processes("tok-procfs") == [child.pid]
    finally:
        child.kill()
        child.wait()


def test_the_listener_of_a_port_is_named():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        port = listener.getsockname()[1]
        inodes = procfs.listening_inodes(port)
        assert procfs.socket_owners(inodes) == {os.getpid()}
        # Looked for among given pids only: found in this process, not in another.
        assert procfs.socket_owners(inodes, pids={os.getpid()}) == {os.getpid()}
        assert procfs.socket_owners(inodes, pids={os.getppid()}) == set()
        # Held by the server's tree (this process, or its parent's tree): nobody foreign. Seen from a
        # server that is a child of ours, or from none, this process is the stranger holding the port.
        assert readiness.foreign_listener(port, os.getpid()) is None
        assert readiness.foreign_listener(port, os.getppid()) is None
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert readiness.foreign_listener(port, child.pid) == os.getpid()
        finally:
            child.kill()
            child.wait()
        assert readiness.foreign_listener(port, None) == os.getpid()
    finally:
        listener.close()


def test_a_command_line_read_here_shows_no_key():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--api-key", "k-one",
                              "--admin-api-key=k-two"])
    try:
        shown = procfs.cmdline(child.pid)
        while "--admin-api-key" not in shown and child.poll() is None:  # until it has exec'd
            time.sleep(0.02)
            shown = procfs.cmdline(child.pid)
        assert shown.endswith("--api-key <redacted> --admin-api-key=<redacted>")
        assert "k-one" not in repr(procfs.describe_tree([child.pid]))
    finally:
        child.kill()
        child.wait()


def test_sglangs_own_log_line_of_its_arguments_is_redacted():
    line = "server_args={'api_key': 'k-one', 'admin_api_key': 'k-two', 'port': 30000}"
    shown = procfs.redact_text(line)
    assert "k-one" not in shown and "k-two" not in shown and "'port': 30000" in shown
