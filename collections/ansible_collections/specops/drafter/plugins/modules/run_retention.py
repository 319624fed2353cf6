#!/usr/bin/python
# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: run_retention
short_description: Keep the last runs' reports and the newest runs' hidden states, delete the rest
description:
  - O(path) holds one directory per evaluation run (for example one per AWX job). Hidden states are by far
    the largest part of a run; its report and completions are small.
  - The newest O(keep_hidden_states) runs keep everything; older runs among the newest O(keep_runs) keep
    their report and completions but lose their hidden states; runs older than that are deleted.
  - Runs are ordered by when they were last scored (C(score/report.json)), else fetched
    (C(completions/manifest.json)), else by the directory's own time, so deleting hidden states does not
    make a run look new.
  - Only directories that look like runs (holding C(completions), C(hidden_states), C(score) or a run
    lock) are touched, never those in O(exclude), and never a run whose lock is held by a running play.
version_added: "0.1.0"
author:
  - specops maintainers (@specops)
options:
  path:
    description: Directory that holds one directory per run.
    type: path
    required: true
  keep_runs:
    description: How many of the newest runs are kept (their reports and completions); older runs are deleted.
    type: int
    default: 10
  keep_hidden_states:
    description: How many of the newest runs keep their hidden states (a rescore with C(--tags score) needs them).
    type: int
    default: 1
  exclude:
    description: Run directories never touched (the run in progress).
    type: list
    elements: path
    default: []
attributes:
  check_mode:
    support: full
    description: Reports what would be deleted and deletes nothing.
  diff_mode:
    support: none
    description: RV(removed_runs) and RV(removed_hidden_states) list the changes.
  platform:
    support: full
    platforms: posix
    description: Runs on POSIX hosts (it takes C(flock) locks to see whether a play holds a run).
"""

EXAMPLES = r"""
- name: Keep the last 10 runs' reports and the newest run's hidden states
  specops.drafter.run_retention:
    path: /srv/specops/runs
    keep_runs: 10
    keep_hidden_states: 1
"""

RETURN = r"""
runs:
  description: The runs found, newest first.
  returned: always
  type: list
  elements: str
removed_runs:
  description: Run directories that were (in check mode, would be) deleted.
  returned: always
  type: list
  elements: str
removed_hidden_states:
  description: Hidden-state directories that were (in check mode, would be) deleted.
  returned: always
  type: list
  elements: str
freed_bytes:
  description: Bytes that were (in check mode, would be) freed.
  returned: always
  type: int
msg:
  description: What was done, in a sentence.
  returned: always
  type: str
left_alone:
  description: Runs left alone although old enough, with the reason (a running play holds their lock).
  returned: always
  type: list
  elements: dict
"""

import errno
import fcntl
import os
import shutil

from ansible.module_utils.basic import AnsibleModule

RUN_MARKERS = ("completions", "hidden_states", "score", ".specops.lock")
HIDDEN_STATES = "hidden_states"
# When a run was last used, most telling first: deleting its hidden states changes none of these.
AGE_FILES = (os.path.join("score", "report.json"), os.path.join("completions", "manifest.json"))


def run_age(run):
    for relative in AGE_FILES:
        try:
            return os.stat(os.path.join(run, relative)).st_mtime
        except OSError:
            continue
    return os.stat(run).st_mtime


def size_of(path):
    total = 0
    for directory, dirnames, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                pass
    return total


def lock_held(run):
    """Whether a running play holds the run's lock (run_lock keeps an flock on it)."""
    try:
        fd = os.open(os.path.join(run, ".specops.lock"), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except (IOError, OSError) as error:
        if error.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return True
        raise
    finally:
        os.close(fd)


class RunRetention(object):
    def __init__(self, module):
        self.module = module
        self.params = module.params
        self.result = dict(changed=False, runs=[], removed_runs=[], removed_hidden_states=[], freed_bytes=0,
                           left_alone=[])

    def _runs(self):
        root = self.params["path"]
        if not os.path.isdir(root):
            return []
        excluded = set(os.path.realpath(p) for p in self.params["exclude"])
        runs = []
        for name in os.listdir(root):
            run = os.path.join(root, name)
            if (os.path.isdir(run) and not os.path.islink(run) and os.path.realpath(run) not in excluded
                    and any(os.path.exists(os.path.join(run, marker)) for marker in RUN_MARKERS)):
                runs.append(run)
        return sorted(runs, key=lambda run: (run_age(run), run), reverse=True)

    def _remove(self, path, listed):
        if lock_held(path if listed == "removed_runs" else os.path.dirname(path)):
            self.result["left_alone"].append({"path": path, "reason": "a running play holds its lock"})
            return
        self.result["freed_bytes"] += size_of(path)
        self.result[listed].append(path)
        self.result["changed"] = True
        if not self.module.check_mode:
            shutil.rmtree(path)

    def run(self):
        for name in ("keep_runs", "keep_hidden_states"):
            if self.params[name] < 0:
                self.module.fail_json(msg="%s must be 0 or more, not %d" % (name, self.params[name]), **self.result)
        runs = self._runs()
        self.result["runs"] = runs
        for index, run in enumerate(runs):
            if index >= self.params["keep_runs"]:
                self._remove(run, "removed_runs")
            elif index >= self.params["keep_hidden_states"] and os.path.isdir(os.path.join(run, HIDDEN_STATES)):
                self._remove(os.path.join(run, HIDDEN_STATES), "removed_hidden_states")
        verb = "would free" if self.module.check_mode else "freed"
        self.result["msg"] = "%d runs in %s: %d deleted, hidden states of %d deleted; %s %d bytes" % (
            len(runs), self.params["path"], len(self.result["removed_runs"]),
            len(self.result["removed_hidden_states"]), verb, self.result["freed_bytes"])
        self.module.exit_json(**self.result)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            keep_runs=dict(type="int", default=10),
            keep_hidden_states=dict(type="int", default=1),
            exclude=dict(type="list", elements="path", default=[]),
        ),
        supports_check_mode=True,
    )
    RunRetention(module).run()


if __name__ == "__main__":
    main()
