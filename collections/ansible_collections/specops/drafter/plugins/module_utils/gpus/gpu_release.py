# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Free the GPUs of our own processes, and only those: find holders, classify, signal, prove.

Finding and classifying the holders (who is ours) is in gpu_release_holders; this file signals
ours (SIGTERM, then SIGKILL, each pinned by its start time) and waits until NVML shows the memory
free. Standard library only, as gpu_release_holders.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import os
import signal
import time

# The option defaults, NVML and the helpers the tests call are re-exported: this file stays the one
# the module and the tests import.
from ansible_collections.specops.drafter.plugins.module_utils.common.procfs import (  # noqa: F401  # pylint: disable=unused-import
    list_pids,
    read_proc,
    read_stat,
    scan_fd_holders,
)
from ansible_collections.specops.drafter.plugins.module_utils.gpus.gpu_release_holders import (  # noqa: F401  # pylint: disable=unused-import
    DEFAULT_DEVICE_PATTERN,
    DEFAULT_PATTERNS,
    DEFAULT_PROTECTED,
    GpuReleaseError,
    HAS_PYNVML,
    Nvml,
    PYNVML_IMPORT_ERROR,
    SGLANG_PATTERNS,
    classify,
    compile_patterns,
    holder_entry,
    in_cgroup,
    is_reparented,
    load_tree,
    match_reason,
    open_nvml,
    own_tree,
    _pid1_name,
    _slice_path,
    snapshot,
    spare,
    unit_cgroup,
)

DEFAULT_GRACE = 10.0
DEFAULT_TIMEOUT = 60.0
DEFAULT_MEMORY_THRESHOLD_MB = 1024
POLL_S = 0.05


# --- signalling -----------------------------------------------------------------------------------


class Target(object):
    """One process to stop, pinned by its start time (and a pidfd where the kernel has them)."""

    def __init__(self, proc, reason, proc_root="/proc"):
        self.proc = proc
        self.reason = reason
        self.proc_root = proc_root
        self.signal = None
        self.exited_s = None
        self.pidfd = None
        if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal") and proc_root == "/proc":
            try:
                self.pidfd = os.pidfd_open(proc.pid)
            except OSError:
                self.pidfd = None
            # The pid may have been reused between the scan and pidfd_open.
            if self.pidfd is not None and not self.same_process():
                self.close()

    def same_process(self):
        stat = read_stat(self.proc.pid, self.proc_root)
        return stat is not None and stat[4] == self.proc.starttime

    def alive(self):
        """Running: a zombie has released its files and only awaits its parent's wait()."""
        stat = read_stat(self.proc.pid, self.proc_root)
        return stat is not None and stat[4] == self.proc.starttime and stat[0] not in ("Z", "X")

    def state(self):
        stat = read_stat(self.proc.pid, self.proc_root)
        return stat[0] if stat and stat[4] == self.proc.starttime else "gone"

    def send(self, signum):
        if not self.alive():
            return False
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signum)
            else:
                os.kill(self.proc.pid, signum)
        except OSError:
            return False
        return True

    def close(self):
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _wait_all_exited(targets, deadline, t0):
    while True:
        now = time.monotonic()
        for target in targets:
            if target.exited_s is None and not target.alive():
                target.exited_s = round(now - t0, 3)
        pending = [t for t in targets if t.exited_s is None]
        if not pending or now >= deadline:
            return pending
        time.sleep(POLL_S)


def terminate(targets, grace, timeout, t0):
    """SIGTERM, up to `grace` s, SIGKILL, up to `timeout` s; returns (timeline, still alive)."""
    timeline = {}
    for target in targets:
        if target.send(signal.SIGTERM):
            target.signal = "SIGTERM"
        else:
            target.exited_s = round(time.monotonic() - t0, 3)
    timeline["sigterm_s"] = round(time.monotonic() - t0, 3)
    pending = _wait_all_exited(targets, time.monotonic() + grace, t0)
    if pending:
        for target in pending:
            if target.send(signal.SIGKILL):
                target.signal = "SIGKILL"
        timeline["sigkill_s"] = round(time.monotonic() - t0, 3)
        pending = _wait_all_exited(pending, time.monotonic() + timeout, t0)
    timeline["exited_s"] = round(time.monotonic() - t0, 3)
    return timeline, pending


