# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The sglang_service module's work: one method per state, over a backend, SGLang's API, the window lock and the guard.

docs/window.md is the interface. Every method returns the module's result or raises ServiceError;
in check mode nothing on the host is written (no lock, no guard, no marker) and the result says what
would change.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import os
import time

from ansible_collections.specops.drafter.plugins.module_utils.common import procfs
from ansible_collections.specops.drafter.plugins.module_utils.common.file_watch import FileWatch
from ansible_collections.specops.drafter.plugins.module_utils.common.state_files import ensure_dir, read_json, remove, write_json
from ansible_collections.specops.drafter.plugins.module_utils.service.readiness import url_port, wait_port_free, wait_ready
from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError, one_refusal
from ansible_collections.specops.drafter.plugins.module_utils.service.service_process import ProcessServer, launch_problems
from ansible_collections.specops.drafter.plugins.module_utils.service.service_settings import settings_problems
from ansible_collections.specops.drafter.plugins.module_utils.service.service_systemd import SystemdUnit
from ansible_collections.specops.drafter.plugins.module_utils.service.sglang_api import SglangApi, offers
from ansible_collections.specops.drafter.plugins.module_utils.window import guard_control
from ansible_collections.specops.drafter.plugins.module_utils.window.guard import outages_dir, take_outages
from ansible_collections.specops.drafter.plugins.module_utils.window.memory_plan import expected_used_after, plan_release
from ansible_collections.specops.drafter.plugins.module_utils.window.memory_window import (
    ReleasedMarker,
    flush_through_grammar_queue,
    flush_until_idle,
    gpu_memory_used,
    is_released,
    pause_without_losing_requests,
    resume_claimed,
    wait_memory_dropped,
)
from ansible_collections.specops.drafter.plugins.module_utils.window.release_checks import (
    check_abort_pause,
    check_memory_flags,
    check_waiting_timeout,
    process_environment,
)
from ansible_collections.specops.drafter.plugins.module_utils.window.window_lock import NO_WINDOW_TOKEN, WindowLock

WINDOW_DEFAULTS = {"token": NO_WINDOW_TOKEN, "owner": "sglang_service without a window", "guard_after": 7200,
                   "max_downtime": 7200, "guard_grace": 60, "wait": 0}


def release_outcome(answer) -> str:
    """"released" (200); "refused" (SGLang answered otherwise: its tokenizer refused before the scheduler
    saw the release); "unknown" (nothing answered: it may have happened, or the server died of it)."""
    if answer.ok:
        return "released"
    return "unknown" if answer.status == -1 else "refused"


def finished_moment(path: str) -> float | None:
    """When a state file says its work finished (its `at`, on the host's clock); None otherwise."""
    state = read_json(path) if path.endswith(".state") else None
    if isinstance(state, dict) and state.get("state") == "finished":
        try:
            return float(state["at"])
        except (KeyError, TypeError, ValueError):
            return None
    return None


def window_stages(result: dict) -> dict:
    """Seconds from each moment of the window to the next, on the host's clock (missing moments skipped):
    pause + release, the GPU memory check until go, the work until it said finished, the guard hearing it
    and beginning the resume, the resume until the first 1-token answer."""
    names = (("down_at", "pause_and_release_s"), ("released_at", "memory_check_to_go_s"),
             ("go_at", "work_s"), ("work_finished_at", "heard_to_resume_s"), ("resume_started_at", "resume_to_ready_s"))
    moments = [(name, result.get(key)) for key, name in names] + [("", result.get("ready_at"))]
    known = [(name, float(at)) for name, at in moments if at is not None]
    stages = dict((known[i][0], round(known[i + 1][1] - known[i][1], 3)) for i in range(len(known) - 1))
    if result.get("down_at") is not None and result.get("ready_at") is not None:
        stages["downtime_s"] = round(float(result["ready_at"]) - float(result["down_at"]), 3)
    return stages


def default_state_dir(params: dict) -> str:
    if params["backend"] == "systemd":
        return "/run/specops/%s" % params["unit"]
    return "%s.d" % (params.get("spec") or {}).get("pid_file", "/tmp/sglang.pid")


