"""Host memory planned before the window: what the host must hold against what it has.

An extraction started ahead of its window holds the whole target in host memory, pinned (page-locked,
so its copy to the GPU runs at the link's speed) until the window opens. Inside the window the host
may have to hold more:
- memory_saver: SGLang's release copies its weights into a pinned CPU backup of its own
  (torch_memory_saver allocates it at the first release): a second copy of the target, beside ours;
- stop: the server's restart reads its weights from the files again; from the page cache if they are
  still there, from disk (tens of seconds for 54 GB) if pinned memory pushed them out.
Pinned memory cannot be reclaimed: if the two pinned copies do not fit, the server's release fails or
the kernel's OOM killer picks a process, possibly the server. So the plan decides before the service is
touched: pin (everything fits), keep the weights pageable (not held ahead: loaded inside the window
through the page cache, which the kernel can reclaim, so the copy is slower but nothing is forced out),
or refuse (even the server's own backup does not fit, or pinning was required and does not fit).

The figures come from /proc/meminfo (MemAvailable: what can be allocated without swapping, page cache
included) or a file in its format (`meminfo`, for tests and odd hosts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specops.stage import StageError

GIB = 2**30
HOST_WEIGHTS = ("auto", "pinned", "pageable")
WINDOW_MODES = ("stop", "memory_saver")
DEFAULT_MEMINFO = "/proc/meminfo"
# What stays free for everything else (the extraction's own buffers, the server's host side, the OS):
# the larger of this and RESERVE_SHARE of the host's memory.
MIN_RESERVE_BYTES = 4 * GIB
RESERVE_SHARE = 0.05


@dataclass(frozen=True)
class Meminfo:
    total: int
    available: int
    source: str


def read_meminfo(path: str | Path = DEFAULT_MEMINFO) -> Meminfo:
    """MemTotal and MemAvailable in bytes from a file in /proc/meminfo's format."""
    try:
        fields = dict(line.split(":", 1) for line in Path(path).read_text().splitlines() if ":" in line)
        total = int(fields["MemTotal"].split()[0]) * 1024
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError) as error:
        raise StageError(
            f"cannot read the host's memory from {path} ({error}): the host memory plan needs MemTotal "
            "and MemAvailable (Linux 3.14+); point meminfo at such a file"
        ) from None
    return Meminfo(total, available, str(path))


def gib(count: float) -> str:
    return f"{count / GIB:.1f} GiB"


def plan_host_memory(
    weights_bytes: int,
    window_mode: str,
    prestart: bool,
    host_weights: str,
    meminfo: Meminfo,
    server_weights_bytes: int = 0,
    reserve_bytes: int = 0,
) -> dict[str, Any]:
    """The decision and its figures (`host_memory` in the plan's result); StageError when refused.

    weights_bytes: the target's weights as the extraction holds them. server_weights_bytes: the
    served model's weights (0: the same as the target's). reserve_bytes: 0 for the default reserve.
    """
    if window_mode not in WINDOW_MODES:
        raise StageError(f"window_mode {window_mode!r} is not one of {', '.join(WINDOW_MODES)}")
    if host_weights not in HOST_WEIGHTS:
        raise StageError(f"host_weights {host_weights!r} is not one of {', '.join(HOST_WEIGHTS)}")
    served = server_weights_bytes or weights_bytes
    reserve = reserve_bytes or max(MIN_RESERVE_BYTES, int(RESERVE_SHARE * meminfo.total))
    backup = served if window_mode == "memory_saver" else 0
    # stop: the restart wants the served weights in the page cache; memory saver resumes from its backup.
    restart_cache = served if window_mode == "stop" else 0
    pinned_needs = weights_bytes + backup + restart_cache + reserve
    pageable_needs = backup + reserve  # the page cache is reclaimable: it is wanted, not needed
    figures: dict[str, Any] = {
        "meminfo": meminfo.source,
        "total_bytes": meminfo.total,
        "available_bytes": meminfo.available,
        "window_mode": window_mode,
        "prestart": prestart,
        "host_weights": host_weights,
        "extraction_weights_bytes": weights_bytes,
        "server_cpu_backup_bytes": backup,
        "restart_page_cache_bytes": restart_cache,
        "reserve_bytes": reserve,
        "pinned_needs_bytes": pinned_needs,
        "pageable_needs_bytes": pageable_needs,
    }
    parts = [f"{gib(weights_bytes)} pinned target weights"]
    if backup:
        parts.append(f"{gib(backup)} for the server's CPU backup (memory saver)")
    if restart_cache:
        parts.append(f"{gib(restart_cache)} of page cache for the server's restart")
    parts.append(f"{gib(reserve)} reserve")
    pinning = f"{' + '.join(parts)} = {gib(pinned_needs)}, {gib(meminfo.available)} available"

    # Without a backup nothing is required of the host up front: a small host still extracts (stop mode).
    if backup and pageable_needs > meminfo.available:
        raise StageError(
            f"host memory: the server's CPU backup of {gib(backup)} in memory-saver mode plus a reserve of "
            f"{gib(reserve)} needs {gib(pageable_needs)}, but {meminfo.source} shows "
            f"{gib(meminfo.available)} available: the release would fail or the OOM killer would stop a "
            "process. Use the stop window (specops_gpu_window_mode: stop) or free host memory; the service "
            "was not touched"
        )
    if not prestart:
        weights, reason = "pageable", "the extraction is not started ahead of the window: it loads inside it"
    elif host_weights == "pageable":
        weights, reason = "pageable", "host_weights is pageable"
    elif pinned_needs <= meminfo.available:
        weights, reason = "pinned", pinning
    elif host_weights == "pinned":
        raise StageError(
            f"host memory: pinning the target needs {pinning}; host_weights is pinned, so the extraction is "
            "refused before the service is touched. Set host_weights to auto (falls back to pageable "
            "weights), use the stop window, or free host memory"
        )
    else:
        weights = "pageable"
        reason = (
            f"pinning does not fit ({pinning}): the weights stay pageable, loaded inside the window through "
            "the page cache (a slower copy; nothing the server needs is forced out)"
        )
    figures.update({"weights": weights, "reason": reason, "msg": f"host memory: weights {weights}: {reason}"})
    return figures
