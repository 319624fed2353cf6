"""The CPU bounds a stage runs within, applied where the process can apply them itself and read back
from the kernel, so that a report says what held it rather than what was asked.

The module side (plugins/module_utils/stages/cpu_scope.py) starts the stage in a systemd scope (CPUQuota,
Nice) or under `nice -n`; this side holds torch to the thread count and observes the result: the
process's nice value (getpriority(2)), its cgroup's cpu.max (cgroup v2) and torch's thread count.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")


def apply_threads(bounds: Mapping[str, Any] | None) -> None:
    """Hold torch's intra-op pool to the bounds' thread count (OMP_NUM_THREADS covers the rest)."""
    threads = int((bounds or {}).get("threads") or 0)
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def cgroup_path(proc_cgroup: str) -> str | None:
    """The cgroup v2 path of a /proc/<pid>/cgroup text ("0::/path"); None on a v1-only host."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def cpu_max(cgroup: str | None, root: Path = CGROUP_ROOT) -> str | None:
    """The cgroup's cpu.max ("max 100000" when unbounded; "25000 100000" for a quarter core); None when
    the file is not there (the root cgroup has none, and v1 hosts have another layout)."""
    if cgroup is None:
        return None
    try:
        return (root / cgroup.lstrip("/") / "cpu.max").read_text().strip()
    except OSError:
        return None


def observed() -> dict[str, Any]:
    """What bounds this process runs within, as the kernel and torch see them."""
    import torch

    try:
        cgroup = cgroup_path(Path("/proc/self/cgroup").read_text())
    except OSError:
        cgroup = None
    return {
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "cgroup": cgroup,
        "cpu_max": cpu_max(cgroup),
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
