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
  - Never fails because the job is still running, nor because the job failed. Read RV(finished)
    and, once it is true, the job's own result in RV(result) (what M(ansible.builtin.async_status)
    would return), so a job that ends inside a service window costs one task, not three.
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
    type: float
    required: true
  delay:
    description:
      - Seconds between two reads of the results file.
    type: float
    default: 1.0
  progress_log:
    description:
      - A log the job appends progress lines to; its last line is returned as RV(progress).
    type: path
  go:
    description:
      - The start signal of an extraction started ahead of its window (see
        M(specops.drafter.start_signal)). V(go) is written to it before the wait, so letting the
        extraction go and waiting for it take one task inside the window.
    type: path
  report_interval:
    description:
      - Print the job's last progress line on the control node every this many seconds while
        waiting (the collection's action plugin waits in rounds of this length; the module on the
        host ignores it). V(0) waits in one round and prints nothing.
    type: float
    default: 0
  stop_token:
    description:
      - Stop the job's work before waiting. Every process that carries
        C(SPECOPS_WINDOW_TOKEN=<stop_token>) in its environment, and every stage a stage host forked
        for one of them, except this module and its ancestors, gets SIGTERM, and SIGKILL if it is
        still there after O(timeout) seconds. The job's result is then read once, not waited for,
        since the processes that would write it are gone. The action plugin uses it to end a window
        early.
    type: str
  watch_router:
    description:
      - Used by the collection's action plugin on the control node (the module ignores it). A dict
        with C(url) (the SGLang router), C(exclude) (this batch's worker urls), C(min_healthy);
        when fewer other replicas are healthy, the job's work is stopped (O(stop_token)) and the
        task fails saying why.
    type: dict
  cleanup:
    description:
      - Remove the results file once the job has finished, as M(ansible.builtin.async_status)
        with C(mode=cleanup) does.
    type: bool
    default: false
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

- name: Wait up to an hour, printing the job's progress every minute
  specops.drafter.job_wait:
    results_file: "{{ job.results_file }}"
    timeout: 3600
    report_interval: 60
    progress_log: /var/log/long-job.progress

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
result:
  description: The job's result as its module returned it (C(failed) and C(msg) when it failed).
  returned: when RV(finished) is true
  type: dict
progress:
  description: The last line of O(progress_log); empty when there is none yet.
  returned: when O(progress_log) is set
  type: str
"""

import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.specops.drafter.plugins.module_utils.common.procfs import read_stat, window_processes
from ansible_collections.specops.drafter.plugins.module_utils.service.service_process import stop_processes
from ansible_collections.specops.drafter.plugins.module_utils.stages.async_job import job_result, write_signal


def last_line(path):
    """The last non-empty line of a log (reads only its tail)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4096))
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except (IOError, OSError):
        return ""
    return next((line for line in reversed(lines) if line.strip()), "")


def stop_work(token, timeout):
    """Stop the processes that carry the window's token, except this module's own line (the guard's way)."""
    mine = set(ancestors(os.getpid()))
    return stop_processes([pid for pid in window_processes(token) if pid not in mine], grace=timeout)


def ancestors(pid):
    line = []
    while pid > 1:
        line.append(pid)
        stat = read_stat(pid)
        pid = stat.ppid if stat else 0
    return line


def main():
    module = AnsibleModule(
        argument_spec=dict(
            results_file=dict(type="path", required=True),
            timeout=dict(type="float", required=True),
            delay=dict(type="float", default=1.0),
            progress_log=dict(type="path"),
            cleanup=dict(type="bool", default=False),
            go=dict(type="path"),
            report_interval=dict(type="float", default=0),
            stop_token=dict(type="str", no_log=False),
            watch_router=dict(type="dict"),
        ),
        supports_check_mode=True,
    )
    path = module.params["results_file"]
    stopped = []
    stopped_work = bool(module.params["stop_token"]) and not module.check_mode
    if stopped_work:
        stopped = stop_work(module.params["stop_token"], module.params["timeout"])
    if module.params["go"] and not module.check_mode:
        write_signal(module, module.params["go"], {"signal": "go"})
    start = time.monotonic()
    # After a stop the job's processes (its async wrapper among them) have exited or been killed:
    # a result they did not write by now never comes.
    deadline = start + (0 if stopped_work else max(0, module.params["timeout"]))
    result = job_result(path)
    while result is None and time.monotonic() < deadline:
        time.sleep(min(module.params["delay"], max(0.0, deadline - time.monotonic())))
        result = job_result(path)
    answer = dict(
        changed=bool(module.params["go"] or stopped),
        finished=result is not None,
        waited=round(time.monotonic() - start, 3),
    )
    if module.params["stop_token"]:
        answer["stopped_pids"] = stopped
    if result is not None:
        answer["result"] = result
        if module.params["cleanup"] and not module.check_mode:
            try:
                os.remove(path)
            except OSError:
                pass
    if module.params["progress_log"]:
        answer["progress"] = last_line(module.params["progress_log"])
    module.exit_json(**answer)


if __name__ == "__main__":
    main()
