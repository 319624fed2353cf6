"""The forked child becomes the stage process the caller asked for: its standard streams, environment,
directory, umask and arguments, then `python -m <module>` as runpy runs it."""

from __future__ import annotations

import ctypes
import io
import os
import runpy
import signal
import sys
import tempfile
import traceback
from typing import Any, NoReturn

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def prctl(option: int, value: Any) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the host's hang-up watch still ends a child whose caller went away


def become(call: dict[str, Any], fds: list[int], host_pid: int, host_fds: set[int]) -> NoReturn:
    code = 1
    try:
        # The stage dies with the host (its caller's link to it), never outliving both.
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != host_pid:
            os._exit(137)
        os.setsid()  # signals for the host's group are not the stage's; the caller forwards its own
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) | host_fds:
            if fd > 2:
                os.close(fd)
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(call["cwd"])
        os.umask(int(call["umask"]))
        if call.get("niceness") is not None:
            os.setpriority(os.PRIO_PROCESS, 0, int(call["niceness"]))
        os.environ.clear()
        os.environ.update(call["env"])
        tempfile.tempdir = None  # TMPDIR is the call's
        if sys.path and call["cwd"]:
            sys.path[0] = call["cwd"]  # `python -m` puts the working directory first
        if call["env"].get("PYTHONUNBUFFERED") and isinstance(sys.stdout, io.TextIOWrapper):
            sys.stdout.reconfigure(write_through=True)
        module = call["module"]
        prctl(PR_SET_NAME, ctypes.c_char_p(module.encode()[:15]))
        sys.argv = [module] + list(call["args"])
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = exit_code(done.code)
    except BaseException:  # noqa: BLE001 - the caller reads the traceback as it would a fresh process's
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def exit_code(code: Any) -> int:
    """SystemExit's code as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
