# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Client of the stage host: a stage forked from a long-lived interpreter with torch imported.

Every stage call otherwise pays its imports (torch, transformers, a model class: 2.5-3.5 CPU-s on a
2-core host). The first call for an environment starts `python -m specops.stage_host` detached and runs
its stage as before; later calls hand the host their stage's stdin, stdout and stderr and get back what
a child process gives: the output and the exit status. The host exits after `IDLE_S` without calls.

A call runs as before, never through the host, where its process must be what it was: a wrapped command
(a systemd scope's CPU quota), since the scope holds the process it starts.
The work of a service window goes through the host too: the guard knows its processes by the token
(SPECOPS_WINDOW_TOKEN) in /proc/<pid>/environ, which a forked stage cannot show, so it finds the stage by
the pipes of its standard streams, whose other ends its caller (which carries the token) holds
(procfs.window_processes), stops both and waits for the stage's GPU memory.
A lower priority (`nice`) is set in the forked stage itself.
Calls that go through the host carry the caller's environment (the run lock's token too) in the caller,
which lives exactly as long as its stage: the host kills a stage whose caller hangs up, the caller
forwards SIGTERM, SIGINT and SIGHUP, and a stage dies with its host.

The wire protocol is written out in the package's specops/stage_host/server.py.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import tempfile
import time


HOST_MODULE = "specops.stage_host"
# Long enough for the next stage of the same play (the window between two stages is the longest gap,
# a minute or so on a real host), short enough not to keep ~300 MB resident beside the service for long.
IDLE_S = 300
# Variables that torch, transformers, huggingface_hub, triton, fla or the interpreter read while
# importing: a host serves only calls that agree with it on all of them. The rest of a call's
# environment is set in its stage before the stage's own code runs.
IMPORT_TIME_PREFIXES = (
    "PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_",
    "NVIDIA_", "NCCL_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "SAFETENSORS_",
    "XDG_CACHE_HOME", "HOME", "SPECOPS_STAGE_HOST",
)
# Not among them: TRITON_* and FLA_*, read when triton or fla is imported, which happens in the stage
# (the host imports no model's module), so a per-run TRITON_CACHE_DIR does not need a host of its own.
# Set to 0 to start every stage anew.
ENABLE_VARIABLE = "SPECOPS_STAGE_HOST"
HEADER = struct.Struct("!I")
# A host that could not start (its reason in <socket>.failed) is tried again after this long.
FAILED_RETRY_S = 600
CONNECT_TIMEOUT_S = 5.0


