# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What refuses a memory-saver release before anything is touched, read from the server's info and environment.

Each check names the SGLang behaviour that would lose the service, a request or the weights, and the fix.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError
from ansible_collections.specops.drafter.plugins.module_utils.service.sglang_api import has_pause_modes, releases_weights

# Seconds a request may wait in the scheduler's queue before SGLang aborts it with 503 (0.5.23
# srt/environ.py:685, -1 = off; srt/managers/scheduler.py:3605-3620). Retracted requests wait there for the window.
WAITING_TIMEOUT_VARIABLE = "SGLANG_REQ_WAITING_TIMEOUT"


def process_environment(pid, proc_root: str = "/proc") -> dict | None:
    """The environment a process was started with (/proc/<pid>/environ); None where it cannot be read."""
    if not pid:
        return None
    try:
        with open("%s/%d/environ" % (proc_root, int(pid)), "rb") as handle:
            raw = handle.read()
    except (IOError, OSError):
        return None
    pairs = (entry.decode("utf-8", "replace").partition("=") for entry in raw.split(b"\0") if entry)
    return dict((key, value) for key, dummy, value in pairs)


def waiting_timeout(environment: dict | None) -> float | None:
    """SGLANG_REQ_WAITING_TIMEOUT in seconds when it is on (> 0), else None."""
    try:
        seconds = float((environment or {}).get(WAITING_TIMEOUT_VARIABLE, "") or -1)
    except ValueError:
        return None
    return seconds if seconds > 0 else None


def check_memory_flags(name: str, info: dict, tags: list) -> None:
    if not info.get("enable_memory_saver"):
        raise ServiceError(
            "%s runs without --enable-memory-saver: a release would answer 200 and free nothing. Launch it with "
            "--enable-memory-saver --enable-weights-cpu-backup (sglang_service_memory_saver: true) or use the "
            "stop window (specops_gpu_window_mode: stop)" % name)
    if releases_weights(tags) and not info.get("enable_weights_cpu_backup"):
        raise ServiceError(
            "%s runs without --enable-weights-cpu-backup: releasing its weights (tags %s) throws their content "
            "away, and after the resume it serves garbage while /health_generate says 200. Launch it with "
            "--enable-weights-cpu-backup (sglang_service_memory_saver: true), or release only the KV cache "
            "(sglang_service_release: kv_cache)" % (name, tags or "[] = every tag"))
    mode = info.get("weight_cache_mode")
    if releases_weights(tags) and mode not in (None, "", "off"):
        # sglang 0.5.23 srt/managers/scheduler_components/weight_updater.py:293-307, raised at :368-369 inside the
        # scheduler, which then takes the whole server down.
        raise ServiceError(
            "%s runs with --weight-cache-mode %s: SGLang refuses to release weights shared with the weight cache "
            "daemon by raising inside its scheduler, which kills the server. Restart it with --weight-cache-mode off, "
            "or release only the KV cache (sglang_service_release: kv_cache)" % (name, mode))


def check_abort_pause(name: str, version, accept_abort_pause: bool, drained: bool) -> str | None:
    """Refuse the abort-only pause of versions without pause modes unless drained or accepted; the note to return."""
    if has_pause_modes(version):
        return None
    if drained:
        return "drained through the router before the pause"
    if accept_abort_pause:
        return "the operator accepted that a request arriving between the drain and the pause is aborted"
    # sglang 0.5.4 srt/managers/tokenizer_manager.py:1090-1093 (the pause aborts every request) and
    # srt/managers/scheduler.py:2363-2385 (/get_load counts only what the scheduler holds).
    raise ServiceError(
        "%s runs SGLang %s, whose pause aborts every request in flight: the window waits until /get_load counts "
        "none, but a request that arrives after that reading (or is still being tokenized, which /get_load does "
        "not count) is aborted by the pause. Drain the server through its router first (sglang_router_url), use "
        "the stop window (specops_gpu_window_mode: stop), or accept that risk with sglang_service_accept_abort_pause: "
        "true" % (name, version or "of unknown version"))


def check_waiting_timeout(name: str, environment: dict | None, planned: float, bound: float) -> dict:
    """Refuse a window planned to outlast SGLANG_REQ_WAITING_TIMEOUT; the figures (and a warning where only the
    guard's bound outlasts it)."""
    timeout = waiting_timeout(environment)
    if environment is None:
        return {"read": False, "note": "the server's environment could not be read (%s not checked)"
                                       % WAITING_TIMEOUT_VARIABLE}
    if timeout is None:
        return {"read": True, "seconds": None}
    figures = {"read": True, "seconds": timeout, "planned_seconds": planned, "guard_seconds": bound}
    if planned > timeout:
        raise ServiceError(
            "%s runs with %s=%g: requests retracted at the pause wait in its queue through the window and are "
            "aborted with 503 after %g s, and this window is planned to last %g s. Use the stop window "
            "(specops_gpu_window_mode: stop), or restart the server without %s or with a value above the window"
            % (name, WAITING_TIMEOUT_VARIABLE, timeout, timeout, planned, WAITING_TIMEOUT_VARIABLE),
            waiting_timeout=figures)
    if bound > timeout:
        figures["warning"] = (
            "%s=%g on %s: the window is planned for %g s, but should it last past %g s (the guard allows %g s) the "
            "requests held at the pause are aborted with 503"
            % (WAITING_TIMEOUT_VARIABLE, timeout, name, planned, timeout, bound))
    return figures