def _memory_excess(gpus, nvml_procs, spared):
    """Per GPU: used memory minus what the processes we leave alone hold (NVML's own count)."""
    spared_mb = {}
    for pid, entries in nvml_procs.items():
        if pid in spared:
            for index, used_mb in entries:
                spared_mb[index] = spared_mb.get(index, 0) + (used_mb or 0)
    return dict((gpu["index"], gpu["used_mb"] - spared_mb.get(gpu["index"], 0)) for gpu in gpus)


def wait_memory(nvml, threshold_mb, deadline, spared_pids):
    """Poll NVML until every GPU is under the threshold or the deadline; (ok, gpus, procs)."""
    while True:
        gpus, nvml_procs = nvml.read()
        excess = _memory_excess(gpus, nvml_procs, spared_pids)
        for gpu in gpus:
            gpu["ours_mb"] = excess[gpu["index"]]
        if all(value <= threshold_mb for value in excess.values()) or time.monotonic() >= deadline:
            return all(value <= threshold_mb for value in excess.values()), gpus, nvml_procs
        time.sleep(POLL_S)


# --- the whole operation ----------------------------------------------------------------------------


def validate(params):
    patterns = list(params.get("patterns") or [])
    if not patterns and not params.get("unit") and not params.get("tree_file"):
        raise GpuReleaseError(
            "nothing would be ours: 'patterns' is empty and no 'unit' or 'tree_file' is given; name the "
            "systemd unit that runs the server, the tree file its stop recorded, or a command-line regex"
        )
    if not params.get("device_pattern"):
        raise GpuReleaseError("'device_pattern' is empty: give a glob of GPU device files, e.g. /dev/nvidia*")
    for key in ("grace", "timeout", "memory_threshold_mb"):
        if params.get(key) is not None and params[key] < 0:
            raise GpuReleaseError("'%s' is %s: it must be zero or more" % (key, params[key]))
    if params.get("nvml", "auto") not in ("auto", "true", "false"):
        raise GpuReleaseError("'nvml' is %r: use auto, true or false" % params.get("nvml"))
    return compile_patterns(patterns)


def release(params, check_mode=False, proc_root="/proc", self_pid=None, run_command=None):
    """Find, classify and (unless check_mode) stop our GPU holders, then prove the memory is free.

    params: unit, patterns, device_pattern, protected, allow_foreign, grace, timeout,
    memory_threshold_mb, orphans, nvml. Returns the result dict; raises GpuReleaseError with
    `result` attached when the GPUs cannot be proven free of ours or a foreign holder is found.
    """
    start = time.monotonic()
    patterns = validate(params)
    cgroup = unit_cgroup(params["unit"], run_command, proc_root) if params.get("unit") else None
    recorded = load_tree(params.get("tree_file"))
    protected = list(params.get("protected") or ())
    nvml = open_nvml(params.get("nvml", "auto"))
    try:
        return _release(params, check_mode, proc_root, self_pid, start, patterns, cgroup, protected, nvml, recorded)
    finally:
        if nvml:
            nvml.close()


