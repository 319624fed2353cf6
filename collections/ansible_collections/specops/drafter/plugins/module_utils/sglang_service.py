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

from ansible_collections.specops.drafter.plugins.module_utils import guard_control, procfs
from ansible_collections.specops.drafter.plugins.module_utils.memory_window import (
    ReleasedMarker,
    flush_until_idle,
    gpu_memory_used,
    is_released,
    pause_without_losing_requests,
    resume_claimed,
    wait_memory_dropped,
)
from ansible_collections.specops.drafter.plugins.module_utils.readiness import url_port, wait_port_free, wait_ready
from ansible_collections.specops.drafter.plugins.module_utils.service_errors import ServiceError
from ansible_collections.specops.drafter.plugins.module_utils.service_process import ProcessServer, launch_problems
from ansible_collections.specops.drafter.plugins.module_utils.service_systemd import SystemdUnit
from ansible_collections.specops.drafter.plugins.module_utils.sglang_api import SglangApi, releases_weights
from ansible_collections.specops.drafter.plugins.module_utils.state_files import ensure_dir, write_json
from ansible_collections.specops.drafter.plugins.module_utils.window_lock import NO_WINDOW_TOKEN, WindowLock

WINDOW_DEFAULTS = {"token": NO_WINDOW_TOKEN, "owner": "sglang_service without a window", "guard_after": 7200,
                   "max_downtime": 7200, "guard_grace": 60, "wait": 0}


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
        if self.adopted.get("api_key_required") and not params.get("api_key"):
            raise ServiceError("%s runs with --api-key: give its key as api_key (sglang_service_api_key)" % self.name)
        self.api = SglangApi(url, params.get("api_key") or "", float(params["health_timeout"]))
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
                  "action": action, "fire_after": fire_after, "grace": float(self.window["guard_grace"]),
                  "token": self.token, "watch_work": self.token != NO_WINDOW_TOKEN,
                  "health_timeout": self.api.timeout, "stop_timeout": float(self.params["stop_timeout"])}
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

    def _ready(self) -> dict:
        try:
            answer = wait_ready(self.api, self.server, float(self.params["ready_timeout"]),
                                float(self.params["ready_delay"]), float(self.params["health_timeout"]))
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
        info = self.api.server_info()
        if info is None:
            raise ServiceError("%s: %s/server_info (and /get_server_info) gave %s: the server is not serving (or "
                               "api_key is wrong), so it is not released"
                               % (self.name, self.api.url, self.api.server_info_answer().describe()))
        tags = list(self.params.get("tags") or [])
        if not info.get("enable_memory_saver"):
            raise ServiceError(
                "%s runs without --enable-memory-saver: a release would answer 200 and free nothing. Launch it with "
                "--enable-memory-saver --enable-weights-cpu-backup (sglang_service_memory_saver: true) or use the "
                "stop window (specops_gpu_window_mode: stop)" % self.name)
        if releases_weights(tags) and not info.get("enable_weights_cpu_backup"):
            raise ServiceError(
                "%s runs without --enable-weights-cpu-backup: releasing its weights (tags %s) throws their content "
                "away, and after the resume it serves garbage while /health_generate says 200. Launch it with "
                "--enable-weights-cpu-backup (sglang_service_memory_saver: true), or release only kv_cache and "
                "cuda_graph (sglang_service_release_tags)" % (self.name, tags or "[] = every tag"))
        return info

    def released(self) -> dict:
        info = self._memory_saver_info()  # before anything is touched
        tags = list(self.params.get("tags") or [])
        self.result.update(version=info.get("version"), released_tags=tags,
                           memory_saver_backend=info.get("memory_saver_backend"))
        self.lock.check(self.token)
        if is_released(self.state_dir):
            self.result["msg"] = "already released (marker %s)" % ReleasedMarker(self.state_dir).path
            return self.result
        if self.check_mode:
            self.result["changed"] = True
            return self.result
        self._take_window()
        self._arm("resume")
        gpu_before = gpu_memory_used(self.params.get("gpu_ids") or [])
        marker = ReleasedMarker(self.state_dir)
        released = False
        self.result["down_at"] = time.time()
        try:
            self.result["pause_mode"] = pause_without_losing_requests(
                self.api, info.get("version"), float(self.params["drain_timeout"]), float(self.params["ready_delay"]))
            flush_until_idle(self.api, float(self.params["drain_timeout"]), float(self.params["ready_delay"]))
            marker.write(tags, self.result["down_at"])
            answer = self.api.release(tags)
            if not answer.ok:
                raise ServiceError("POST %s/release_memory_occupation gave %s" % (self.api.url, answer.describe()))
            released = True
            self.result["gpu_memory"] = wait_memory_dropped(gpu_before, self.params.get("gpu_ids") or [],
                                                            int(self.params["release_max_used_mib"]),
                                                            float(self.params["drain_timeout"]))
        except ServiceError as error:
            raise self._fail_ending_window(self._undo_release(error, marker, released, tags), "was not released")
        self.result["changed"] = True
        return self.result

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
                if claimed is not None:
                    answers = resume_claimed(self.api, claimed.get("tags") or [], self.api.timeout)
                    self.result.update(changed=True, **answers)
                else:
                    # Nothing to resume (the guard did it, or nothing was released): never left paused.
                    self.api.continue_generation()
                    self.result["msg"] = "not released: nothing to resume"
                self._ready()
        except ServiceError as error:
            raise self._rearm_after_failure(
                ServiceError("%s was not resumed: %s" % (self.name, error.msg), **error.fields), "resume")
        self._end_window()
        return self.result

    def run(self) -> dict:
        return getattr(self, self.params["state"])()
