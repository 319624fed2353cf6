# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Small files of a server's state_dir: written atomically, read forgivingly, removed idempotently."""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import errno
import json
import os


def write_atomic(path: str, text: str, mode: int = 0o644) -> None:
    """Readers see the old file or the whole new one, also after a crash (fsync before the rename)."""
    tmp = "%s.tmp-%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def write_json(path: str, value, mode: int = 0o644) -> None:
    write_atomic(path, json.dumps(value, sort_keys=True) + "\n", mode)


def read_json(path: str, default=None):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (IOError, OSError, ValueError):
        return default


def remove(path: str) -> bool:
    """True when the file was there."""
    try:
        os.unlink(path)
        return True
    except OSError as error:
        if error.errno != errno.ENOENT:
            raise
        return False


def ensure_dir(path: str) -> None:
    if not os.path.isdir(path):
        os.makedirs(path, 0o750)


def tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            return "\n".join(handle.read().decode("utf-8", "replace").splitlines()[-lines:])
    except (IOError, OSError) as error:
        return "(cannot read %s: %s)" % (path, error.strerror)