def _release(params, check_mode, proc_root, self_pid, start, patterns, cgroup, protected, nvml, recorded):
    fd_holders, unreadable, gpus_before, nvml_procs, procs = snapshot(params["device_pattern"], nvml, proc_root)
    self_tree = own_tree(procs, os.getpid() if self_pid is None else self_pid)
    # Only an open device file proves a holder in our PID namespace; NVML pids may be another's.
    groups = classify(
        set(fd_holders), procs, patterns, cgroup, protected, params.get("orphans", True), self_tree, recorded
    )
    spare(groups, set(params.get("spare_pids") or ()))
    foreign = [holder_entry(p, r, fd_holders, nvml_procs) for p, r in groups["foreign"]]
    for pid in sorted(set(nvml_procs) - set(fd_holders)):
        if pid not in self_tree and pid not in procs:
            foreign.append(
                {"pid": pid, "ppid": None, "user": None, "cmdline": None, "devices": [],
                 "reason": "listed by NVML but not visible in this PID namespace",
                 "nvml": [{"gpu": i, "used_mb": u} for i, u in nvml_procs[pid]]}
            )
    result = {
        # Only a signal sent is a change: check mode and refusals report changed=false.
        "changed": False,
        "would_signal": len(groups["ours"]),
        "unit_cgroup": cgroup,
        "targets": [holder_entry(p, r, fd_holders, nvml_procs) for p, r in groups["ours"]],
        "killed": [],
        "foreign": foreign,
        "protected": [holder_entry(p, r, fd_holders, nvml_procs) for p, r in groups["protected"]],
        "own_tree": [holder_entry(p, r, fd_holders, nvml_procs) for p, r in groups["own_tree"]],
        "unreadable_pids": unreadable,
        "nvml": nvml is not None,
        "gpus_before": gpus_before,
        "gpus_after": gpus_before,
        "timeline": {},
        "elapsed_s": 0.0,
    }
    if foreign and not params.get("allow_foreign", False):
        result["elapsed_s"] = round(time.monotonic() - start, 3)
        raise GpuReleaseError(
            "%d GPU holder(s) are not ours, so nothing was signalled: %s; stop them yourself, add a "
            "pattern that matches them, or set allow_foreign=true to free ours and leave them running"
            % (len(foreign), "; ".join("pid %s (user %s): %s" % (f["pid"], f["user"], f["cmdline"]) for f in foreign)),
            result,
        )
    if check_mode:
        result["elapsed_s"] = round(time.monotonic() - start, 3)
        return result

    result["changed"] = bool(groups["ours"])
    targets = [Target(p, r, proc_root) for p, r in groups["ours"]]
    t0 = time.monotonic()
    timeline, stuck = {}, []
    try:
        if targets:
            timeline, stuck = terminate(targets, float(params.get("grace", DEFAULT_GRACE)),
                                        float(params.get("timeout", DEFAULT_TIMEOUT)), t0)
    finally:
        for target in targets:
            target.close()
    result["timeline"] = timeline
    for target in targets:
        entry = target.proc.describe()
        entry.update({"signal": target.signal, "reason": target.reason, "exited_s": target.exited_s})
        result["killed"].append(entry)
    deadline = time.monotonic() + float(params.get("timeout", DEFAULT_TIMEOUT))
    if stuck:
        result["elapsed_s"] = round(time.monotonic() - start, 3)
        raise GpuReleaseError(
            "%d of our process(es) survived SIGKILL for %ss: %s; a process in state D is stuck in the "
            "kernel (often the GPU driver) and only a driver reset or reboot frees it"
            % (len(stuck), params.get("timeout"), "; ".join(
                "pid %d state %s: %s" % (t.proc.pid, t.state(), t.proc.cmdline) for t in stuck)),
            result,
        )
    spared = set(p.pid for group in ("foreign", "protected", "own_tree") for p, dummy in groups[group])
    spared.update(f["pid"] for f in foreign)
    if nvml:
        ok, gpus_after, nvml_after = wait_memory(nvml, params.get("memory_threshold_mb", DEFAULT_MEMORY_THRESHOLD_MB),
                                                 deadline, spared)
        result["gpus_after"] = gpus_after
        timeline["memory_free_s"] = round(time.monotonic() - t0, 3) if ok else None
        if not ok:
            holders, dummy = scan_fd_holders(params["device_pattern"], proc_root)
            result["elapsed_s"] = round(time.monotonic() - start, 3)
            raise GpuReleaseError(
                "GPU memory is still in use %ss after our processes exited: %s; remaining holders: %s"
                % (params.get("timeout"), ", ".join(
                    "GPU %d %d MiB used (%d MiB not explained by processes we leave alone, threshold %d)"
                    % (g["index"], g["used_mb"], g["ours_mb"], params.get("memory_threshold_mb"))
                    for g in gpus_after), _describe_pids(holders, nvml_after, proc_root) or "none visible"),
                result,
            )
    # Something ours that still holds a device was started after the scan (a restart policy?).
    holders, dummy = scan_fd_holders(params["device_pattern"], proc_root)
    back = []
    for pid in holders:
        proc = read_proc(pid, proc_root)
        if pid not in spared and pid not in self_tree and proc and match_reason(proc, patterns, cgroup, recorded):
            back.append(pid)
    result["elapsed_s"] = round(time.monotonic() - start, 3)
    if back:
        raise GpuReleaseError(
            "ours hold the GPUs again after the release: %s; a restart policy started them again, so "
            "stop the unit (systemctl stop) before releasing"
            % _describe_pids(dict((p, holders[p]) for p in back), {}, proc_root),
            result,
        )
    return result


def _describe_pids(fd_holders, nvml_procs, proc_root):
    parts = []
    for pid in sorted(set(fd_holders) | set(nvml_procs)):
        proc = read_proc(pid, proc_root)
        parts.append("pid %d (%s)" % (pid, proc.cmdline if proc else "not visible here"))
    return ", ".join(parts)
