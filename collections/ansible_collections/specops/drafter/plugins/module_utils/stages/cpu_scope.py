# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The command line that runs a stage on the host's CPU with its share and priority bounded.

Where systemd is PID 1 and we may ask it (root: the system manager; otherwise a user manager reachable
under XDG_RUNTIME_DIR), a transient scope carries CPUQuota (the kernel's cpu.max) and Nice; elsewhere
(containers, hosts without systemd) `nice -n` with the thread count bounded is the equivalent.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import os

# Nice levels the kernel accepts (setpriority(2)).
NICE_RANGE = (-20, 19)


def default_quota_percent(cores):
    """A quarter of the host's cores, in systemd's CPUQuota percent (100 = one core)."""
    return max(25, int(cores) * 25)


def default_threads(cores):
    """As many threads as the quota holds whole cores, at least one."""
    return max(1, int(cores) // 4)


def with_defaults(bounds, cores):
    """The bounds with what they leave out filled in (nice 10, a quarter of the cores); empty stays empty."""
    if not bounds:
        return {}
    filled = {"nice": 10, "cpu_quota_percent": default_quota_percent(cores), "threads": default_threads(cores)}
    filled.update((key, value) for key, value in bounds.items() if value is not None)
    return filled


def systemd_manager(pid1_comm, euid, user_bus_exists):
    """Which systemd manager may run a scope: 'system' (root), 'user', or None (fall back to nice)."""
    if pid1_comm.strip() != "systemd":
        return None
    if euid == 0:
        return "system"
    return "user" if user_bus_exists else None


def host_systemd_manager():
    """systemd_manager() for this host."""
    try:
        with open("/proc/1/comm") as handle:
            comm = handle.read()
    except (IOError, OSError):
        comm = ""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    user_bus = bool(runtime) and os.path.exists(os.path.join(runtime, "systemd", "private"))
    return systemd_manager(comm, os.geteuid(), user_bus)


def check_bounds(bounds):
    """The bounds' problems, in words (empty: they are usable)."""
    problems = []
    nice = bounds.get("nice")
    if nice is not None and not NICE_RANGE[0] <= int(nice) <= NICE_RANGE[1]:
        problems.append("nice %s is outside %d..%d" % (nice, NICE_RANGE[0], NICE_RANGE[1]))
    quota = bounds.get("cpu_quota_percent")
    if quota is not None and int(quota) <= 0:
        problems.append("cpu_quota_percent %s must be positive (100 is one core)" % quota)
    threads = bounds.get("threads")
    if threads is not None and int(threads) <= 0:
        problems.append("threads %s must be positive" % threads)
    return problems


def bounded_argv(command, bounds, manager):
    """`command` wrapped so that it runs within `bounds` ({nice, cpu_quota_percent, threads}).

    With a systemd manager: `systemd-run --scope` (the command runs in this process tree, its stdin
    and stdout passed through) with CPUQuota and Nice; without one: `nice -n`, the quota not enforced.
    """
    if not bounds:
        return list(command)
    nice = int(bounds.get("nice") or 0)
    quota = bounds.get("cpu_quota_percent")
    if manager:
        argv = ["systemd-run"] + (["--user"] if manager == "user" else []) + ["--scope", "--quiet"]
        if quota:
            argv += ["-p", "CPUQuota=%d%%" % int(quota)]
        if nice:
            argv += ["--nice=%d" % nice]
        return argv + list(command)
    return (["nice", "-n", str(nice)] if nice else []) + list(command)


def thread_environment(bounds):
    """The environment that holds the math libraries to the bounds' thread count (empty: unbounded)."""
    threads = (bounds or {}).get("threads")
    if not threads:
        return {}
    value = str(int(threads))
    return {"OMP_NUM_THREADS": value, "MKL_NUM_THREADS": value, "OPENBLAS_NUM_THREADS": value}
