# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Wait for an async job in one task, printing its progress every report_interval seconds.

The module waits on the host in rounds; between rounds this plugin prints the job's last progress
line on the control node. One task instead of a task file that includes itself round after round.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import time

from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

# Options of this plugin only; the module never sees them.
OWN_OPTIONS = ("report_interval",)


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(
        ("results_file", "timeout", "delay", "progress_log", "cleanup", "go") + OWN_OPTIONS
    )

    def run(self, tmp=None, task_vars=None):
        result = super(ActionModule, self).run(tmp, task_vars)
        args = dict(self._task.args)
        interval = float(args.pop("report_interval", 0) or 0)
        total = float(args.get("timeout", 0))
        if interval <= 0 or interval >= total:
            result.update(self._wait(args, total, task_vars))
            return result
        started = time.monotonic()
        host = task_vars.get("inventory_hostname", "?")
        changed = False
        while True:
            left = total - (time.monotonic() - started)
            answer = self._wait(args, max(0.0, min(interval, left)), task_vars)
            changed = changed or answer.get("changed", False)
            # The go signal is written once, by the first round.
            args.pop("go", None)
            if answer.get("failed") or answer.get("finished") or left <= interval:
                answer["changed"] = changed
                answer["waited"] = round(time.monotonic() - started, 3)
                result.update(answer)
                return result
            display.display(
                "  [{0}] {1:.0f} s: {2}".format(
                    host, time.monotonic() - started, answer.get("progress") or "no progress yet"
                )
            )

    def _wait(self, args, seconds, task_vars):
        module_args = dict(args, timeout=int(round(seconds)))
        return self._execute_module(
            module_name="specops.drafter.job_wait", module_args=module_args, task_vars=task_vars
        )
