# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The guard's end of the window's work: an extraction's state file says finished, or its job's file
holds the final result; the state file's other states, and a job still running, are not an end."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json
import threading
import time

from ansible_collections.specops.drafter.plugins.module_utils.window import guard


def write(path, value):
    path.write_text(json.dumps(value))
    return str(path)


def test_only_finished_or_a_final_job_result_is_the_end(tmp_path):
    state = tmp_path / "extract.start.state"
    for name in ("preparing", "waiting", "started", "stopped"):
        assert not guard.work_ended(write(state, {"state": name, "pid": 1}))
    assert guard.work_ended(write(state, {"state": "finished", "finished_at": 1.0}))
    job = tmp_path / "job.json"
    assert not guard.work_ended(write(job, {"started": 1, "finished": 0}))
    assert guard.work_ended(write(job, {"changed": True, "finished": 1}))


def test_one_file_or_several_are_watched(tmp_path):
    assert guard.done_files_of({"resume_when_done": "/a/job"}) == ["/a/job"]
    assert guard.done_files_of({"resume_when_done": ["/a/job", "", "/a/x.state"]}) == ["/a/job", "/a/x.state"]
    assert guard.done_files_of({}) == []


def test_the_guard_resumes_when_the_extraction_says_finished_while_its_job_still_runs(tmp_path):
    (tmp_path / "guard.armed").write_text("arm-1")
    job = write(tmp_path / "job.json", {"started": 1, "finished": 0})
    state = write(tmp_path / "extract.start.state", {"state": "started", "pid": 1})
    config = {"state_dir": str(tmp_path), "arm_id": "arm-1", "action": "resume", "fire_after": 3600,
              "resume_when_done": [job, state], "watch_work": False}
    reasons = []
    waiter = threading.Thread(target=lambda: reasons.append(guard.wait_for_reason(config)))
    waiter.start()
    write(tmp_path / "extract.start.state", {"state": "finished", "finished_at": 1.0})
    waiter.join(600)
    assert reasons == [guard.WORK_ENDED]


def test_a_state_file_seen_then_removed_is_not_an_end(tmp_path, monkeypatch):
    """Only the play's wait removes a job's file having read its end; nothing removes the state file at
    the extraction's end, so its disappearance says nothing."""
    (tmp_path / "guard.armed").write_text("arm-2")
    state = tmp_path / "extract.start.state"
    write(state, {"state": "started", "pid": 1})
    config = {"state_dir": str(tmp_path), "arm_id": "arm-2", "action": "resume", "fire_after": 3600,
              "resume_when_done": [str(state)], "watch_work": False}
    rounds = []
    real_is_armed = guard.is_armed

    def is_armed(state_dir, arm_id):  # called once at the start of every round of the guard's loop
        rounds.append(state.exists())
        return real_is_armed(state_dir, arm_id)

    monkeypatch.setattr(guard, "is_armed", is_armed)
    reasons = []
    waiter = threading.Thread(target=lambda: reasons.append(guard.wait_for_reason(config)))
    waiter.start()
    wait_until(lambda: len(rounds) >= 2)  # a whole round has seen the file
    state.unlink()
    seen = len(rounds)
    wait_until(lambda: len(rounds) >= seen + 2)  # a whole round has looked for it, gone
    (tmp_path / "guard.armed").unlink()  # disarmed: the wait ends with None unless it took the removal for an end
    waiter.join(600)
    assert reasons == [None] and rounds[0] and not rounds[-1]


def wait_until(condition):
    deadline = time.monotonic() + 600
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_without_files_to_watch_the_guard_watches_the_works_processes(tmp_path):
    """A stop window (or a release without an extraction started ahead) names no file: the guard fires once
    no process carries the window's token."""
    (tmp_path / "guard.armed").write_text("arm-3")
    config = {"state_dir": str(tmp_path), "arm_id": "arm-3", "action": "start", "fire_after": 3600,
              "watch_work": True, "token": "no-process-carries-this-token-5e1d", "grace": 0}
    assert guard.wait_for_reason(config).startswith("the window's work is gone")
