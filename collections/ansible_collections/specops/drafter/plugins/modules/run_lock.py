#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: run_lock
short_description: One run at a time per host and run directory
description:
  - V(acquired) takes an exclusive C(flock) on O(path) and leaves a small process on the host that holds it
    until V(released), until O(max_seconds) have passed, or until the process dies (the kernel drops the
    lock with it), so a crashed run never holds it forever.
  - The lock file records who holds it (pid of the holding process, host, start time, playbook, owner);
    a second run fails at once and says so.
  - Where the module runs below C(ansible-playbook) on the same host (a local connection), the holder also
    watches that process - once it is gone (killed with the control node) and no process carries
    C(SPECOPS_RUN_LOCK=<token>) in its environment any more (the guard that brings the service back, the
    window's work; eval.yml exports it to every task), the holder gives the lock up, so a rerun proceeds
    without anyone stopping it by hand.
  - Over SSH the holder watches the connection's C(sshd) session process instead (Ansible's default
    C(ControlPersist) keeps one session for the whole play, and ends it about a minute after the control
    node is gone); once it is gone and no process has carried the token for O(lapse_seconds), the lock
    lapses. Without such an anchor (an ad-hoc command) only O(max_seconds) ends it.
  - The lock is state of a running play, not of the host, so the module never reports C(changed).
version_added: "0.1.0"
author:
  - specops maintainers (@specops)
options:
  path:
    description: Lock file; its directory is created if missing.
    type: path
    required: true
  state:
    description: V(acquired) takes the lock (failing if another run holds it); V(released) gives it back.
    type: str
    choices: [acquired, released]
    default: acquired
  token:
    description:
      - With V(released), the token V(acquired) returned; only the holder with this token is stopped, so a
        run never releases another run's lock. Without it (the lock was never taken) nothing happens.
    type: str
  max_seconds:
    description: The holding process gives the lock up after this many seconds even if never released.
    type: int
    default: 43200
  lapse_seconds:
    description:
      - Over SSH, how long after the session is gone the run's processes must have been absent before the
        lock lapses (a play without C(ControlPersist) opens a session per task, and the gap between two
        tasks must not free the lock).
    type: int
    default: 120
  owner:
    description: What to record about the run (e.g. the playbook and the control node), shown to a second run.
    type: dict
    default: {}
attributes:
  check_mode:
    support: full
    description: Reports whether the lock is free; takes and releases nothing.
  diff_mode:
    support: none
    description: Nothing to diff.
"""

EXAMPLES = r"""
- name: Take the run directory's lock
  specops.drafter.run_lock:
    path: /srv/specops/run/.specops.lock
    owner:
      playbook: "{{ ansible_play_name }}"
  register: lock

- name: Give it back
  specops.drafter.run_lock:
    path: /srv/specops/run/.specops.lock
    state: released
    token: "{{ lock.token }}"
"""

RETURN = r"""
token:
  description: Identifies this holder, for V(released).
  returned: when the lock was acquired
  type: str
holder:
  description: What the lock file records about the holder (pid, host, started, expires, owner).
  returned: always
  type: dict
