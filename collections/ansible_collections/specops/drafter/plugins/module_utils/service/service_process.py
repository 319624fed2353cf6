# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The process backend: one detached server per spec, known by pid + start time, stopped with its whole tree.

A spec is what a unit is to systemd: {"argv", "environment", "working_dir", "pid_file", "log_file"}.
Standard library only: the guard starts servers with it outside Ansible.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

# The guard runs this outside Ansible, where there is no AnsibleModule.run_command or exit_json.
# pylint: disable=ansible-bad-function

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import time

from ansible_collections.specops.drafter.plugins.module_utils.common import procfs
from ansible_collections.specops.drafter.plugins.module_utils.common.state_files import (
    ensure_dir,
    read_json,
    remove,
    tail,
    write_json,
)
from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError


def option_after(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def spec_digest(spec: dict) -> str:
    # What makes two launches "the same server": the command, its environment and directory.
    relevant = dict((key, spec.get(key)) for key in ("argv", "environment", "working_dir"))
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode("utf-8")).hexdigest()


def check_spec(spec: dict | None) -> dict:
    for key in ("argv", "pid_file", "log_file"):
        if not (spec or {}).get(key):
            raise ServiceError("the process backend needs spec.%s (the role builds the spec from its settings)" % key)
    return dict(spec or {})


def launch_problems(spec: dict) -> list[str]:
    """What would keep the server from starting, each naming its setting."""
    argv = [str(arg) for arg in spec["argv"]]
    python = argv[0]
    problems = []
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        problems.append("sglang_service_python %s is not an executable file" % python)
    module = option_after(argv, "-m")
    if module and not problems:
        env = dict(os.environ)
        env.update(dict((str(k), str(v)) for k, v in (spec.get("environment") or {}).items()))
        finder = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"
        probe = subprocess.run(
            [python, "-c", finder, module], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=env, cwd=spec.get("working_dir") or "/", check=False,
        )
        if probe.returncode != 0:
            problems.append(
                "%s cannot import the launcher module %s (sglang_service_launcher_module): install it there "
                "or point sglang_service_python at the Python that has it" % (python, module)
            )
    model = option_after(argv, "--model-path")
    if model is not None and not os.path.isfile(os.path.join(model, "config.json")):
        problems.append(
            "sglang_service_model_path %s is not a model directory (no config.json)%s"
            % (model, "" if os.path.isdir(model) else ": it does not exist")
        )
    return problems


class ProcessServer(object):
    """The server a spec starts; a reused pid is never taken for it."""

    def __init__(self, spec: dict) -> None:
        self.spec = check_spec(spec)
        self.pid_file = self.spec["pid_file"]
        self.identity_file = self.pid_file + ".json"
        self.log_file = self.spec["log_file"]

    def running_pid(self) -> int | None:
        try:
            with open(self.pid_file) as handle:
                pid = int(handle.read().split()[0])
        except (IOError, OSError, ValueError, IndexError):
            return None
        # The start time tells our server from a later process with the same pid (setproctitle
        # renames SGLang's processes, so the command line cannot).
        started = (read_json(self.identity_file, {}) or {}).get("start_time")
        return pid if procfs.is_same_process(pid, None if started is None else int(started)) else None

    def matches_spec(self) -> bool:
        return (read_json(self.identity_file, {}) or {}).get("digest") == spec_digest(self.spec)

    def log_tail(self) -> str:
        return procfs.redact_text(tail(self.log_file))

    def log_source(self) -> str:
        return self.log_file

    @contextlib.contextmanager
    def _one_at_a_time(self):
        """Stops and launches of this server run one at a time, across processes: the guard may fire while
        the play's stop waits for the last of the old group, and its launch must not start into that group,
        nor write a pid file the stop then removes. A stop holds the lock for at most its timeout + 10 s."""
        ensure_dir(os.path.dirname(os.path.abspath(self.pid_file)))
        with open(self.pid_file + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when its holder dies
            yield

    def launch(self) -> int:
        """Start the server detached (own session and process group, output appended to the log file), once
        any stop under way has ended; a server of ours already running is not started twice."""
        with self._one_at_a_time():
            running = self.running_pid()
            return running if running is not None else self._launch()

    def _launch(self) -> int:
        problems = launch_problems(self.spec)
        if problems:
            raise ServiceError("the server cannot start: " + "; ".join(problems))
        for path in (self.log_file, self.pid_file):
            ensure_dir(os.path.dirname(os.path.abspath(path)))
        env = dict(os.environ)
        env.pop(procfs.WINDOW_TOKEN_VARIABLE, None)  # the server is not the window's work
        env.pop(procfs.RUN_LOCK_VARIABLE, None)  # nor part of the run: it outlives it
        env.update(dict((str(k), str(v)) for k, v in (self.spec.get("environment") or {}).items()))
        argv = [str(arg) for arg in self.spec["argv"]]
        with open(self.log_file, "ab") as log, open(os.devnull, "rb") as devnull:
            shown = " ".join(procfs.redact_argv(argv))
            log.write(("--- %s starting: %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), shown)).encode())
            log.flush()
            try:
                # Own session and process group: stop signals every child, and the play's end does not reach it.
                child = subprocess.Popen(argv, stdin=devnull, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.spec.get("working_dir") or "/", env=env, close_fds=True,
                                         start_new_session=True)
            except OSError as error:
                raise ServiceError("cannot start %s: %s (check sglang_service_python)" % (argv[0], error))
        with open(self.pid_file, "w") as handle:
            handle.write("%d\n" % child.pid)
        # The command line as shown elsewhere: its keys redacted (the digest tells a changed spec).
        write_json(self.identity_file, {"digest": spec_digest(self.spec), "start_time": procfs.start_time(child.pid),
                                        "argv": procfs.redact_argv(argv)})
        return child.pid

    def stop(self, timeout: float, tree_file: str = "") -> dict:
        """SIGTERM the process group, SIGKILL what is left after timeout seconds; records the tree first."""
        with self._one_at_a_time():
            return self._stop(timeout, tree_file)

    def _stop(self, timeout: float, tree_file: str) -> dict:
        pid = self.running_pid()
        if pid is None:
            remove(self.pid_file)
            remove(self.identity_file)
            return {"changed": False, "pid": None}
        if tree_file:
            write_json(tree_file, procfs.describe_tree(procfs.process_tree(pid)))
        down_at = time.time()
        killed = stop_group(pid, timeout)
        remove(self.pid_file)
        remove(self.identity_file)
        return {"changed": True, "pid": pid, "sigkill": killed, "down_at": down_at}


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except OSError as error:
        if error.errno != errno.ESRCH:
            raise


def stop_group(pgid: int, timeout: float) -> bool:
    """SIGTERM, then SIGKILL after timeout; True when SIGKILL was needed."""
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and procfs.group_members(pgid):
        time.sleep(0.1)
    if not procfs.group_members(pgid):
        return False
    _signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and procfs.group_members(pgid):
        time.sleep(0.1)
    if procfs.group_members(pgid):
        raise ServiceError("process group %d survived SIGKILL for 10 s (stuck in the kernel? see `ps -g %d`)"
                           % (pgid, pgid))
    return True


def stop_processes(pids: list[int], grace: float = 10.0) -> list[int]:
    """SIGTERM each, SIGKILL what outlives grace; only the processes that started when we looked."""
    known = [(pid, procfs.start_time(pid)) for pid in pids]
    for pid, dummy in known:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            continue
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(procfs.is_same_process(p, s) for p, s in known):
        time.sleep(0.1)
    for pid, started in known:
        if procfs.is_same_process(pid, started):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
    return [pid for pid, dummy in known]
