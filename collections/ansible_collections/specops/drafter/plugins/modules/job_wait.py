#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: job_wait
short_description: Wait quietly for an async job to finish, up to a time limit
version_added: "0.1.0"
description:
  - Polls the results file of a job started with C(async) and C(poll=0) until the job has
    finished or O(timeout) seconds have passed, inside one task. An C(until) loop over
    M(ansible.builtin.async_status) prints a C(FAILED - RETRYING) line for every poll of a job
    that is simply still running; this module prints nothing while it waits.
  - Never fails because the job is still running; read RV(finished), then collect the job's
    result with one M(ansible.builtin.async_status) call.
author:
  - specops maintainers (@specops)
options:
  results_file:
    description:
      - The job's results file, as the async task registered it (C(results_file)).
    type: path
    required: true
  timeout:
    description:
      - Seconds to wait at most.
    type: int
    required: true
  delay:
    description:
      - Seconds between two reads of the results file.
    type: float
    default: 1.0
attributes:
  check_mode:
    support: full
    description: Only reads the results file.
  diff_mode:
    support: none
    description: Changes nothing.
  platform:
    support: full
    platforms: posix
    description: Runs where the job runs.
"""

EXAMPLES = r"""
- name: Start the work
  ansible.builtin.command: /opt/bin/long-job
  async: 3600
  poll: 0
  register: job

- name: Wait up to a minute without a line per poll
  specops.drafter.job_wait:
    results_file: "{{ job.results_file }}"
    timeout: 60
  register: waited
"""

RETURN = r"""
finished:
  description: Whether the job finished (successfully or not) within the time limit.
  returned: always
  type: bool
waited:
  description: Seconds waited.
  returned: always
  type: float
"""

import json
import time

from ansible.module_utils.basic import AnsibleModule


def job_finished(path):
    """As async_status reads it: a results file without 'started' holds the job's final result."""
    try:
        with open(path) as handle:
            data = json.loads(handle.read())
    except (IOError, OSError, ValueError):
        return False  # not written yet, or being written: still running
    return "started" not in data or bool(data.get("finished"))


def main():
    module = AnsibleModule(
        argument_spec=dict(
            results_file=dict(type="path", required=True),
            timeout=dict(type="int", required=True),
            delay=dict(type="float", default=1.0),
        ),
        supports_check_mode=True,
    )
    start = time.monotonic()
    deadline = start + max(0, module.params["timeout"])
    finished = job_finished(module.params["results_file"])
    while not finished and time.monotonic() < deadline:
        time.sleep(min(module.params["delay"], max(0.0, deadline - time.monotonic())))
        finished = job_finished(module.params["results_file"])
    module.exit_json(changed=False, finished=finished, waited=round(time.monotonic() - start, 3))


if __name__ == "__main__":
    main()
