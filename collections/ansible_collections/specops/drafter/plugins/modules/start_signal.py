#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: start_signal
short_description: Drive an extraction started ahead of its GPU window (wait, go, abort)
version_added: "0.2.0"
description:
  - An extraction started with C(start_signal) (M(specops.drafter.extract_hidden_states)) prepares while
    the service serves, then waits for the signal file to say go. This module writes that file
    atomically and waits for the extraction's state (C(<path>.state)).
  - V(wait) grants a lease of O(lease) seconds; the extraction exits, having written nothing, when it
    runs out (a play lost before the window cannot leave it waiting). V(go) lets it extract;
    V(abort) makes it exit.
  - With O(wait_for=waiting) the module returns once the extraction waits, or once its job has ended
    (it failed while preparing). With O(wait_for=ended) it returns once the job has ended, and stops
    an extraction that outlives O(timeout) (SIGTERM, then SIGKILL), so an abort leaves no process behind.
author:
  - specops maintainers (@specops)
options:
  path:
    description: The signal file the extraction was started with.
    type: path
    required: true
  signal:
    description: What to write into the signal file; nothing is written when omitted.
    type: str
    choices: [wait, go, abort]
  fresh:
    description:
      - A new extraction is about to start on O(path) - remove the state file (C(<path>.state)) that an earlier
        one left, so that its V(stopped) or V(started) is never read as the new extraction's.
    type: bool
    default: false
  lease:
    description: Seconds from now that a V(wait) signal lets the extraction wait for go.
    type: int
    default: 900
  wait_for:
    description: Wait until the extraction waits for go (V(waiting)) or its job has ended (V(ended)).
    type: str
    choices: [waiting, ended]
  results_file:
    description: The extraction job's results file (C(results_file) of the async task); required with O(wait_for).
    type: path
  timeout:
    description: Seconds O(wait_for) waits at most.
    type: int
    default: 600
  delay:
    description: Seconds between two reads of the state.
    type: float
    default: 0.2
attributes:
  check_mode:
    support: full
    description: Writes no signal and stops no process; reports what it reads.
  diff_mode:
    support: none
    description: The signal file is a small JSON object; no diff is shown.
  platform:
    support: full
    platforms: posix
    description: Runs where the extraction runs.
"""

EXAMPLES = r"""
- name: Let the waiting extraction start, the GPUs are free
  specops.drafter.start_signal:
    path: /srv/specops/run/hidden_states.start
    signal: go

- name: Abort it and make sure it is gone
  specops.drafter.start_signal:
    path: /srv/specops/run/hidden_states.start
    signal: abort
    wait_for: ended
    results_file: "{{ extraction.results_file }}"
    timeout: 60
"""

RETURN = r"""
state:
  description: The extraction's last state (C(state) preparing, waiting, started or stopped, C(pid), its figures).
  returned: always
  type: dict
job_finished:
  description: Whether the extraction's job has ended.
  returned: always
  type: bool
job:
  description: The ended job's result, as async_status would read it.
  returned: when the job has ended
  type: dict
stopped_pids:
  description: Extraction processes signalled because they outlived an abort.
  returned: always
  type: list
  elements: int
removed_state:
  description: The state an earlier extraction left, removed by O(fresh).
  returned: when O(fresh) removed one
  type: dict
waited:
  description: Seconds waited.
  returned: always
  type: float
"""

import os
import signal as signals
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.specops.drafter.plugins.module_utils.stages.async_job import job_result, read_json, write_signal

STATE_SUFFIX = ".state"
# Only an extraction is ever stopped: a recycled pid running anything else is left alone.
EXTRACTION_COMMAND = b"specops.extract"
TERM_GRACE_S = 10.0


def is_extraction(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            return EXTRACTION_COMMAND in handle.read()
    except (IOError, OSError):
        return False


class StartSignal(object):
    def __init__(self, module):
        self.module = module
        self.params = module.params
        self.state_file = self.params["path"] + STATE_SUFFIX
        self.result = {"changed": False, "state": {}, "job_finished": False, "stopped_pids": [], "waited": 0.0}

    def forget_earlier_state(self):
        if not os.path.exists(self.state_file):
            return
        self.result["changed"] = True
        self.result["removed_state"] = read_json(self.state_file) or {}
        if not self.module.check_mode:
            os.remove(self.state_file)

    def write_signal(self):
        value = {"signal": self.params["signal"]}
        if self.params["signal"] == "wait":
            value["until"] = time.time() + self.params["lease"]
        self.result["changed"] = True
        if not self.module.check_mode:
            write_signal(self.module, self.params["path"], value)

    def poll(self, done):
        start = time.monotonic()
        deadline = start + max(0, self.params["timeout"])
        while True:
            job = job_result(self.params["results_file"])
            state = read_json(self.state_file) or {}
            if job is not None or done(state) or time.monotonic() >= deadline:
                break
            time.sleep(self.params["delay"])
        self.result.update(state=state, job_finished=job is not None, waited=round(time.monotonic() - start, 3))
        if job is not None:
            self.result["job"] = job

    def stop_leftover(self):
        pid = self.result["state"].get("pid")
        if self.result["job_finished"] or not isinstance(pid, int) or not is_extraction(pid) or self.module.check_mode:
            return
        os.kill(pid, signals.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        while time.monotonic() < deadline and is_extraction(pid):
            time.sleep(0.1)
        if is_extraction(pid):
            os.kill(pid, signals.SIGKILL)
        self.result["stopped_pids"].append(pid)
        self.result["changed"] = True

    def run(self):
        if self.params["fresh"]:
            self.forget_earlier_state()
        if self.params["signal"]:
            self.write_signal()
        if self.params["wait_for"] == "waiting":
            self.poll(lambda state: state.get("state") in ("waiting", "started", "stopped"))
        elif self.params["wait_for"] == "ended":
            self.poll(lambda state: False)
            self.stop_leftover()
        else:
            self.result["state"] = read_json(self.state_file) or {}
        return self.result


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            signal=dict(type="str", choices=["wait", "go", "abort"]),
            fresh=dict(type="bool", default=False),
            lease=dict(type="int", default=900),
            wait_for=dict(type="str", choices=["waiting", "ended"]),
            results_file=dict(type="path"),
            timeout=dict(type="int", default=600),
            delay=dict(type="float", default=0.2),
        ),
        required_by={"wait_for": ("results_file",)},
        supports_check_mode=True,
    )
    module.exit_json(**StartSignal(module).run())


if __name__ == "__main__":
    main()
