# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The files a job started with async and poll=0 is driven by: its results file, read as
async_status reads it, and the start signal an extraction started ahead of its window waits for."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json
import os
import tempfile


def read_json(path):
    """The JSON object in path, or None when it is missing, being written or not an object."""
    try:
        with open(path) as handle:
            value = json.loads(handle.read())
    except (IOError, OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def job_result(results_file):
    """The job's final result once it has ended, else None.

    The async wrapper writes {"started": 1, "finished": 0, ...} first; the module's own result
    (no "started", or "finished" set) replaces it when the job ends.
    """
    data = read_json(results_file) if results_file else None
    if data is None or ("started" in data and not data.get("finished")):
        return None
    return data


def write_signal(module, path, value):
    """Write the start signal atomically (the waiting extraction never reads half a file)."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        os.makedirs(directory)
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".start-signal.")
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(value))
    module.atomic_move(temporary, path)
