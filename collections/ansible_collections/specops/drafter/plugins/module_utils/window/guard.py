# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The guard: a small program on the host that brings the server back when the play does not.

    python -m ansible_collections.specops.drafter.plugins.module_utils.window.guard <state_dir>/guard.json

The module extracts this file and the stdlib-only files it imports into <state_dir>/guard_lib and
starts it detached (systemd-run on systemd hosts). It fires after min(guard_after, max_downtime)
seconds, or guard_grace seconds after the window's work (processes carrying
SPECOPS_WINDOW_TOKEN=<token> under a live process that is not part of it) is gone (firing stops those and
the stages a stage host forked for them, procfs.window_processes), or, with
resume_when_done (a memory-saver window's extraction: its job file and its state file), the moment
the extraction says finished (outputs written, the device's memory given back) or its job has ended:
the normal path, so that the service comes back without waiting for the play's next tasks
(it records the first 200 of a 1-token /generate after its resume in guard.result.json and leaves
the window lock to the play). Disarmed (<state_dir>/guard.armed removed or holding another arm id), it exits without
acting. Firing stops the window's work and waits until its GPU memory is freed, brings the server
back (start, or resume; a resume with nothing to resume starts a server that is gone, and a server
that does not serve after the resume is started again), continues generation and gives the window
lock back. A guard that fired for any other
reason, once the server answers /health_generate, writes what it did to <state_dir>/outages/<arm
id>.json: an outage no play saw end, which the next sglang_service call that brings the server up
returns (earlier_outages) and eval.yml puts on its run's record.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

# The guard runs this outside Ansible, where there is no AnsibleModule.run_command or exit_json.
# pylint: disable=ansible-bad-function

import json
import os
import subprocess
import sys
import time

from ansible_collections.specops.drafter.plugins.module_utils.common import procfs
from ansible_collections.specops.drafter.plugins.module_utils.common.file_watch import FileWatch
from ansible_collections.specops.drafter.plugins.module_utils.common.state_files import ensure_dir, read_json, remove, write_json
from ansible_collections.specops.drafter.plugins.module_utils.service.readiness import wait_ready
from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError
from ansible_collections.specops.drafter.plugins.module_utils.service.service_process import ProcessServer, stop_processes
from ansible_collections.specops.drafter.plugins.module_utils.service.service_systemd import SystemdUnit
from ansible_collections.specops.drafter.plugins.module_utils.service.sglang_api import SglangApi
from ansible_collections.specops.drafter.plugins.module_utils.stages.async_job import job_result
from ansible_collections.specops.drafter.plugins.module_utils.window.memory_window import ReleasedMarker, resume_claimed
from ansible_collections.specops.drafter.plugins.module_utils.window.window_lock import WindowLock


def armed_path(state_dir: str) -> str:
    return os.path.join(state_dir, "guard.armed")


def outages_dir(state_dir: str) -> str:
    return os.path.join(state_dir, "outages")


def take_outages(state_dir: str, check_mode: bool = False) -> list:
    """The outages guards ended since the last call, oldest first; removed once read (not in check mode)."""
    directory = outages_dir(state_dir)
    try:
        names = sorted(name for name in os.listdir(directory) if name.endswith(".json"))
    except OSError:
        return []
    found = []
    for name in names:
        record = read_json(os.path.join(directory, name))
        if isinstance(record, dict):
            found.append(record)
        if not check_mode:
            remove(os.path.join(directory, name))
    return sorted(found, key=lambda record: record.get("down_at") or 0)


def wait_until_serving(config: dict, api) -> float | None:
    """When the server first answers /health_generate 200 after the guard's action (None: not within its time)."""
    deadline = time.monotonic() + float(config.get("ready_timeout", 900))
    while time.monotonic() < deadline:
        if api.health_generate(api.timeout).ok:
            return time.time()
        time.sleep(1.0)
    return None


def is_armed(state_dir: str, arm_id: str) -> bool:
    try:
        with open(armed_path(state_dir)) as handle:
            return handle.read().strip() == arm_id
    except (IOError, OSError):
        return False


def backend_of(config: dict):
    if config["backend"] == "systemd":
        return SystemdUnit(config["unit"])
    return ProcessServer(config["spec"])


def attended(token: str) -> bool:
    """The play still drives the window: some work carrying the token hangs below a live process outside
    it (an Ansible worker, an ssh session). Detached work (an async job, a task orphaned by Ctrl-C)
    hangs below PID 1 or a systemd subreaper instead."""
    table = procfs.parents()
    carriers = set(procfs.token_processes(token))
    for pid in carriers:
        top = pid
        while table.get(top) in carriers:
            top = table[top]
        parent = table.get(top, 1)
        if parent > 1 and procfs.comm(parent) not in ("systemd", "init"):
            return True
    return False


def log(message: str) -> None:
    sys.stderr.write("--- %s guard: %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), message))
    sys.stderr.flush()


# The reason the guard gives when the window's work has ended and it resumes at once: the normal path,
# not a failure (the play's resume then finds the server resumed).
WORK_ENDED = "the window's work has ended: the server is resumed at once, without waiting for the play"
# The extraction's state file (beside its start signal): "finished" once its outputs are on disk and
# the device has its memory back, before the process exits (src/specops/extract/start_signal.py).
STATE_SUFFIX = ".state"
FINISHED = "finished"


def done_files_of(config: dict) -> list:
    """The files whose end resumes the server: the extraction's job file and its state file."""
    value = config.get("resume_when_done") or []
    return [value] if isinstance(value, str) else [path for path in value if path]


def work_ended(path: str) -> bool:
    """An extraction's state file says finished, or an async job's file holds its final result."""
    if path.endswith(STATE_SUFFIX):
        return (read_json(path) or {}).get("state") == FINISHED
    return job_result(path) is not None


def wait_for_reason(config: dict) -> str | None:
    """Why the guard fires, or None once it was disarmed."""
    started = time.monotonic()
    fire_after = float(config["fire_after"])
    last_work = last_scan = started
    done_files = done_files_of(config) if config.get("action") == "resume" else []
    seen = set()
    # Woken by the work's own write of its end (and by a disarm), not found by polling.
    watch = FileWatch(done_files + [armed_path(config["state_dir"])]) if done_files else None
    while True:
        if not is_armed(config["state_dir"], config["arm_id"]):
            return None
        now = time.monotonic()
        for done_file in done_files:
            # The play's wait removes the job's file once it has read the end: a job file seen, then
            # gone, is an end too (the guard may have been held up reading /proc of the exiting work).
            present = os.path.exists(done_file)
            removed_job = done_file in seen and not present and not done_file.endswith(STATE_SUFFIX)
            if (present and work_ended(done_file)) or removed_job:
                return WORK_ENDED
            if present:
                seen.add(done_file)
        if now - started >= fire_after:
            return "the window's time of %.0f s is up (min of guard_after and max_downtime)" % fire_after
        if config.get("watch_work") and (not done_files or now - last_scan >= 1.0):
            last_scan = now
            if attended(config["token"]):
                last_work = now
            elif now - last_work >= float(config["grace"]):
                return "the window's work is gone and the play did not disarm within %.0f s" % float(config["grace"])
        until_fire = max(0.05, fire_after - (now - started))
        if watch is not None:
            # The files heard at once; the process table (a lost play) and the arm file still looked at
            # once a second, whatever the kernel says.
            watch.wait(min(1.0, until_fire))
        else:
            time.sleep(min(1.0, until_fire))


def gpu_process_pids() -> set[int] | None:
    """Pids nvidia-smi lists as holding GPU memory; None where it is absent or fails."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return set(int(line.strip()) for line in done.stdout.decode("utf-8", "replace").splitlines()
               if line.strip().isdigit())


def wait_work_memory_freed(stopped: list[tuple[int, int | None]], timeout: float) -> dict:
    """A killed process gives its GPU memory back only once the driver has torn its context down, after
    the process has gone; a resume that cannot allocate kills SGLang's scheduler (sglang 0.5.23
    srt/managers/scheduler_components/weight_updater.py:383-406). Wait (bounded) until none of the
    window's stopped work runs and nvidia-smi, where there is one, lists none of it."""
    started = time.monotonic()
    pids = set(pid for pid, dummy in stopped)
    while True:
        running = [pid for pid, begun in stopped if procfs.is_same_process(pid, begun)]
        on_gpu = gpu_process_pids()
        holding = sorted(pids & on_gpu) if on_gpu is not None else []
        waited = round(time.monotonic() - started, 2)
        if not running and not holding:
            return {"freed": True, "waited_s": waited, "gpu_checked": on_gpu is not None}
        if waited >= timeout:
            return {"freed": False, "waited_s": waited, "running": running, "holding_gpu": holding}
        time.sleep(0.2)


def bring_back(config: dict, api) -> dict:
    """Start or resume the server; a resume with no server to resume starts one, and a server that does
    not serve after the resume is started again."""
    server = backend_of(config)
    result: dict = {"action": config["action"]}
    claimed = ReleasedMarker(config["state_dir"]).claim() if config["action"] == "resume" else None
    if claimed is not None and claimed.get("at"):
        result["down_at"] = claimed["at"]  # the pause before the release, for the outage's record
    if claimed is not None and claimed.get("weights_checksum"):
        # The play proves the weights after the guard's resume (guard.result.json carries the checksum).
        result["weights_checksum"] = claimed["weights_checksum"]
    if config["action"] == "resume" and server.running_pid():
        try:
            if claimed is not None:
                result.update(resume_claimed(api, claimed.get("tags") or [], api.timeout))
                result["resumed"] = True
            else:
                # Nothing to resume (the play did it): only make sure the server is not left paused.
                result["continue_status"] = api.continue_generation().status
            # Polled finely: at the work's end this is the downtime's last part.
            ready = wait_ready(api, server, float(config.get("ready_timeout", 900)), 0.1, api.timeout, serving=True)
            result["ready_at"] = ready.get("ready_at")
            return result
        except ServiceError as error:
            if "port_holder" in error.fields:
                raise  # another process holds the port: a new server could not serve there either
            # A resume whose allocation fails kills the whole tree (weight_updater.py:383-406, then
            # managers/scheduler.py:6370-6373): what is left is stopped and the server started from disk.
            result["not_serving"] = error.msg.split(". ")[0]
            server.stop(float(config.get("stop_timeout", 120)))
    # The play's stop may still be under way when the guard fires early: let it finish, then start.
    # The leader goes first; the process backend's launch then also waits for the stop to see the rest
    # of the old group go, and systemd queues a start behind a stop job.
    deadline = time.monotonic() + float(config.get("stop_timeout", 120)) + 10
    while server.running_pid() is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    if server.running_pid() is None:
        result["started_pid"] = server.launch()
    return result


def result_path(state_dir: str) -> str:
    return os.path.join(state_dir, "guard.result.json")


def fire(config: dict, reason: str) -> dict:
    remove(armed_path(config["state_dir"]))
    # The configuration may hold the keys: it is not left on disk longer than the guard needs it.
    remove(os.path.join(config["state_dir"], "guard.json"))
    ended = reason == WORK_ENDED
    # At the work's end nothing of it is left to stop (the play's own tasks carry the token too).
    work = procfs.window_processes(config["token"]) if config.get("watch_work") and not ended else []
    known = [(pid, procfs.start_time(pid)) for pid in work]
    stopped = stop_processes(work)
    freed = wait_work_memory_freed(known, float(config.get("stop_timeout", 120))) if known else None
    log("fired (%s): stopped the window's work %s (its memory: %s), then %s"
        % (reason, stopped, json.dumps(freed), config["action"]))
    fired_at = time.time()
    api = SglangApi(config["url"], config.get("api_key") or "", float(config.get("health_timeout", 30)),
                    admin_api_key=config.get("admin_api_key") or "")
    try:
        result = bring_back(config, api)
    except ServiceError as error:
        result = {"failed": True, "msg": error.msg}
    if not ended:
        # The play is gone (or out of time): the window is over. At the work's end the play still holds
        # it, and its resume gives it back.
        WindowLock(config["state_dir"], config.get("server", "")).release(config["token"])
    result.update({"reason": reason, "stopped_work": stopped, "work_memory": freed, "fired_at": fired_at,
                   "token": config["token"], "arm_id": config["arm_id"], "work_ended": ended})
    if ended:
        # The play takes its window back with its resume, which removes this record; a play lost after
        # the work ended never does, and the next run's record shows the outage instead of nobody.
        record_outage(config, result, fired_at, result.get("ready_at"))
    write_json(result_path(config["state_dir"]), result)
    log(json.dumps(result))
    if not ended:
        # An outage no play saw end (at the work's end the play's resume records the window itself).
        ready_at = result.get("ready_at") or (None if result.get("failed") else wait_until_serving(config, api))
        record_outage(config, result, fired_at, ready_at)
        log("outage recorded: the server %s" % ("answers again" if ready_at else "does not answer"))
    return result


def record_outage(config: dict, result: dict, fired_at: float, ready_at: float | None) -> None:
    """What the guard did, for the next run's record: the play that took the server down never saw it end."""
    ensure_dir(outages_dir(config["state_dir"]))
    write_json(os.path.join(outages_dir(config["state_dir"]), "%s.json" % config["arm_id"]), {
        "server": config.get("server"),
        "owner": config.get("owner"),
        # Stop: the guard is armed just before the stop, so this is where the service went down at the
        # earliest; memory saver: the pause before the release, as the release recorded it.
        "down_at": result.get("down_at") or config.get("armed_at"),
        "fired_at": fired_at,
        "ready_at": ready_at,
        "cause": ("the guard resumed the server at the end of the window's work; the play that took it down "
                  "never took it back" if result.get("work_ended")
                  else "the guard brought the server back: %s" % result["reason"]),
        "action": config["action"],
        "failed": bool(result.get("failed")),
        "msg": result.get("msg"),
    })


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # Started by the process backend with PYTHONPATH pointing at its own copied code: a server it starts
    # must see the environment the module would have launched it with, not the guard's.
    if "SPECOPS_GUARD_OUTER_PYTHONPATH" in os.environ:
        outer = os.environ.pop("SPECOPS_GUARD_OUTER_PYTHONPATH")
        if outer:
            os.environ["PYTHONPATH"] = outer
        else:
            os.environ.pop("PYTHONPATH", None)
    config = read_json(args[0])
    if not isinstance(config, dict):
        log("cannot read the guard's configuration %s" % args[0])
        return 2
    reason = wait_for_reason(config)
    if reason is None:
        log("disarmed")
        return 0
    result = fire(config, reason)
    return 1 if result.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
