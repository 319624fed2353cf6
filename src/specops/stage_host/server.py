"""The host's loop: accept a call, fork its stage, tell the caller the pid and then the exit status.

Wire protocol (the client is the collection's plugins/module_utils/stages/stage_host.py), over a Unix stream
socket only its user can reach:
- the caller sends a 4-byte big-endian length and a JSON call {"key", "module", "args", "env", "cwd",
  "umask", "niceness"}, with its stage's stdin, stdout and stderr attached (SCM_RIGHTS);
- the host answers a JSON line {"pid": n}, or {"refused": why} (then the caller starts the stage
  itself), and once the stage has ended a line {"status": wait status};
- a caller that hangs up before then has its stage killed: a stage never outlives its caller.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from typing import Any

from specops.stage_host import child, preload

HEADER = struct.Struct("!I")
MAX_CALL_BYTES = 1 << 22
STREAMS = 3


class Host:
    def __init__(self, path: str, key: str, idle_s: float) -> None:
        self.path = path
        self.key = key
        self.idle_s = idle_s
        self.snapshot: dict[str, int] = {}
        self.stages: dict[int, socket.socket] = {}  # pid -> its caller
        self.closing = False
        self.stop_asked = False
        self.last_active = time.monotonic()
        self.listener: socket.socket | None = None
        self.bound_inode = -1
        self.inherited: set[int] = set()  # the host's own descriptors, closed in each stage

    def bind(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(self.path)
        finally:
            os.umask(old)
        listener.listen(16)
        self.listener = listener
        self.bound_inode = os.stat(self.path).st_ino  # the socket file is ours to remove while it is this

    def serve(self) -> None:
        wake_read, wake_write = os.pipe()
        self.inherited |= {wake_read, wake_write}
        os.set_blocking(wake_write, False)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self.asked_to_stop)
        while True:
            if self.stop_asked and not self.closing:
                self.close()
            self.reap()
            if self.closing and not self.stages:
                return
            idle = time.monotonic() - self.last_active
            if not self.stages and not self.closing and idle >= self.idle_s:
                self.close()
                continue
            watched: list[Any] = [wake_read, *self.stages.values()]
            if self.listener is not None:
                watched.append(self.listener)
            try:
                ready, _, _ = select.select(watched, [], [], max(0.05, self.idle_s - idle))
            except InterruptedError:
                continue
            for item in ready:
                if item == wake_read:
                    os.read(wake_read, 512)
                elif item is self.listener:
                    self.accept()
                else:
                    self.caller_spoke(item)

    def asked_to_stop(self, *_: Any) -> None:
        self.stop_asked = True  # the loop closes; the wake-up descriptor ends its select

    def close(self) -> None:
        """Take no more calls; the stages running finish first."""
        self.closing = True
        if self.listener is not None:
            try:
                if os.stat(self.path).st_ino == self.bound_inode:
                    os.unlink(self.path)
            except OSError:
                pass
            self.listener.close()
            self.listener = None

    def accept(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        self.last_active = time.monotonic()
        fds: list[int] = []
        try:
            conn.settimeout(10)
            call, fds = receive_call(conn)
            why = self.refusal(call, fds)
            if why:
                send_line(conn, {"refused": why})
                conn.close()
                if why.startswith("changed on disk"):
                    self.close()
                return
            pid = os.fork()
            if pid == 0:
                host_fds = {conn.fileno(), *self.inherited, *(c.fileno() for c in self.stages.values())}
                if self.listener is not None:
                    host_fds.add(self.listener.fileno())
                child.become(call, fds, os.getppid(), host_fds)
            conn.settimeout(None)
            self.stages[pid] = conn
            send_line(conn, {"pid": pid})
        except (OSError, ValueError) as error:
            print(f"stage host: a call failed: {error}", file=sys.stderr, flush=True)
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def refusal(self, call: dict[str, Any], fds: list[int]) -> str | None:
        if call.get("key") != self.key:
            return "another environment's host"
        if len(fds) != STREAMS:
            return f"{len(fds)} streams attached, {STREAMS} needed"
        niceness = call.get("niceness")
        if niceness is not None and int(niceness) < os.getpriority(os.PRIO_PROCESS, 0) and os.geteuid() != 0:
            return f"niceness {niceness} is above this host's priority"
        changed = preload.changed_since(self.snapshot)
        if changed:
            return f"changed on disk since the host imported it: {changed}"
        return None

    def caller_spoke(self, conn: socket.socket) -> None:
        """A caller says nothing after its call: readable means it hung up. Its stage goes too."""
        for pid, caller in list(self.stages.items()):
            if caller is conn:
                try:
                    data = conn.recv(1)
                except OSError:
                    data = b""
                if not data:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

    def reap(self) -> None:
        while self.stages:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.stages.pop(pid, None)
            self.last_active = time.monotonic()
            if conn is not None:
                try:
                    send_line(conn, {"status": status})
                except OSError:
                    pass
                conn.close()


def receive_call(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    first, fds, _, _ = socket.recv_fds(conn, HEADER.size + 65536, STREAMS)
    if len(first) < HEADER.size:
        raise ValueError("a call without its length")
    (size,) = HEADER.unpack(first[: HEADER.size])
    if size > MAX_CALL_BYTES:
        raise ValueError(f"a call of {size} bytes")
    body = first[HEADER.size :]
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ValueError("the call ended early")
        body += more
    call = json.loads(body.decode())
    if not isinstance(call, dict):
        raise ValueError("the call is not a JSON object")
    return call, list(fds)


def send_line(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def run(path: str, key: str, idle_s: float) -> int:
    """Serve at path until idle_s pass without a call; one host per path (a lock beside it). It binds
    before it imports: a caller that connects meanwhile waits for the imports instead of paying them
    again. A host that cannot start says why in <path>.failed, and its callers start no other."""
    lock = open(path + ".lock", "a")  # noqa: SIM115 - held for the host's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return 0  # another host serves this path
        raise
    host = Host(path, key, idle_s)
    host.inherited.add(lock.fileno())
    try:
        host.bind()
        preload.preload()
    except Exception as error:
        with open(path + ".failed", "w") as failed:
            failed.write(f"{type(error).__name__}: {error}\n")
        raise
    host.snapshot = preload.loaded_files()
    print(f"stage host {os.getpid()}: serving {path}", file=sys.stderr, flush=True)
    host.serve()
    return 0
