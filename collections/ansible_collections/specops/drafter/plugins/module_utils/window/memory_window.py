# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Release and resume a server's GPU memory without losing a request and without a second resume.

- Release asserts an idle scheduler and a request in between crashes it (sglang 0.5.23
  srt/managers/scheduler_components/weight_updater.py:337-341 release_memory_occupation): pause first,
  then poll /flush_cache until 200. Idle includes an empty grammar queue (srt/managers/scheduler.py:5369-5372),
  which drains only while the scheduler schedules (:4084-4088): a constrained request caught there by the
  pause is let through (continue, then pause again) instead of waited for in vain. Pause with `retract` where the version has modes (requests go back
  to the waiting queue and survive); 0.5.4's pause aborts every request, so drain first.
- Resume of a tag that is not released raises in the scheduler, which SIGQUITs the server (same
  file, `offload_tags.remove`, weight_updater.py:390): the released marker is claimed under a lock, so the play and the
  guard never both resume.
Standard library only: the guard resumes with it outside Ansible.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

# The guard runs this outside Ansible, where there is no AnsibleModule.run_command or exit_json.
# pylint: disable=ansible-bad-function

import fcntl
import os
import subprocess
import time

from ansible_collections.specops.drafter.plugins.module_utils.common.state_files import (
    ensure_dir,
    read_json,
    remove,
    write_json,
)
from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError
from ansible_collections.specops.drafter.plugins.module_utils.service.sglang_api import has_pause_modes, offers


def marker_path(state_dir: str) -> str:
    return os.path.join(state_dir, "released.json")


def is_released(state_dir: str) -> bool:
    return os.path.exists(marker_path(state_dir))


def gpu_memory_used(gpu_ids: list) -> list[dict] | None:
    """[{index, total_mib, used_mib}] from nvidia-smi, or None where it is absent or fails."""
    argv = ["nvidia-smi", "--query-gpu=index,memory.total,memory.used", "--format=csv,noheader,nounits"]
    if gpu_ids:
        argv.append("--id=" + ",".join(str(gpu) for gpu in gpu_ids))
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    rows = []
    for line in done.stdout.decode("utf-8", "replace").splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            rows.append({"index": parts[0], "total_mib": int(parts[1]), "used_mib": int(parts[2])})
    return rows or None


def _released_enough(after: list, max_used_mib: int, expected: list | None) -> bool:
    if expected is None:
        return max(row["used_mib"] for row in after) <= max_used_mib
    bound = dict((row["index"], row["max_used_mib"]) for row in expected)
    return all(row["used_mib"] <= bound.get(row["index"], max_used_mib) for row in after)


def wait_memory_dropped(before, gpu_ids: list, max_used_mib: int, timeout: float, expected: list | None = None) -> dict:
    """The release can answer before the memory is free: poll nvidia-smi until every GPU is below its bound
    (max_used_mib, or, with the weights resident, `expected`: memory_plan.expected_used_after)."""
    if before is None:
        return {"checked": False, "note": "GPU memory could not be checked: nvidia-smi is not available on this host"}
    deadline = time.monotonic() + timeout
    after = before
    bounds = expected if expected is not None else max_used_mib
    while True:
        after = gpu_memory_used(gpu_ids) or []
        if after and _released_enough(after, max_used_mib, expected):
            return {"checked": True, "released": True, "threshold_mib": bounds, "before": before, "after": after}
        if time.monotonic() >= deadline:
            raise ServiceError(
                "GPU memory is still in use after /release_memory_occupation: %s above %s. Another process may "
                "hold the GPU (check nvidia-smi), or raise the threshold (sglang_service_release_max_used_mib)"
                % (after, "the KV cache's share (%s)" % expected if expected is not None
                   else "sglang_service_release_max_used_mib=%d" % max_used_mib),
                gpu_memory={"checked": True, "released": False, "before": before, "after": after})
        # Short: the window's downtime includes this wait (a KV cache is unmapped in 0.02 s).
        time.sleep(0.1)


