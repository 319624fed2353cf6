# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The results file of a job started with async and poll=0, read as async_status reads it."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json


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
