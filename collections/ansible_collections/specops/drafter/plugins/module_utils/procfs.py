# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""/proc/<pid>/stat, read one way by the gpu_release module and the sglang_service host helper.

Standard library only. Modules get it as module_utils; the sglang_service role copies it next to its
host helper (roles/sglang_service/files/procfs.py links to this file).
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import collections

Stat = collections.namedtuple("Stat", ["state", "ppid", "pgid", "sid", "starttime"])


def read_stat(pid, proc_root="/proc"):
    """A Stat of pid, or None when it is gone or its stat cannot be read."""
    try:
        with open("%s/%d/stat" % (proc_root, pid)) as handle:
            raw = handle.read()
    except (IOError, OSError):
        return None
    # comm may hold spaces and parentheses; the fields after the last ')' are fixed.
    fields = raw[raw.rfind(")") + 2:].split() if ")" in raw else []
    if len(fields) < 20:
        return None
    return Stat(fields[0], int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
