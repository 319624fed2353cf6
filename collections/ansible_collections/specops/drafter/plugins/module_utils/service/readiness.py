# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Readiness of OUR server: /health_generate 200 (or, back from a window, a 1-token /generate) while our
process runs and nobody else holds the port.

An open port is not readiness: SGLang opens it after loading and answers 503 until its warm-up
generation succeeds (sglang 0.5.23 srt/entrypoints/http_server.py:723 health_generate).
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import time

from urllib.parse import urlparse

from ansible_collections.specops.drafter.plugins.module_utils.common import procfs
from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError


def url_port(url: str) -> int:
    parsed = urlparse(url)
    return parsed.port or (443 if parsed.scheme == "https" else 80)


def foreign_listener(port: int, our_pid: int | None) -> int | None:
    """A process that is not ours listening on the port, or None (owners we cannot see are not foreign)."""
    inodes = procfs.listening_inodes(port)
    if not inodes:
        return None
    # Our server (or its tree) holding the socket settles it without reading every process's descriptors
    # and states: the readiness loop asks once a poll.
    if our_pid and procfs.socket_owners(inodes, pids={our_pid}):
        return None
    ours = set(procfs.process_tree(our_pid)) if our_pid else set()
    if ours and procfs.socket_owners(inodes, pids=ours):
        return None
    owners = procfs.socket_owners(inodes)
    strangers = sorted(owners - ours)
    return strangers[0] if strangers and owners == set(strangers) else None


def port_is_free(port: int) -> bool:
    return not procfs.listening_inodes(port)


def wait_port_free(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not port_is_free(port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def wait_ready(api, server, timeout: float, delay: float, health_timeout: float, serving: bool = False) -> dict:
    """Poll until our server answers 200; fail at once when it cannot come (gone, or the port is someone else's).

    `server` is a backend (ProcessServer or SystemdUnit): running_pid(), log_tail(), log_source().
    serving: ask with a 1-token /generate, for a server that was up before (the end of a memory-saver
    window): it answers as soon as a token comes back, where /health_generate waits for a whole second.
    A server that is starting keeps /health_generate: SGLang answers it 503 until its warm-up succeeded.
    """
    probe, path = (api.generate_one_token, "/generate") if serving else (api.health_generate, "/health_generate")
    started = time.monotonic()
    port = url_port(api.url)
    while True:
        pid = server.running_pid()
        # Checked first: a server that exited because the port was taken is named by the holder.
        holder = foreign_listener(port, pid)
        if holder:
            raise ServiceError(
                "port %d is held by pid %d (%s), not by our server (%s): an answer there is not ours. Stop that "
                "process or move the server (sglang_service_port). Last lines of the server's log (%s):\n%s"
                % (port, holder, procfs.cmdline(holder) or "?", "pid %d" % pid if pid else "it is not running",
                   server.log_source(), server.log_tail()),
                port=port, port_holder=holder, port_holder_cmdline=procfs.cmdline(holder))
        failure = getattr(server, "failure", lambda: None)()
        if pid is None or failure:
            raise ServiceError(
                "%s: it will not become ready (waited %.0f s). Last lines of the server's log (%s):\n%s"
                % (failure or "our server process has exited", time.monotonic() - started, server.log_source(),
                   server.log_tail()))
        answer = probe(health_timeout)
        if answer.ok:
            return {"ready": True, "pid": pid, "ready_at": time.time(),
                    "ready_seconds": round(time.monotonic() - started, 2)}
        if time.monotonic() - started >= timeout:
            raise ServiceError(
                "not ready at %s after %.0f s (sglang_service_ready_timeout): %s last gave %s. "
                "Last lines of the server's log (%s):\n%s"
                % (api.url, time.monotonic() - started, path, answer.describe(), server.log_source(), server.log_tail()))
        time.sleep(delay)