def pause_without_losing_requests(api, version, drain_timeout: float, delay: float) -> str:
    """Hold new work; the pause mode used ("retract", or "drain then abort" where the version has no modes)."""
    if has_pause_modes(version):
        answer = api.pause("retract")
        if not answer.ok:
            raise ServiceError("POST %s/pause_generation {\"mode\": \"retract\"} gave %s" % (api.url, answer.describe()))
        return "retract"
    # No modes: the pause aborts whatever runs, so wait until nothing does.
    deadline = time.monotonic() + drain_timeout
    while True:
        running = api.running_requests()
        if running == 0:
            break
        if time.monotonic() >= deadline:
            raise ServiceError(
                "%s still has %s request(s) running after %.0f s (sglang_service_drain_timeout): SGLang %s has no "
                "retract pause, and its pause would abort them; nothing was paused"
                % (api.url, "an unknown number of" if running is None else running, drain_timeout, version or "?"),
                paused=False)
        time.sleep(delay)
    answer = api.pause(None)
    if not answer.ok:
        raise ServiceError("POST %s/pause_generation gave %s" % (api.url, answer.describe()))
    return "drain then abort"


# The flush after the pause is inside the downtime: it is tried again soon (the retracted requests leave the
# running batch within a scheduler step), then less often, up to the module's ready_delay. A flush that finds
# the scheduler busy does nothing and answers failure (sglang 0.5.23 srt/managers/scheduler.py:5518-5547), so
# trying it sooner is safe.
FIRST_FLUSH_RETRY_S = 0.02


def flush_retry_delays(delay: float):
    """0.02, 0.04, 0.08 ... s, then `delay` each time."""
    wait = min(FIRST_FLUSH_RETRY_S, delay)
    while True:
        yield wait
        wait = min(wait * 2, delay)


def flush_through_grammar_queue(api, version, timeout: float, delay: float) -> None:
    """/flush_cache until 200 under a retract pause; a constrained request held in the grammar queue (which never
    drains while paused) is let through by a continue, and the pause taken again once the queue is empty."""
    deadline = time.monotonic() + timeout
    retries = flush_retry_delays(delay)
    while True:
        answer = api.flush_cache()
        if answer.ok:
            return
        if offers(version, "grammar_queue_load") and api.grammar_queue():
            api.continue_generation()
            while api.grammar_queue() and time.monotonic() < deadline:
                time.sleep(min(delay, 0.1))
            paused = api.pause("retract")
            if not paused.ok:
                raise ServiceError("POST %s/pause_generation {\"mode\": \"retract\"} gave %s (pausing again once the "
                                   "grammar queue had drained)" % (api.url, paused.describe()))
        if time.monotonic() >= deadline:
            raise ServiceError("POST %s/flush_cache still gives %s after %.0f s (sglang_service_drain_timeout): "
                               "requests are still running or waiting for their grammar"
                               % (api.url, answer.describe(), timeout))
        time.sleep(next(retries))


def flush_until_idle(api, timeout: float, delay: float) -> None:
    deadline = time.monotonic() + timeout
    retries = flush_retry_delays(delay)
    while True:
        answer = api.flush_cache()
        if answer.ok:
            return
        if time.monotonic() >= deadline:
            raise ServiceError("POST %s/flush_cache still gives %s after %.0f s (sglang_service_drain_timeout): "
                               "requests are still running" % (api.url, answer.describe(), timeout))
        time.sleep(next(retries))


class ReleasedMarker(object):
    """"Released, not yet resumed": written before the release, claimed (flock + rename) by exactly one resume."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.path = marker_path(state_dir)
        self.claimed = self.path + ".claimed"

    def write(self, tags: list, down_at: float, weights_checksum: str | None = None) -> None:
        ensure_dir(self.state_dir)
        content = {"tags": list(tags), "at": down_at}
        if weights_checksum:
            content["weights_checksum"] = weights_checksum  # proven again after the resume
        write_json(self.path, content)

    def drop(self) -> None:
        remove(self.path)

    def claim(self) -> dict | None:
        """The marker's content for the one caller that gets it; None for everyone else."""
        if not os.path.isdir(self.state_dir):
            return None
        with open(os.path.join(self.state_dir, "released.flock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(self.path):
                return None
            os.rename(self.path, self.claimed)
            content = read_json(self.claimed, {}) or {}
            remove(self.claimed)
            return content


def resume_claimed(api, tags: list, health_timeout: float) -> dict:
    """Resume once (never retried), then continue whatever the resume answered: only continue ends the pause."""
    resumed = api.resume(tags)
    continued = api.continue_generation()
    result = {"resume_status": resumed.status, "continue_status": continued.status}
    if not resumed.ok:
        raise ServiceError(
            "POST %s/resume_memory_occupation gave %s (not retried: a second resume crashes SGLang's scheduler; "
            "restart the server if it does not answer)" % (api.url, resumed.describe()), **result)
    return result
