#!/usr/bin/env python3
"""Run a command, label its output, and say it is still working whenever it has been quiet a while.

make test runs its suites side by side: each line a suite prints gets the suite's label, so the
interleaved output stays readable without holding a suite's output back until it ends. A step that
prints nothing for QUIET seconds (pip unpacking torch, a playbook's long task, one slow test) gets a
line saying what it is, how long it has been quiet and what it printed last.

    python .ci/heartbeat.py LABEL COMMAND [ARG...]

The exit status is the command's. The last line gives the wall time and the CPU time the command and
the processes it waited for used (daemons it left running, such as servers, are not counted): on a
machine whose cores are all busy, the CPU time is what a suite costs the others.
"""

from __future__ import annotations

import os
import resource
import selectors
import signal
import subprocess
import sys
import time

QUIET = float(os.environ.get("HEARTBEAT_QUIET_SECONDS", "25"))


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    label, command = sys.argv[1], sys.argv[2:]
    out = sys.stdout.buffer
    prefix = f"[{label}] ".encode()
    started = last_output = time.monotonic()
    last_line = b""
    pending = b""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    assert proc.stdout is not None
    # Stopped from outside (a timeout, CI's limit): the command stops too, not only its label.
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    while True:
        if not selector.select(timeout=QUIET):
            now = time.monotonic()
            hint = (pending or last_line).decode(errors="replace").strip()[-160:]
            quiet, total = now - last_output, now - started
            note = f"... still working ({quiet:.0f} s without output, {total:.0f} s in all)"
            out.write(prefix + f"{note}{'; last: ' + hint if hint else ''}\n".encode())
            out.flush()
            last_output = now
            continue
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        last_output = time.monotonic()
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            # pip's progress bars redraw with carriage returns: keep the last state of the line.
            line = line.rsplit(b"\r", 1)[-1]
            out.write(prefix + line + b"\n")
            last_line = line or last_line
        out.flush()
    if pending:
        out.write(prefix + pending.rsplit(b"\r", 1)[-1] + b"\n")
    rc = proc.wait()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, cpu = time.monotonic() - started, used.ru_utime + used.ru_stime
    out.write(prefix + f"finished in {wall:.0f} s, CPU {cpu:.0f} s (exit {rc})\n".encode())
    out.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
