# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Sleep until a file in some directories is written, moved or removed: the end of a window's work is heard,
not found by polling at a fixed interval.

Linux inotify through ctypes (stdlib only: the guard runs this outside Ansible). Where inotify is not
there (another kernel, no libc symbol, a directory that does not exist yet) it polls instead, every
FALLBACK_POLL_S. Callers look at their files, then wait, in that order: an event between the look and
the wait is kept by the kernel and wakes the wait at once.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import ctypes
import ctypes.util
import os
import select
import time

# inotify(7): a file closed after writing, moved in (an atomic write's rename), created, removed or moved
# away (a job's file read and cleaned up, a disarm).
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
WATCHED = IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
FALLBACK_POLL_S = 0.05


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


class FileWatch(object):
    """Wakes `wait` when a file in the directories of `paths` is written, moved or removed."""

    def __init__(self, paths) -> None:
        self.fd: int | None = None
        directories = sorted(set(os.path.dirname(os.path.abspath(path)) for path in paths if path))
        libc = _libc()
        if libc is None or not directories or not hasattr(libc, "inotify_init1"):
            return
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            return
        for directory in directories:
            if libc.inotify_add_watch(fd, directory.encode(), WATCHED) < 0:
                os.close(fd)  # a directory not there yet: poll rather than miss its file
                return
        self.fd = fd

    @property
    def notified(self) -> bool:
        """Whether the kernel wakes the wait (False: it polls)."""
        return self.fd is not None

    def wait(self, timeout: float) -> None:
        """Return when something was written in the directories, or after `timeout` seconds."""
        timeout = max(0.0, timeout)
        if self.fd is None:
            time.sleep(min(timeout, FALLBACK_POLL_S))
            return
        readable = select.select([self.fd], [], [], timeout)[0]
        if readable:
            try:
                os.read(self.fd, 1 << 16)  # the events themselves do not matter: the caller looks again
            except OSError:
                pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "FileWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
