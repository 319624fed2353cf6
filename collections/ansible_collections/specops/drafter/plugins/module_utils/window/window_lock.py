# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""One window per server, whoever asks: a lock file in the server's state_dir.

The file names the holder (token, owner, guard pid + start time). A second run with another token
is refused at once naming the holder, or waits up to `wait` seconds. A lock is stale when its guard
is dead, or, without a guard, when no process carries its window's token any more.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import fcntl
import os
import time

from ansible_collections.specops.drafter.plugins.module_utils.common import procfs
from ansible_collections.specops.drafter.plugins.module_utils.common.state_files import (
    ensure_dir,
    read_json,
    remove,
    write_json,
)
from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError

# Calls without a window (service.yml, an operator's stop and start) share this token: they are one owner.
NO_WINDOW_TOKEN = "no-window"


class WindowLock(object):
    def __init__(self, state_dir: str, server: str) -> None:
        self.state_dir = state_dir
        self.server = server
        self.path = os.path.join(state_dir, "window.lock")

    def holder(self) -> dict | None:
        """The live holder, or None (no lock, or a stale one)."""
        held = read_json(self.path)
        if not isinstance(held, dict) or self.is_stale(held):
            return None
        return held

    @staticmethod
    def is_stale(held: dict) -> bool:
        guard = held.get("guard") or {}
        if guard.get("pid"):
            return not procfs.is_same_process(int(guard["pid"]), guard.get("starttime"))
        token = held.get("token") or ""
        if token and token != NO_WINDOW_TOKEN:
            return not procfs.token_processes(token)
        return False

    def refusal(self, held: dict) -> ServiceError:
        return ServiceError(
            "%s is in another run's window (token %s, owner %s, since %s): wait until it ends, or, if that run is "
            "gone, stop its guard (pid %s) and remove %s"
            % (self.server, held.get("token"), held.get("owner") or "?", held.get("since_text", "?"),
               (held.get("guard") or {}).get("pid", "none"), self.path),
            window_holder=held)

    def _locked(self):
        ensure_dir(self.state_dir)
        handle = open(self.path + ".flock", "a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        return handle

    def check(self, token: str) -> None:
        """Refuse at once when another token holds the server (nothing is written)."""
        held = self.holder()
        if held and held.get("token") != token:
            raise self.refusal(held)

    def acquire(self, token: str, owner, wait: float) -> bool:
        """Take the lock for token (True when newly taken); refuse or wait when another token holds it."""
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            handle = self._locked()
            try:
                held = self.holder()
                if held is None or held.get("token") == token:
                    if held is None:
                        write_json(self.path, {"token": token, "owner": owner, "since": time.time(),
                                               "since_text": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "guard": None})
                    return held is None
            finally:
                handle.close()
            if time.monotonic() >= deadline:
                raise self.refusal(held)
            time.sleep(1.0)

    def set_guard(self, token: str, guard: dict | None) -> None:
        handle = self._locked()
        try:
            held = read_json(self.path)
            if isinstance(held, dict) and held.get("token") == token:
                held["guard"] = guard
                write_json(self.path, held)
        finally:
            handle.close()

    def release(self, token: str) -> bool:
        """Give the lock back if token holds it (or it is stale); True when something was given back."""
        if not os.path.exists(self.path):
            return False
        handle = self._locked()
        try:
            held = read_json(self.path)
            if not isinstance(held, dict) or held.get("token") == token or self.is_stale(held):
                return remove(self.path)
            return False
        finally:
            handle.close()
