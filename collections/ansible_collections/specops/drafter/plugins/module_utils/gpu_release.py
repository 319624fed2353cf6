# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Free the GPUs of our own processes, and only those: find holders, classify, signal, prove.

Standard library only (it runs under any managed host's Python, without the ML environment);
pynvml is used when importable, for per-GPU memory and NVML's process list.

Who is "ours": a process in the named systemd unit's cgroup, a process recorded (pid and start
time) in the tree file as part of the server before it was stopped, a process whose command line
matches one of the patterns (none by default: a title such as sglang::scheduler is shared by every
SGLang on the host, ours or another tenant's), and (orphans) their kin: a holder descended from such a process, or
re-parented away from its dead parent while sharing its process group with such a process. Never: PID 1, this process, its ancestors and
descendants, protected daemons (nvidia-persistenced, DCGM, X servers, ...). Everything else
holding a GPU is foreign: reported, never signalled.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json
import os
import re
import signal
import time
import traceback

from ansible_collections.specops.drafter.plugins.module_utils.procfs import (  # noqa: F401 (re-exported for tests)
    _read,
    list_pids,
    read_proc,
    read_stat,
    scan_fd_holders,
)

try:
    import pynvml

    HAS_PYNVML = True
    PYNVML_IMPORT_ERROR = None
except ImportError:
    pynvml = None
    HAS_PYNVML = False
    PYNVML_IMPORT_ERROR = traceback.format_exc()

DEFAULT_DEVICE_PATTERN = "/dev/nvidia*"
# SGLang's launcher (`python -m sglang.launch_server`, `sglang serve`) and the titles its
# workers give themselves with setproctitle. They match EVERY SGLang on the host, so they are not
# a default: use them only on a host that runs no other tenant's SGLang.
SGLANG_PATTERNS = (
    r"sglang\.launch_server",
    r"(^|[/ ])sglang serve( |$)",
    r"^sglang::scheduler",
    r"^sglang::detokenizer",
    r"^sglang::data_parallel_controller",
)
DEFAULT_PATTERNS = ()
# Daemons that hold the devices by design and own no workload memory.
DEFAULT_PROTECTED = (
    "nvidia-persistenced",
    "nv-hostengine",
    "nvidia-dcgm",
    "dcgm-exporter",
    "nv-fabricmanager",
    "nvidia-fabricmanager",
    "Xorg",
    "Xwayland",
    "gnome-shell",
    "kwin_wayland",
)
DEFAULT_GRACE = 10.0
DEFAULT_TIMEOUT = 60.0
DEFAULT_MEMORY_THRESHOLD_MB = 1024
POLL_S = 0.05
# /proc/<pid>/comm is the process name cut to 15 bytes.
COMM_LEN = 15


class GpuReleaseError(Exception):
    """A problem the user can act on; `result` holds what was learned before it."""

    def __init__(self, msg, result=None):
        super(GpuReleaseError, self).__init__(msg)
        self.msg = msg
        self.result = result or {}


# --- NVML ---------------------------------------------------------------------------------------


def _text(value):
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class Nvml(object):
    """Per-GPU memory and NVML's process list; a thin, closeable view of pynvml."""

    def __init__(self):
        pynvml.nvmlInit()

    def close(self):
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: B902 - closing must never mask the real result
            pass

    def read(self):
        """([{index, uuid, name, used_mb, total_mb}], {pid: [(gpu index, used_mb or None)]})."""
        gpus = []
        procs = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                {
                    "index": index,
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "used_mb": int(mem.used // (1024 * 1024)),
                    "total_mb": int(mem.total // (1024 * 1024)),
                }
            )
            listed = []
            for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    listed.extend(getattr(pynvml, getter)(handle))
                except Exception:  # noqa: B902 - one unsupported query must not hide the other
                    continue
            seen = set()
            for entry in listed:
                if entry.pid in seen:
                    continue
                seen.add(entry.pid)
                used = getattr(entry, "usedGpuMemory", None)
                # NVML reports "not available" (in containers, without rights) as None or a huge value.
                used_mb = int(used // (1024 * 1024)) if isinstance(used, int) and used < (1 << 60) else None
                procs.setdefault(entry.pid, []).append((index, used_mb))
        return gpus, procs


def open_nvml(mode):
    """An Nvml for mode 'true', 'auto' (None when unusable) or 'false' (None)."""
    if mode == "false":
        return None
    if not HAS_PYNVML:
        if mode == "true":
            raise GpuReleaseError(
                "nvml=true but pynvml is not importable on this host: install nvidia-ml-py "
                "for the Python that runs the module, or set nvml=auto"
            )
        return None
    try:
        return Nvml()
    except Exception as exc:  # noqa: B902 - NVMLError has no stable base across versions
        if mode == "true":
            raise GpuReleaseError("nvml=true but NVML did not initialise (%s): is the NVIDIA driver loaded?" % exc)
        return None


# --- who is ours --------------------------------------------------------------------------------


def compile_patterns(patterns):
    compiled = []
    for pattern in patterns:
        try:
            compiled.append((pattern, re.compile(pattern)))
        except re.error as exc:
            raise GpuReleaseError("pattern %r is not a valid regular expression (%s): fix or remove it" % (pattern, exc))
    return compiled


def _pid1_name(proc_root="/proc"):
    try:
        return _read("%s/1/comm" % proc_root).strip()
    except (IOError, OSError):
        return "unknown"


def _slice_path(slice_name):
    """systemd nests a-b.slice under a.slice: '/a.slice/a-b.slice'; '-.slice' is the root."""
    if not slice_name or slice_name == "-.slice":
        return ""
    parts = slice_name[: -len(".slice")].split("-")
    return "".join("/" + "-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def unit_cgroup(unit, run_command, proc_root="/proc", systemctl="systemctl"):
    """The cgroup path of a systemd unit; a clear error when systemd or the unit is missing.

    `run_command` is AnsibleModule.run_command (or anything returning rc, stdout, stderr as text).
    """
    name = unit if "." in unit else unit + ".service"
    pid1 = _pid1_name(proc_root)
    if pid1 != "systemd":
        raise GpuReleaseError(
            "unit %r cannot be resolved: systemd is not PID 1 on this host (PID 1 is %r), so no unit "
            "has a cgroup here; drop 'unit' and select the processes with 'patterns'" % (name, pid1)
        )
    try:
        rc, out, err = run_command([systemctl, "show", "--property=LoadState,ControlGroup,Slice", "--", name])
    except OSError as exc:
        raise GpuReleaseError("unit %r cannot be resolved: running systemctl failed (%s)" % (name, exc))
    props = {}
    for line in out.splitlines():
        key, dummy, value = line.partition("=")
        props[key] = value
    if rc != 0 or not props.get("LoadState"):
        raise GpuReleaseError(
            "unit %r cannot be resolved: systemctl show failed (exit %s): %s" % (name, rc, err.strip())
        )
    if props["LoadState"] in ("not-found", "bad-setting", "error"):
        raise GpuReleaseError(
            "unit %r does not exist on this host (LoadState=%s): check the name with "
            "'systemctl list-units --all %s'" % (name, props["LoadState"], name)
        )
    # A stopped unit reports no ControlGroup, yet leftovers stay in the cgroup it had.
    return props.get("ControlGroup") or "%s/%s" % (_slice_path(props.get("Slice", "")), name)


def in_cgroup(proc, cgroup):
    """True when the process sits in the unit's cgroup or below it.

    Inside a container without its own cgroup namespace (systemd-nspawn, some Docker setups),
    /proc/PID/cgroup shows the host's path ("/payload/system.slice/x.service") while the container's
    systemd reports its own ("/system.slice/x.service"): match on whole path components at the end.
    """
    unit = "/" + cgroup.strip("/")
    for path in proc.cgroups:
        path = "/" + path.strip("/")
        while path not in ("", "/"):
            if path.endswith(unit):  # unit starts with "/", so this ends on a component boundary
                return True
            path = path.rsplit("/", 1)[0]
    return False


def own_tree(procs, pid=None):
    """This process, its ancestors and its descendants: never to be signalled."""
    pid = os.getpid() if pid is None else pid
    tree = set()
    cursor = pid
    while cursor in procs and cursor not in tree:
        tree.add(cursor)
        cursor = procs[cursor].ppid
    children = {}
    for proc in procs.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in tree:
                tree.add(child)
                stack.append(child)
    return tree


def load_tree(path):
    """{pid: start time} recorded for the server's processes before it was stopped; {} if none."""
    if not path:
        return {}
    try:
        with open(path) as handle:
            entries = json.load(handle)
    except (IOError, OSError):
        return {}
    except ValueError as exc:
        raise GpuReleaseError("tree_file %s is not JSON (%s): delete it; the next stop records it again" % (path, exc))
    try:
        return dict((int(entry["pid"]), int(entry["starttime"])) for entry in entries)
    except (TypeError, KeyError, ValueError):
        raise GpuReleaseError(
            "tree_file %s must be a list of {pid, starttime} objects: delete it; the next stop records it again" % path
        )


def match_reason(proc, patterns, cgroup, recorded=None):
    """Why proc is ours by its own evidence (unit cgroup, recorded tree, command line), or None."""
    if cgroup and in_cgroup(proc, cgroup):
        return "in the cgroup of the unit (%s)" % cgroup
    if recorded and recorded.get(proc.pid) == proc.starttime:
        return "recorded in the server's process tree before it was stopped"
    for text, regex in patterns:
        if proc.cmdline and regex.search(proc.cmdline):
            return "command line matches %r" % text
    return None


def is_reparented(proc, procs):
    """Adopted after its parent died: by PID 1, or by a subreaper outside its process group."""
    if proc.ppid == 1:
        return True
    parent = procs.get(proc.ppid)
    return parent is not None and parent.pgid != proc.pgid


def _ours_ancestor(proc, procs, direct):
    seen = set()
    cursor = proc.ppid
    while cursor in procs and cursor not in seen and cursor > 1:
        if cursor in direct:
            return cursor
        seen.add(cursor)
        cursor = procs[cursor].ppid
    return None


def is_protected(proc, protected):
    names = proc.names
    return any(name in names or name[:COMM_LEN] == proc.comm for name in protected)


def spare(groups, pids):
    """Move the holders the caller spares (the extraction waiting for the GPUs) to the protected ones."""
    for name in ("ours", "foreign"):
        kept = [(p, r) for p, r in groups[name] if p.pid not in pids]
        groups["protected"].extend((p, "spared by the caller") for p, r in groups[name] if p.pid in pids)
        groups[name] = kept


def classify(holder_pids, procs, patterns, cgroup, protected, orphans, self_tree, recorded=None):
    """Split holders into ours (with the reason), protected, own_tree and foreign."""
    direct = {}
    for proc in procs.values():
        if proc.pid == 1 or proc.pid in self_tree or is_protected(proc, protected):
            continue
        reason = match_reason(proc, patterns, cgroup, recorded)
        if reason:
            direct[proc.pid] = reason
    ours_groups = {}
    for pid in direct:
        ours_groups.setdefault(procs[pid].pgid, pid)
    out = {"ours": [], "protected": [], "own_tree": [], "foreign": []}
    for pid in sorted(holder_pids):
        proc = procs.get(pid)
        if proc is None:
            continue
        if pid == 1 or is_protected(proc, protected):
            out["protected"].append((proc, "protected" if pid != 1 else "PID 1"))
        elif pid in self_tree:
            out["own_tree"].append((proc, "this module's own process tree"))
        elif pid in direct:
            out["ours"].append((proc, direct[pid]))
        elif orphans and _ours_ancestor(proc, procs, direct) is not None:
            kin = _ours_ancestor(proc, procs, direct)
            out["ours"].append((proc, "descendant of %d (%s)" % (kin, direct[kin])))
        elif orphans and proc.pgid in ours_groups and is_reparented(proc, procs):
            kin = ours_groups[proc.pgid]
            out["ours"].append(
                (proc, "orphan re-parented to %d, in process group %d with %d (%s)" % (
                    proc.ppid, proc.pgid, kin, direct[kin]))
            )
        else:
            out["foreign"].append((proc, "not in the unit, the recorded tree, a pattern or an orphan rule"))
    return out


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


def _snapshot(device_pattern, nvml, proc_root):
    fd_holders, unreadable = scan_fd_holders(device_pattern, proc_root)
    gpus, nvml_procs = nvml.read() if nvml else ([], {})
    procs = {}
    for pid in list_pids(proc_root):
        proc = read_proc(pid, proc_root)
        if proc is not None:
            procs[pid] = proc
    return fd_holders, unreadable, gpus, nvml_procs, procs


def _holder_entry(proc, reason, fd_holders, nvml_procs):
    entry = proc.describe()
    entry["reason"] = reason
    entry["devices"] = sorted(fd_holders.get(proc.pid, ()))
    entry["nvml"] = [{"gpu": index, "used_mb": used} for index, used in nvml_procs.get(proc.pid, [])]
    return entry


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
    fd_holders, unreadable, gpus_before, nvml_procs, procs = _snapshot(params["device_pattern"], nvml, proc_root)
    self_tree = own_tree(procs, os.getpid() if self_pid is None else self_pid)
    # Only an open device file proves a holder in our PID namespace; NVML pids may be another's.
    groups = classify(
        set(fd_holders), procs, patterns, cgroup, protected, params.get("orphans", True), self_tree, recorded
    )
    spare(groups, set(params.get("spare_pids") or ()))
    foreign = [_holder_entry(p, r, fd_holders, nvml_procs) for p, r in groups["foreign"]]
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
        "targets": [_holder_entry(p, r, fd_holders, nvml_procs) for p, r in groups["ours"]],
        "killed": [],
        "foreign": foreign,
        "protected": [_holder_entry(p, r, fd_holders, nvml_procs) for p, r in groups["protected"]],
        "own_tree": [_holder_entry(p, r, fd_holders, nvml_procs) for p, r in groups["own_tree"]],
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
