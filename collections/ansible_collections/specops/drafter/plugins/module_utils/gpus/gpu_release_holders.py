# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Find the GPU holders and classify them: ours (to stop), protected, our own tree, foreign.

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
import traceback

from ansible_collections.specops.drafter.plugins.module_utils.common.procfs import (
    _read,
    list_pids,
    read_proc,
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


# --- the holders ----------------------------------------------------------------------------------


def snapshot(device_pattern, nvml, proc_root):
    """Who holds a device file, what NVML lists, and every process: (fd_holders, unreadable, gpus, nvml_procs, procs)."""
    fd_holders, unreadable = scan_fd_holders(device_pattern, proc_root)
    gpus, nvml_procs = nvml.read() if nvml else ([], {})
    procs = {}
    for pid in list_pids(proc_root):
        proc = read_proc(pid, proc_root)
        if proc is not None:
            procs[pid] = proc
    return fd_holders, unreadable, gpus, nvml_procs, procs


def holder_entry(proc, reason, fd_holders, nvml_procs):
    """One holder as the module reports it: the process, why it is in its group, its devices and NVML memory."""
    entry = proc.describe()
    entry["reason"] = reason
    entry["devices"] = sorted(fd_holders.get(proc.pid, ()))
    entry["nvml"] = [{"gpu": index, "used_mb": used} for index, used in nvml_procs.get(proc.pid, [])]
    return entry