def usable_for(env):
    """Whether a call with this environment may go through the host (see the module's docstring)."""
    return env.get(ENABLE_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def host_key(python, env):
    """What a host and its calls agree on: the interpreter and the variables read at import time. The
    interpreter's path as given: a virtual environment's python is a link to the base interpreter, and
    the environment is told by the link's own place."""
    pinned = sorted((name, value) for name, value in env.items() if name.startswith(IMPORT_TIME_PREFIXES))
    return json.dumps([os.path.abspath(python), pinned], separators=(",", ":"))


def socket_dir():
    """A directory of this user's alone (created 0700), or None where that cannot be had."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = os.path.join(base, "specops-stage-host-%d" % os.getuid())
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None  # someone else's, or open to others: never talk to a socket found there
    return path


# sockaddr_un holds 108 bytes with the terminating NUL.
MAX_SOCKET_PATH = 107


def socket_path(key):
    where = socket_dir()
    if where is None:
        return None
    path = os.path.join(where, hashlib.sha256(key.encode()).hexdigest()[:24] + ".sock")
    return path if len(path.encode()) <= MAX_SOCKET_PATH else None


def host_environment(env):
    """The host's own environment: what import reads and little else, no token of any run (a host
    carrying one would look like that run's work to the guard and the run lock)."""
    kept = dict((name, value) for name, value in env.items() if name.startswith(IMPORT_TIME_PREFIXES))
    for name in ("PATH", "LANG", "LC_ALL", "TMPDIR"):
        if name in env:
            kept[name] = env[name]
    return kept


def host_may_start(path):
    """No host holds the path's lock (one starting or serving), and none failed to start there."""
    try:
        if os.path.getmtime(path + ".failed") > time.time() - FAILED_RETRY_S:
            return False
    except OSError:
        pass
    try:
        with open(path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def start_host(python, path, key, env):
    """Start a host for this environment, detached; the call that found none runs without it."""
    if not host_may_start(path):
        return
    log_path = path[:-len(".sock")] + ".log"
    try:
        with open(log_path, "ab") as log:
            # Detached, outliving the module: run_command waits for what it starts.
            subprocess.Popen(  # pylint: disable=ansible-bad-function
                [python, "-m", HOST_MODULE, "--socket", path, "--key", key, "--idle", str(IDLE_S)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, cwd="/",
                env=host_environment(env), close_fds=True, start_new_session=True)
    except OSError:
        pass  # no host: every stage starts anew, as it always could


def call_environment(env):
    """The environment the stage gets, cleaned as AnsibleModule.run_command cleans it: no path of the
    module's own payload in PYTHONPATH."""
    env = dict(env)
    if "PYTHONPATH" in env:
        kept = [part for part in env["PYTHONPATH"].split(":")
                if part and not part.endswith("/ansible_modlib.zip") and not part.endswith("/debug_dir")]
        if kept:
            env["PYTHONPATH"] = ":".join(kept)
        else:
            del env["PYTHONPATH"]
    return env


def run(python, module, args, data, env, cwd=None, nice=0):
    """Run `python -m module args` through the host: (rc, stdout, stderr) as run_command returns them,
    rc negative for a signal; None where no host could take it (the caller runs it itself). `nice`
    lowers the stage's priority by that much below this process's, as `nice -n` would."""
    if not usable_for(env):
        return None
    env = call_environment(env)
    # Only a digest leaves this process: the key holds variable values (HF_TOKEN, say), and a host's
    # command line is readable by every user.
    key = hashlib.sha256(host_key(python, env).encode()).hexdigest()
    path = socket_path(key)
    if path is None:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(CONNECT_TIMEOUT_S)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        start_host(python, path, key, env)
        return None
    try:
        niceness = os.getpriority(os.PRIO_PROCESS, 0) + int(nice or 0)
        return _call(conn, key, module, args, data, env, cwd or os.getcwd(), niceness)
    finally:
        conn.close()


def _call(conn, key, module, args, data, env, cwd, niceness):
    stdin_read, stdin_write = os.pipe()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    umask = os.umask(0)
    os.umask(umask)
    body = json.dumps({"key": key, "module": module, "args": list(args), "env": env, "cwd": cwd,
                       "umask": umask, "niceness": niceness}).encode()
    message = HEADER.pack(len(body)) + body
    try:
        sent = socket.send_fds(conn, [message], [stdin_read, out_write, err_write])
        if sent < len(message):
            conn.sendall(message[sent:])
    except OSError:
        for fd in (stdin_read, stdin_write, out_read, out_write, err_read, err_write):
            os.close(fd)
        return None
    for fd in (stdin_read, out_write, err_write):
        os.close(fd)
    reader = conn.makefile("rb")
    conn.settimeout(None)
    reply = _read_line(reader)
    if not reply or "pid" not in reply:
        for fd in (stdin_write, out_read, err_read):
            os.close(fd)
        return None
    return _relay(reader, int(reply["pid"]), data, stdin_write, out_read, err_read)


def _read_line(reader):
    try:
        line = reader.readline()
    except (OSError, ValueError):
        return None
    if not line:
        return None
    try:
        value = json.loads(line.decode())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _relay(reader, pid, data, stdin_write, out_read, err_read):
    """Feed the stage its input, gather its output, forward the signals this process gets, and read
    its exit status; the stage's pid is not our child, so the host reports how it ended."""
    forwarded = {}

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except OSError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        forwarded[signum] = signal.signal(signum, forward)
    try:
        pending = data if isinstance(data, bytes) else (data or "").encode()
        outputs = {out_read: [], err_read: []}
        gathered = {}
        os.set_blocking(stdin_write, False)
        writing = stdin_write
        if not pending:
            os.close(writing)
            writing = None
        while outputs:
            try:
                readable, writable, dummy = select.select(list(outputs), [writing] if writing else [], [])
            except InterruptedError:
                continue
            if writable:
                try:
                    done = os.write(writing, pending[:65536])
                except BrokenPipeError:
                    done = len(pending)
                except BlockingIOError:
                    done = 0
                pending = pending[done:]
                if not pending:
                    os.close(writing)
                    writing = None
            for fd in readable:
                chunk = os.read(fd, 65536)
                if chunk:
                    outputs[fd].append(chunk)
                else:
                    os.close(fd)
                    gathered[fd] = b"".join(outputs.pop(fd))
        if writing is not None:
            os.close(writing)
        reply = _read_line(reader)
    finally:
        for signum, handler in forwarded.items():
            signal.signal(signum, handler)
    out = gathered.get(out_read, b"").decode("utf-8", "replace")
    err = gathered.get(err_read, b"").decode("utf-8", "replace")
    if not reply or "status" not in reply:
        # The host went away mid-stage: its stages die with it.
        return -signal.SIGKILL, out, err + "\nthe stage host ended before the stage did\n"
    return os.waitstatus_to_exitcode(int(reply["status"])), out, err