"""

import errno
import fcntl
import json
import os
import signal
import socket
import time
import uuid

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.specops.drafter.plugins.module_utils.common import procfs

PLAY_COMMAND = "ansible-playbook"
# The title of OpenSSH's per-connection process (sshd-session since OpenSSH 9.8).
SSH_SESSION_TITLES = ("sshd:", "sshd-session:")


def play_process():
    """What this run lives as on this host: the ansible-playbook process this module runs under (its top
    one: the workers are its forks) under a local connection, else the sshd session it came through, as
    {pid, starttime, kind}; None for an ad-hoc command run some other way."""
    table = procfs.parents()
    found = session = None
    pid = os.getppid()
    while pid > 1:
        line = procfs.cmdline(pid)
        if PLAY_COMMAND in line:
            found = pid
        elif session is None and line.startswith(SSH_SESSION_TITLES):
            session = pid
        pid = table.get(pid, 1)
    if found:
        return {"pid": found, "starttime": procfs.start_time(found), "kind": PLAY_COMMAND}
    if session:
        return {"pid": session, "starttime": procfs.start_time(session), "kind": "ssh session"}
    return None


def run_carriers(token):
    """Processes (this one excepted) whose environment holds SPECOPS_RUN_LOCK=<token>."""
    wanted = ("%s=%s" % (procfs.RUN_LOCK_VARIABLE, token)).encode()
    found = []
    for pid in procfs.list_pids():
        if pid == os.getpid() or procfs.is_gone(pid):
            continue
        try:
            with open("/proc/%d/environ" % pid, "rb") as handle:
                if wanted in handle.read().split(b"\0"):
                    found.append(pid)
        except (IOError, OSError):
            continue
    return found


class RunWatch(object):
    """Whether the run that took the lock is over: its anchor (the play, or the ssh session) is gone and
    nothing of its run (its guard, its work) is left; over SSH, left for lapse_seconds."""

    def __init__(self, holder, lapse_seconds, clock=time.monotonic):
        self.holder = holder
        self.clock = clock
        play = holder.get("play") or {}
        self.lapse = float(lapse_seconds) if play.get("kind") == "ssh session" else 0.0
        self.carried_at = clock()

    def over(self):
        play = self.holder.get("play")
        if not play or procfs.is_same_process(int(play["pid"]), play.get("starttime")):
            return False
        if run_carriers(self.holder["token"]):
            self.carried_at = self.clock()
            return False
        return self.clock() - self.carried_at >= self.lapse


def read_holder(path):
    try:
        with open(path) as handle:
            return json.loads(handle.read() or "{}")
    except (IOError, OSError, ValueError):
        return {}


# How often the holder looks for its play and its run's processes.
WATCH_S = 1.0


def try_lock(fd):
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except (IOError, OSError) as error:
        if error.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
        raise


def describe(holder):
    owner = holder.get("owner") or {}
    what = ", ".join("%s %s" % (key, value) for key, value in sorted(owner.items()))
    return "pid %s on host %s since %s%s" % (
        holder.get("pid", "?"), holder.get("host", "?"), holder.get("started", "?"),
        " (%s)" % what if what else "")


class RunLock(object):
    """Take or give back the lock; the holding process is a detached child that owns the locked file."""

    def __init__(self, module):
        self.module = module
        self.path = module.params["path"]

    def run(self):
        if self.module.params["state"] == "released":
            return self.release()
        return self.acquire()

    def busy(self, holder):
        self.module.fail_json(
            msg="%s is held by another run: %s; wait for it to finish%s, or if that run is gone stop pid %s "
                "(the lock is given up at %s at the latest)"
                % (self.path, describe(holder),
                   " (the lock lapses once its %s, pid %s, and the processes of its run, its guard "
                   "included, are gone)" % (holder["play"].get("kind", PLAY_COMMAND), holder["play"]["pid"])
                   if holder.get("play") else "",
                   holder.get("pid", "?"), holder.get("expires", "?")),
            holder=holder)

    def acquire(self):
        directory = os.path.dirname(self.path)
        if directory and not os.path.isdir(directory) and not self.module.check_mode:
            os.makedirs(directory)
        if self.module.check_mode:
            if os.path.exists(self.path):
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    if not try_lock(fd):
                        self.busy(read_holder(self.path))
                finally:
                    os.close(fd)
            return {"changed": False, "holder": {}}
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if not try_lock(fd):
            os.close(fd)
            self.busy(read_holder(self.path))
        now = time.time()
        max_seconds = self.module.params["max_seconds"]
        holder = {
            "token": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "expires": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + max_seconds)),
            "owner": self.module.params["owner"],
            "play": play_process(),
        }
        holder["pid"] = self.spawn_holder(fd, holder, max_seconds)
        os.close(fd)
        return {"changed": False, "token": holder["token"], "holder": holder}

    def spawn_holder(self, fd, holder, max_seconds):
        """Fork a detached process that keeps `fd` (and so the lock) until released or expired."""
        ready_read, ready_write = os.pipe()
        first = os.fork()
        if first == 0:
            os.close(ready_read)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            os.chdir("/")
            null = os.open(os.devnull, os.O_RDWR)
            for stream in (0, 1, 2):
                os.dup2(null, stream)
            record = dict(holder, pid=os.getpid())
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record, sort_keys=True) + "\n").encode("utf-8"), 0)
            os.fsync(fd)
            # The kernel's default action: SIGTERM ends the holder even while it sleeps.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.write(ready_write, str(os.getpid()).encode("ascii"))
            os.close(ready_write)
            deadline = time.time() + max_seconds
            watch = RunWatch(record, self.module.params["lapse_seconds"])
            while time.time() < deadline and not watch.over():
                time.sleep(min(WATCH_S if record.get("play") else 60.0, max(deadline - time.time(), 0.01)))
            os._exit(0)
        os.close(ready_write)
        os.waitpid(first, 0)
        pid = os.read(ready_read, 32).decode("ascii")
        os.close(ready_read)
        if not pid:
            self.module.fail_json(msg="the process holding %s did not start" % self.path)
        return int(pid)

    def release(self):
        token = self.module.params["token"]
        holder = read_holder(self.path)
        if not token or holder.get("token") != token:
            return {"changed": False, "holder": holder}
        if not self.module.check_mode:
            try:
                os.kill(int(holder["pid"]), signal.SIGTERM)
            except OSError as error:
                if error.errno != errno.ESRCH:
                    raise
            self.wait_until_free()
        return {"changed": False, "holder": holder}

    def wait_until_free(self, timeout=10.0):
        fd = os.open(self.path, os.O_RDONLY)
        try:
            deadline = time.time() + timeout
            while not try_lock(fd):
                if time.time() > deadline:
                    self.module.fail_json(msg="%s is still held %.0f s after its holder was told to stop"
                                              % (self.path, timeout))
                time.sleep(0.05)
        finally:
            os.close(fd)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            state=dict(type="str", default="acquired", choices=["acquired", "released"]),
            token=dict(type="str", no_log=False),
            max_seconds=dict(type="int", default=43200),
            lapse_seconds=dict(type="int", default=120),
            owner=dict(type="dict", default={}),
        ),
        supports_check_mode=True,
    )
    module.exit_json(**RunLock(module).run())


if __name__ == "__main__":
    main()
