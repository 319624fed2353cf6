# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Wait for an async job in one task, printing its progress every report_interval seconds.

The module waits on the host in rounds; between rounds this plugin prints the job's last progress
line on the control node. One task instead of a task file that includes itself round after round.

With watch_router, every round also asks the SGLang router how many other replicas are healthy;
when fewer than its min_healthy are, the job's work is stopped (through the module, by its window
token) and the task fails saying why, so the play brings this host back early.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json
import time

from ansible.module_utils.urls import open_url
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

# Options of this plugin only; the module never sees them.
OWN_OPTIONS = ("report_interval", "watch_router")
# How often the router is asked while a host is out of it (it marks a dead replica within seconds).
WATCH_INTERVAL_S = 2.0


def healthy_others(watch):
    """(healthy replicas outside this batch, what the router said) from GET <router>/workers."""
    url = watch["url"].rstrip("/") + "/workers"
    try:
        answer = json.loads(open_url(url, timeout=float(watch.get("timeout", 10))).read())
    except Exception as error:  # an unreachable router counts as no healthy replica
        return 0, "GET {0} failed: {1}".format(url, error)
    workers = answer.get("workers", []) if isinstance(answer, dict) else []
    exclude = set(u.rstrip("/") for u in watch.get("exclude", []))
    healthy = [
        w.get("url") for w in workers if w.get("is_healthy") and (w.get("url") or "").rstrip("/") not in exclude
    ]
    return len(healthy), "healthy: {0}".format(healthy)


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(
        ("results_file", "timeout", "delay", "progress_log", "cleanup", "go", "stop_token") + OWN_OPTIONS
    )

    def run(self, tmp=None, task_vars=None):
        result = super(ActionModule, self).run(tmp, task_vars)
        args = dict(self._task.args)
        interval = float(args.pop("report_interval", 0) or 0)
        watch = args.pop("watch_router", None) or None
        total = float(args.get("timeout", 0))
        round_s = min(x for x in (interval, WATCH_INTERVAL_S if watch else 0, total) if x > 0) if total > 0 else 0
        started = time.monotonic()
        last_report = started
        host = task_vars.get("inventory_hostname", "?")
        changed = False
        while True:
            left = total - (time.monotonic() - started)
            answer = self._wait(args, max(0.0, min(round_s, left)), task_vars)
            changed = changed or answer.get("changed", False)
            # The go signal is written once, by the first round.
            args.pop("go", None)
            done = answer.get("failed") or answer.get("finished") or left <= round_s
            if not done and watch:
                count, said = healthy_others(watch)
                if count < int(watch.get("min_healthy", 1)):
                    answer = self._stop(args, watch, count, said, task_vars)
                    done = True
            if done:
                if interval > 0 and answer.get("progress"):
                    # The last line too: a job that ended between two reports still shows where it got.
                    display.display(
                        "  [{0}] {1:.0f} s: {2}".format(host, time.monotonic() - started, answer["progress"])
                    )
                answer["changed"] = changed or answer.get("changed", False)
                answer["waited"] = round(time.monotonic() - started, 3)
                result.update(answer)
                return result
            if interval > 0 and time.monotonic() - last_report >= interval:
                last_report = time.monotonic()
                display.display(
                    "  [{0}] {1:.0f} s: {2}".format(
                        host, last_report - started, answer.get("progress") or "no progress yet"
                    )
                )

    def _wait(self, args, seconds, task_vars):
        module_args = dict(args, timeout=round(seconds, 3))
        module_args.pop("stop_token", None)
        return self._execute_module(
            module_name="specops.drafter.job_wait", module_args=module_args, task_vars=task_vars
        )

    def _stop(self, args, watch, count, said, task_vars):
        """Stop the window's work, then fail with the reason (the play's always brings the host back)."""
        stopped = self._execute_module(
            module_name="specops.drafter.job_wait",
            module_args=dict(args, timeout=int(watch.get("stop_timeout", 60)), stop_token=args.get("stop_token")),
            task_vars=task_vars,
        )
        return dict(
            stopped,
            failed=True,
            ended_early=True,
            msg=(
                "the window was ended early: the router at {0} reports {1} healthy replica(s) besides this "
                "batch, fewer than sglang_router_min_healthy_others={2} ({3}); the extraction was stopped "
                "(a rerun resumes from its finished shards) and the host is brought back"
            ).format(watch["url"], count, watch.get("min_healthy", 1), said),
        )