class ServiceWindow(object):
    """One server and what a run wants of it."""

    def __init__(self, params: dict, check_mode: bool) -> None:
        self.params = params
        self.check_mode = check_mode
        self.name = params.get("unit") or "sglang"
        self.window: dict = dict(WINDOW_DEFAULTS)
        self.window.update(dict((k, v) for k, v in (params.get("window") or {}).items() if v is not None))
        self.token = str(self.window["token"])
        self.adopted: dict = {}
        self.server: SystemdUnit | ProcessServer
        if params["backend"] == "systemd":
            if not params.get("unit"):
                raise ServiceError("the systemd backend needs unit (sglang_service_unit_name)")
            self.server = SystemdUnit(params["unit"])
            if params.get("adopt"):
                self.adopted = self.server.adopted_facts()
        else:
            self.server = ProcessServer(params.get("spec") or {})
        url = params.get("url") or self._adopted_url()
        if not url:
            raise ServiceError("url is required unless an adopted unit's command line gives host and port")
        # Checked while the server serves, for every state: a wrong host or URL must not stop it.
        problems = settings_problems(None if self.adopted else params.get("spec"), url)
        if problems:
            raise ServiceError("%s is left as it is: %s" % (self.name, "; ".join(problems)))
        if self.adopted.get("api_key_required") and not params.get("api_key"):
            raise ServiceError("%s runs with --api-key: give its key as api_key (sglang_service_api_key)" % self.name)
        if self.adopted.get("admin_api_key_required") and not params.get("admin_api_key"):
            raise ServiceError("%s runs with --admin-api-key: give its key as admin_api_key "
                               "(sglang_service_admin_api_key)" % self.name)
        self.api = SglangApi(url, params.get("api_key") or "", float(params["health_timeout"]),
                             admin_api_key=params.get("admin_api_key") or "")
        self.state_dir = params.get("state_dir") or default_state_dir(params)
        self.lock = WindowLock(self.state_dir, self.name)
        self.result: dict = {"changed": False, "state": params["state"], "url": url, "state_dir": self.state_dir}

    def _adopted_url(self) -> str:
        if not self.adopted:
            return ""
        host = self.adopted["host"]
        # Health checks run on the server's host: a wildcard bind is reached through loopback.
        host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        return "http://%s:%d" % (host, self.adopted["port"])

    # -- the window's pieces ------------------------------------------------------------------
    def _take_window(self) -> None:
        self.lock.acquire(self.token, self.window["owner"], float(self.window["wait"]))

    def _arm(self, action: str) -> None:
        if not self.params["guard"]:
            return
        fire_after = min(float(self.window["guard_after"]), float(self.window["max_downtime"]))
        config = {"server": self.name, "backend": self.params["backend"], "unit": self.params.get("unit"),
                  "spec": self.params.get("spec"), "url": self.api.url, "api_key": self.api.api_key,
                  "admin_api_key": self.api.admin_api_key,
                  "action": action, "fire_after": fire_after, "grace": float(self.window["guard_grace"]),
                  "token": self.token, "watch_work": self.token != NO_WINDOW_TOKEN, "owner": self.window["owner"],
                  "health_timeout": self.api.timeout, "stop_timeout": float(self.params["stop_timeout"]),
                  "ready_timeout": float(self.params["ready_timeout"]),
                  "resume_when_done": self.params.get("resume_when_done") if action == "resume" else None}
        try:
            identity = guard_control.arm(self.state_dir, config, use_systemd=self.params["backend"] == "systemd")
        except (ServiceError, OSError) as error:
            # Nothing went down yet: give the window back rather than leave it held by no one.
            self.lock.release(self.token)
            raise ServiceError("%s: the guard could not be armed, nothing was changed: %s"
                               % (self.name, getattr(error, "msg", error)))
        self.lock.set_guard(self.token, {"pid": identity["pid"], "starttime": identity["starttime"]})
        self.result["guard"] = {"armed": True, "pid": identity["pid"], "fires_in": fire_after, "action": action,
                                "unit": identity["unit"], "log": identity["log"]}

    def _end_window(self) -> None:
        """Disarm the guard and give the lock back, when they are this run's."""
        if not os.path.isdir(self.state_dir):
            return
        held = self.lock.holder()
        if held is not None and held.get("token") != self.token:
            return
        disarmed = guard_control.disarm(self.state_dir) or bool((self.result.get("guard") or {}).get("disarmed"))
        released = self.lock.release(self.token)
        self.result["guard"] = dict(self.result.get("guard") or {}, armed=False, disarmed=disarmed)
        self.result["changed"] = self.result["changed"] or disarmed or released

    def _take_over_from_guard(self) -> None:
        """The play brings the server back itself: an armed guard of this run is disarmed, and one that
        already fired is let finish, so that the server is never started twice."""
        if not os.path.isdir(self.state_dir):
            return
        held = self.lock.holder()
        if held is not None and held.get("token") != self.token:
            return
        if guard_control.disarm(self.state_dir):
            self.result["guard"] = {"armed": False, "disarmed": True}
        if not guard_control.wait_for_fired_guard(self.state_dir, float(self.params["ready_timeout"])):
            raise ServiceError("%s: the guard that fired is still bringing the server back after %s s; see %s"
                               % (self.name, self.params["ready_timeout"],
                                  os.path.join(self.state_dir, "guard.log")))

    def _rearm_after_failure(self, error: ServiceError, action: str) -> ServiceError:
        """This run's window could not bring the server back: arm the guard again, so that the service
        still comes back (after fire_after, or grace seconds after this play has gone)."""
        if self.token == NO_WINDOW_TOKEN or not self.params["guard"] or self.check_mode:
            return error
        if "port_holder" in error.fields:
            return error  # another process holds the port: a guard would only start a server into it
        held = self.lock.holder()
        if held is not None and held.get("token") != self.token:
            return error
        try:
            self._take_window()
            self._arm(action)
        except ServiceError as arm_error:
            return ServiceError("%s; the guard could not be armed again: %s" % (error.msg, arm_error.msg),
                                **error.fields)
        fires_in = (self.result.get("guard") or {}).get("fires_in")
        return ServiceError("%s; the guard is armed again and brings the server back in %s s, or soon after "
                            "this play has ended" % (error.msg, fires_in), **dict(error.fields, **self.result))

    def _fail_ending_window(self, error: ServiceError, what: str) -> ServiceError:
        self._end_window()
        return ServiceError("%s %s: %s" % (self.name, what, error.msg), **dict(error.fields, **self.result))

    def _ready(self, serving: bool = False) -> dict:
        try:
            answer = wait_ready(self.api, self.server, float(self.params["ready_timeout"]),
                                float(self.params["ready_delay"]), float(self.params["health_timeout"]), serving)
        except ServiceError as error:
            if "port_holder" in error.fields:
                # Our server cannot serve on a held port, and a guard would only start another into it.
                self.server.stop(float(self.params["stop_timeout"]))
                raise self._fail_ending_window(error, "is not ready (our server was stopped and the guard "
                                                      "disarmed; once that process is gone, rerun the play)")
            raise ServiceError("%s is not ready at %s: %s" % (self.name, self.api.url, error.msg),
                               **dict(error.fields, **self.result))
        self.result.update(pid=answer["pid"], ready_at=answer["ready_at"])
        # The serving server's own processes: GPU holders outside them are refused before a window.
        serving_tree = os.path.join(self.state_dir, "serving_tree.json")
        ensure_dir(self.state_dir)
        write_json(serving_tree, procfs.describe_tree(procfs.process_tree(answer["pid"])))
        self.result["serving_tree"] = serving_tree
        return answer

    def _launch(self) -> dict:
        launched_at = time.monotonic()
        self.server.launch()
        answer = self._ready()
        self.result["server_start_s"] = round(time.monotonic() - launched_at, 2)
        return answer

    def _stop(self) -> dict:
        tree_file = os.path.join(self.state_dir, "tree.json")
        stopped = self.server.stop(float(self.params["stop_timeout"]), tree_file)
        port = url_port(self.api.url)
        if not wait_port_free(port, float(self.params["stop_timeout"])):
            raise ServiceError("port %d is still open %s s after %s stopped (see `ss -ltnp sport = :%d`)"
                               % (port, self.params["stop_timeout"], self.name, port))
        if stopped["changed"]:
            self.result.update(changed=True, down_at=stopped["down_at"], recorded_tree=tree_file)
        return stopped

    def _needs_launch(self, running) -> bool:
        if running is None:
            return True
        return isinstance(self.server, ProcessServer) and not self.server.matches_spec()

    def _validate_before_replacing(self) -> None:
        spec = self.params.get("spec")
        if spec and spec.get("argv") and not self.adopted:
            problems = launch_problems(spec)
            if problems:
                raise ServiceError("%s would not start with these settings, so the serving server is left as "
                                   "it is: %s" % (self.name, "; ".join(problems)), **self.result)

    # -- the states ---------------------------------------------------------------------------
    def started(self, force_restart: bool = False) -> dict:
        self.lock.check(self.token)
        running = self.server.running_pid()
        launching = force_restart or self._needs_launch(running)
        # Outside a window a server is expected to serve: one that is not running died or was stopped
        # by someone else, and the play says so. A window's own start finds it down by design.
        self.result["found_down"] = running is None and self.token == NO_WINDOW_TOKEN
        if self.check_mode:
            self.result.update(changed=launching, pid=running)
            return self.result
        if launching and running is not None:
            self._validate_before_replacing()
            self._take_window()
            self._arm("start")
            self._stop()
        if launching and running is None:
            self._take_over_from_guard()
            running = self.server.running_pid()
            launching = force_restart or self._needs_launch(running)
        try:
            if launching:
                self.result["changed"] = True
                self._launch()
            else:
                self._ready()
        except ServiceError as error:
            raise self._rearm_after_failure(error, "start")
        self._end_window()
        return self.result

    def restarted(self) -> dict:
        return self.started(force_restart=True)

    def stopped(self) -> dict:
        self.lock.check(self.token)
        running = self.server.running_pid()
        if self.check_mode or running is None:
            self.result.update(changed=running is not None, pid=running)
            return self.result
        self._take_window()
        self._arm("start")
        self._stop()
        self.result["pid"] = running
        return self.result

    def _memory_saver_info(self) -> dict:
        """The server's info (its keys redacted); the memory saver checked first, without which nothing else matters."""
        info = self.api.server_info()
        if info is None:
            raise ServiceError("%s: %s/server_info (and /get_server_info) gave %s: the server is not serving (or "
                               "api_key is wrong), so it is not released"
                               % (self.name, self.api.url, self.api.server_info_answer().describe()))
        if not info.get("enable_memory_saver"):
            raise ServiceError(
                "%s runs without --enable-memory-saver: a release would answer 200 and free nothing. Launch it with "
                "--enable-memory-saver (sglang_service_memory_saver: true) or use the stop window "
                "(specops_gpu_window_mode: stop)" % self.name)
        return info

    def _release_problems(self, info: dict, plan: dict) -> list:
        """Every check of a release against the server's version, flags and environment; the errors found."""
        problems = []
        try:
            note = check_abort_pause(self.name, info.get("version"), bool(self.params.get("accept_abort_pause")),
                                     bool(self.params.get("drained")))
            if note:
                self.result["abort_pause"] = note
        except ServiceError as error:
            problems.append(error)
        bound = min(float(self.window["guard_after"]), float(self.window["max_downtime"]))
        planned = float(self.window.get("planned_seconds") or bound)
        try:
            figures = check_waiting_timeout(self.name, process_environment(self.server.running_pid()), planned, bound)
            self.result["waiting_timeout"] = figures
            if figures.get("warning"):
                self.result.setdefault("warnings", []).append(figures["warning"])
        except ServiceError as error:
            problems.append(error)
        try:
            check_memory_flags(self.name, info, plan["tags"])
        except ServiceError as error:
            problems.append(error)
        return problems

    def _memory_plan(self, info: dict, gpus) -> dict:
        """What the release frees: the KV cache (weights resident) where the extraction fits, else every tag."""
        explicit = list(self.params.get("tags") or [])
        return plan_release(info, gpus, self.params.get("extraction_gpu") or {}, self.params["release"],
                            int(self.params["gpu_reserve_mib"]), explicit)

    def released(self) -> dict:
        info = self._memory_saver_info()  # before anything is touched
        gpu_ids = self.params.get("gpu_ids") or []
        gpu_before = gpu_memory_used(gpu_ids)
        plan = self._memory_plan(info, gpu_before)
        # Every problem in one refusal: an operator fixes them all after one refused run.
        problems = self._release_problems(info, plan)
        if problems:
            raise one_refusal(problems, memory_plan=plan)
        tags = plan["tags"]
        self.result.update(version=info.get("version"), released_tags=tags, memory_plan=plan,
                           memory_saver_backend=info.get("memory_saver_backend"))
        self.lock.check(self.token)
        if is_released(self.state_dir):
            self.result["msg"] = "already released (marker %s)" % ReleasedMarker(self.state_dir).path
            return self.result
        if self.check_mode:
            self.result["changed"] = True
            return self.result
        # While it serves, so that the checksum adds nothing to the downtime; proven again after the resume.
        weights_before = self.api.weights_checksum() if offers(info.get("version"), "weights_checker") else None
        self._take_window()
        self._arm("resume")
        marker = ReleasedMarker(self.state_dir)
        outcome = "not sent"
        self.result["down_at"] = time.time()
        try:
            self.result["pause_mode"] = pause_without_losing_requests(
                self.api, info.get("version"), float(self.params["drain_timeout"]), float(self.params["ready_delay"]))
            if self.result["pause_mode"] == "retract":
                flush_through_grammar_queue(self.api, info.get("version"), float(self.params["drain_timeout"]),
                                            float(self.params["ready_delay"]))
            else:
                flush_until_idle(self.api, float(self.params["drain_timeout"]), float(self.params["ready_delay"]))
            marker.write(tags, self.result["down_at"], weights_checksum=weights_before)
            answer = self.api.release(tags)
            outcome = release_outcome(answer)
            if outcome != "released":
                raise ServiceError("POST %s/release_memory_occupation gave %s" % (self.api.url, answer.describe()))
            self.result["released_at"] = time.time()
            self.result["gpu_memory"] = wait_memory_dropped(gpu_before, gpu_ids,
                                                            int(self.params["release_max_used_mib"]),
                                                            float(self.params["drain_timeout"]),
                                                            expected_used_after(plan, gpu_before))
            if self.params.get("go_file"):
                # The waiting extraction starts the moment the memory is free, not a few tasks later.
                write_json(self.params["go_file"], {"signal": "go", "at": time.time()})
                self.result["go_at"] = time.time()
        except ServiceError as error:
            raise self._release_failed(error, marker, outcome, tags)
        self.result["changed"] = True
        return self.result

    def _release_failed(self, error: ServiceError, marker: ReleasedMarker, outcome: str, tags: list) -> ServiceError:
        """Whatever failed, the server must serve again; the window ends only once it does."""
        if outcome == "unknown":
            # Nothing answered: the release may have happened. SGLang says nowhere which tags it holds
            # released (sglang 0.5.23 srt/managers/scheduler_components/weight_updater.py:96, :349), a
            # resume of a tag that is not released kills the whole tree (:390, then managers/scheduler.py:
            # 6370-6373), and so may a second release: only a restart gives a known state back.
            if self.server.running_pid() is None:
                return self._restart_in_window(error, "the server died during the release")
            return self._restart_in_window(error, "the release was not answered, so whether it freed anything is "
                                                  "unknown and a resume could kill the server")
        undone = self._undo_release(error, marker, outcome == "released", tags)
        try:
            self._ready()
        except ServiceError as not_ready:
            if "port_holder" in not_ready.fields:
                return self._fail_ending_window(undone, "was not released")
            # sglang 0.5.23 kills the whole tree on a release that finds the scheduler busy
            # (weight_updater.py:339, then managers/scheduler.py:6370-6373).
            return self._restart_in_window(undone, "it did not serve afterwards (%s)" % not_ready.msg.split(". ")[0])
        return self._fail_ending_window(undone, "was not released")

    def _restart_in_window(self, error: ServiceError, why: str) -> ServiceError:
        """Start the server again from disk (stopping what is left of it), as the window's holder; the error
        to fail with, saying so. Should that fail too, the guard is armed again to start it."""
        down_at = self.result.get("down_at")
        try:
            self._take_over_from_guard()  # an armed guard would resume what this restarts
            ReleasedMarker(self.state_dir).drop()
            self._stop()
            self._launch()
        except ServiceError as restart_error:
            return self._rearm_after_failure(
                ServiceError("%s was not released: %s; %s, and starting it again failed: %s"
                             % (self.name, error.msg, why, restart_error.msg), **error.fields), "start")
        self.result.update(changed=True, restarted=True, down_at=down_at)
        self._end_window()
        return ServiceError("%s was not released: %s; %s: it was started again from disk and serves (pid %s); any "
                            "request it held was lost" % (self.name, error.msg, why, self.result.get("pid")),
                            **dict(error.fields, **self.result))

    def _undo_release(self, error: ServiceError, marker: ReleasedMarker, released: bool, tags: list) -> ServiceError:
        """Leave the server serving: resume what was released (once), then continue generation."""
        notes = []
        claimed = marker.claim() if released else None
        if claimed is not None:
            try:
                resume_claimed(self.api, claimed.get("tags") or tags, self.api.timeout)
                notes.append("what was released was resumed")
            except ServiceError as resume_error:
                notes.append(resume_error.msg)
        else:
            marker.drop()
        answer = self.api.continue_generation()
        notes.append("generation continued (%s)" % answer.describe() if not answer.ok else "generation continued")
        return ServiceError("%s; %s" % (error.msg, "; ".join(notes)), **error.fields)

    def resumed(self) -> dict:
        # For the window's record: what the play spent before the resume began is not the resume's.
        self.result["called_at"] = time.time()
        self.lock.check(self.token)
        if self.check_mode:
            self.result["changed"] = is_released(self.state_dir)
            return self.result
        self._take_over_from_guard()
        claimed = ReleasedMarker(self.state_dir).claim()
        running = self.server.running_pid()
        try:
            if running is None:
                # Killed inside the window: there is nothing to resume, the server must start.
                self.result.update(changed=True, started_instead=True,
                                   msg="the server was gone: started it instead of resuming")
                self._launch()
            else:
                self._resume_and_check(claimed)
                if claimed is not None and claimed.get("weights_checksum"):
                    self._prove_weights(claimed["weights_checksum"])
                self._take_guards_resume()
        except ServiceError as error:
            raise self._rearm_after_failure(
                ServiceError("%s was not resumed: %s" % (self.name, error.msg), **error.fields), "resume")
        self._end_window()
        return self.result

    def one_step_window(self) -> dict:
        """The memory-saver window as one step on the host (docs/window.md): release and let the work go, hear
        the work's end while the guard, armed to resume at that end, brings the server back, then take the
        window back as `resumed` does. Whatever fails, the guard stays armed or `resumed` brings it back."""
        if not self.params.get("resume_when_done") or not self.params["guard"]:
            raise ServiceError("%s is left as it is: state window needs resume_when_done (the files that say the "
                               "window's work has ended) and the guard, which resumes the server at that end"
                               % self.name)
        self.released()
        if self.check_mode:
            return self.result
        released = dict(self.result)
        self.result["work_finished_at"] = self._hear_work_end()
        self.resumed()
        # What `resumed` returns of its own is kept; the release's moments are this call's too.
        for key in ("down_at", "released_at", "go_at", "pause_mode", "version", "memory_plan", "released_tags",
                    "memory_saver_backend", "gpu_memory", "waiting_timeout", "abort_pause"):
            if key in released and key not in self.result:
                self.result[key] = released[key]
        self.result["stages"] = window_stages(self.result)
        self.result["changed"] = True
        return self.result

    def _hear_work_end(self) -> float | None:
        """Wait until the guard has resumed the server at the work's end (or has fired, or is gone); the
        moment the work said finished (its state file's `at`), None where no file says it."""
        done_files = list(self.params.get("resume_when_done") or [])
        fired_file = os.path.join(self.state_dir, "guard.result.json")
        fire_after = min(float(self.window["guard_after"]), float(self.window["max_downtime"]))
        deadline = time.monotonic() + fire_after + float(self.params["ready_timeout"])
        with FileWatch(done_files + [fired_file]) as watch:
            while time.monotonic() < deadline:
                fired = read_json(fired_file)
                if isinstance(fired, dict) and fired.get("token") == self.token:
                    break
                if guard_control.current_guard(self.state_dir) is None:
                    break  # no guard left to resume: `resumed` brings the server back itself
                watch.wait(min(1.0, max(0.0, deadline - time.monotonic())))
        moments = [finished_moment(path) for path in done_files]
        return max([moment for moment in moments if moment is not None] or [None])

    def _take_guards_resume(self) -> None:
        """The guard resumed at the work's end (resume_when_done): its first 200 is the service's return."""
        path = os.path.join(self.state_dir, "guard.result.json")
        fired = read_json(path)
        if not isinstance(fired, dict) or fired.get("token") != self.token:
            return
        remove(path)
        if fired.get("arm_id"):
            # The guard's record of this window as an outage, for a play lost after its work ended: this play
            # was not lost, and records the window itself.
            remove(os.path.join(outages_dir(self.state_dir), "%s.json" % fired["arm_id"]))
        if fired.get("work_ended") and fired.get("started_pid"):
            # The server was gone at the work's end (killed inside the window): the guard started it instead.
            self.result.update(changed=True, started_instead=True, resumed_by="guard, at the end of the window's work",
                               resume_started_at=fired.get("fired_at"),
                               msg="the server was gone: the guard started it instead of resuming")
        if fired.get("work_ended") and fired.get("resumed") and fired.get("ready_at"):
            self.result.update(changed=True, resumed_by="guard, at the end of the window's work",
                               resume_started_at=fired.get("fired_at"),
                               ready_at=min(float(fired["ready_at"]), float(self.result.get("ready_at") or 1e18)))
            self.result.pop("msg", None)
            if fired.get("weights_checksum"):
                self._prove_weights(fired["weights_checksum"])

    def _resume_and_check(self, claimed: dict | None) -> None:
        """Resume (once) or continue, then make sure the server answers: a resume whose allocation fails
        kills the scheduler and the whole tree (sglang 0.5.23 srt/managers/scheduler_components/
        weight_updater.py:383-406, managers/scheduler.py:6370-6373), so a server that does not serve
        afterwards is started again from disk."""
        try:
            if claimed is not None:
                answers = resume_claimed(self.api, claimed.get("tags") or [], self.api.timeout)
                self.result.update(changed=True, **answers)
            else:
                # Nothing to resume (the guard did it, or nothing was released): never left paused.
                self.api.continue_generation()
                self.result["msg"] = "not released: nothing to resume"
            # Back from a window: the first token answered is the service's return (readiness.wait_ready).
            self._ready(serving=True)
        except ServiceError as error:
            if "port_holder" in error.fields:
                raise
            self._stop()
            self._launch()
            self.result.update(changed=True, started_instead=True, restarted=True, msg=(
                "the server did not serve after the resume (%s): started it again from disk"
                % error.msg.split(". ")[0]))

    def _prove_weights(self, before: str) -> None:
        """/health_generate answers 200 even with garbage weights: compare the weights' checksum with the one taken
        before the release (sglang 0.5.23 srt/entrypoints/http_server.py:1599-1620), and restart the server from
        disk when they differ."""
        after = self.api.weights_checksum()
        check = {"before": before, "after": after, "matched": after == before}
        self.result["weights_check"] = check
        if check["matched"]:
            return
        self.result.setdefault("warnings", []).append(
            "%s: the weights' checksum after the resume (%s) differs from the one before the release (%s): the server "
            "was restarted to load its weights from disk; requests it held were lost"
            % (self.name, after or "none answered", before))
        self._stop()
        self._launch()
        check["restarted"] = True
        check["after_restart"] = self.api.weights_checksum()
        if check["after_restart"] != before:
            raise ServiceError("%s: after a restart the weights' checksum is %s, not %s as before the release: the "
                               "weights on disk are not the ones it served"
                               % (self.name, check["after_restart"], before), weights_check=check)

    def run(self) -> dict:
        # self.window holds the window's settings: the state of that name is the window in one step.
        state = self.params["state"]
        result = self.one_step_window() if state == "window" else getattr(self, state)()
        if self.params["state"] in ("started", "restarted", "resumed", "window") and os.path.isdir(self.state_dir):
            # Outages a guard ended (the play that began them was lost): they go on this run's record.
            result["earlier_outages"] = take_outages(self.state_dir, self.check_mode)
        return result
