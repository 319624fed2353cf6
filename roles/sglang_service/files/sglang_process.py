#!/usr/bin/env python3
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Host side of the sglang_service role: process backend, readiness, memory saver, window guard.

The role copies this file and procfs.py beside it to the host and runs it with the Python Ansible uses
there (>= 3.8, stdlib only: requests may not be installed on the host).
A JSON spec file (written by the role, like a systemd unit) describes the server:
    {"argv": [...], "environment": {...}, "working_dir": "/", "pid_file": "...", "log_file": "..."}

Commands print one JSON object on stdout ({"changed": bool, ...}; {"failed": true, "msg": ...} on
error, exit 2):
    start    --spec F                  start the server unless it already runs with this spec
    stop     --spec F --timeout S      record the server's process tree, SIGTERM the process group,
                                       SIGKILL after S seconds
    status   --spec F                  running or not, pid, whether the spec matches
    validate --spec F                  the launch would work: python runs, has the launcher
                                       module, the model path is a model directory
    record   --unit U --tree T         record a systemd unit's processes (pid + start time)
    ready    --url U (--spec F | --unit U) --timeout S
                                       wait for /health_generate 200 from OUR server: fail at once
                                       when our process exits or another process owns the port
    release  --url U --marker M        pause generation, flush, release GPU memory (memory saver)
    resume   --url U --marker M        resume GPU memory and continue generation, exactly once
    arm      --spec F --after S ...    start the window guard (see below)
    disarm   --spec F                  remove the guard's cookie: the guard exits without acting
    fire     ...                       what the guard does when it fires (systemd timer action)

Exactly one resume per release: `release` writes the marker file before it releases; `resume`
takes the marker under an exclusive lock (rename) before it POSTs, so the play and the guard can
both call it and only the first one resumes. SGLang's scheduler dies on a second resume
(managers/scheduler_update_weights_mixin.py at sgl-project/sglang 018c9109: offload_tags.remove).

Window guard: `arm` writes a cookie (<pid_file>.deadman) holding a random token and starts a
detached guard with the same token. The guard exits quietly once the cookie is gone or holds
another token. It fires when the cookie is still its own after --after seconds, or earlier when
--work-token is given and the play has not driven the window's work for --grace seconds: no process
carrying SPECOPS_WINDOW_TOKEN=<token> in its environment hung below a live process outside that work
(an Ansible worker, an ssh session); detached work (an async job, a task orphaned by Ctrl-C) does not
count. The play was interrupted (Ctrl-C, lost control node) without disarming. Firing stops the
window's remaining work first (SIGTERM, then SIGKILL), then starts the server (action start), runs
`systemctl start <unit>` (action unit) or resumes it (action resume).
"""

import argparse
import errno
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

# Copied beside this file by the role (the collection's module_utils/procfs.py, also used by gpu_release).
from procfs import read_stat

WORK_TOKEN_VARIABLE = "SPECOPS_WINDOW_TOKEN"
LOG_LINES = 40


class ProcessError(Exception):
    """An error the user can act on; fields go into the failure's JSON beside msg."""

    def __init__(self, msg, **fields):
        super().__init__(msg)
        self.fields = fields


# --- files -----------------------------------------------------------------------------------


def load_spec(path):
    try:
        with open(path) as handle:
            spec = json.load(handle)
    except (OSError, ValueError) as error:
        raise ProcessError(
            f"cannot read the server spec {path}: {error} (the role writes it: rerun the role)"
        ) from None
    for key in ("argv", "pid_file", "log_file"):
        if not spec.get(key):
            raise ProcessError(f"the server spec {path} has no {key!r}")
    return spec


def spec_digest(spec):
    # What makes two launches "the same server": the command, its environment and directory.
    relevant = {key: spec.get(key) for key in ("argv", "environment", "working_dir")}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode("utf-8")).hexdigest()


def write_atomic(path, text):
    """Readers see the old file or the whole new one, also after a crash (fsync before the rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def remove(path):
    try:
        os.unlink(path)
        return True
    except OSError as error:
        if error.errno != errno.ENOENT:
            raise
        return False


def read_json(path, default):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return default


def tail(path, lines=LOG_LINES):
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            return "\n".join(handle.read().decode("utf-8", "replace").splitlines()[-lines:])
    except OSError as error:
        return f"(cannot read {path}: {error.strerror})"


# --- /proc -----------------------------------------------------------------------------------


def start_time(pid):
    # A string, as the identity files of running servers already hold it.
    stat = read_stat(pid)
    return str(stat.starttime) if stat else None


def is_zombie(pid):
    stat = read_stat(pid)
    return stat is None or stat.state in ("Z", "X")


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return " ".join(p for p in handle.read().decode("utf-8", "replace").split("\0") if p).strip()
    except OSError:
        return ""


def all_pids():
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def parents():
    """{pid: ppid} of every visible process."""
    table = {}
    for pid in all_pids():
        stat = read_stat(pid)
        if stat:
            table[pid] = stat.ppid
    return table


def tree(root):
    """root and every live descendant of it."""
    children = {}
    for pid, ppid in parents().items():
        children.setdefault(ppid, []).append(pid)
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        found.append(pid)
        stack.extend(children.get(pid, []))
    return [pid for pid in found if not is_zombie(pid)]


def describe_tree(pids):
    """pid + start time pins each process: a recycled pid never counts as ours."""
    entries = []
    for pid in pids:
        started = start_time(pid)
        if started is not None:
            entries.append({"pid": pid, "starttime": int(started), "cmdline": cmdline(pid)})
    return entries


def listeners(port):
    """Socket inodes listening on a TCP port (IPv4 and IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local_address is HEX_IP:HEX_PORT; state 0A is LISTEN.
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def socket_owners(inodes):
    """Pids with one of the socket inodes open; only the processes we may inspect."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    owners = set()
    for pid in all_pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    owners.add(pid)
                    break
            except OSError:
                continue
    return owners


def carries_token(pid, token):
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return f"{WORK_TOKEN_VARIABLE}={token}".encode() in handle.read().split(b"\0")
    except OSError:
        return False


def work_processes(token):
    me = os.getpid()
    return [pid for pid in all_pids() if pid != me and not is_zombie(pid) and carries_token(pid, token)]


def comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def attended(token):
    """Whether the play still drives the window: a process of the window's work hangs below a live
    process that is not part of it (an Ansible worker, an ssh session). Work that was detached (an
    async job, or a task orphaned by Ctrl-C) hangs below PID 1 or a systemd subreaper instead."""
    table = parents()
    carriers = set(work_processes(token))
    for pid in carriers:
        top = pid
        while table.get(top) in carriers:
            top = table[top]
        parent = table.get(top, 1)
        if parent > 1 and comm(parent) not in ("systemd", "init"):
            return True
    return False


# --- the server process ------------------------------------------------------------------------


def identity_file(spec):
    return spec["pid_file"] + ".json"


def read_pid(pid_file):
    try:
        with open(pid_file) as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def running_pid(spec):
    """The pid of the server this spec started, or None; a reused pid does not count."""
    pid = read_pid(spec["pid_file"])
    if pid is None or is_zombie(pid):
        return None
    # The start time tells our server from a later process that got the same pid
    # (the command line cannot: servers may rename themselves with setproctitle).
    if start_time(pid) != read_json(identity_file(spec), {}).get("start_time"):
        return None
    return pid


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except OSError as error:
        if error.errno == errno.ESRCH:
            return False
        raise
    # A group whose only member is an unreaped zombie leader is gone for our purposes.
    return not (is_zombie(pgid) and not other_members(pgid))


def other_members(pgid):
    members = []
    for pid in all_pids():
        stat = read_stat(pid)
        if pid != pgid and stat and stat.pgid == pgid and stat.state != "Z":
            members.append(pid)
    return members


def launch(spec):
    """Start the server detached: own session and process group, output to the log file."""
    for path in (spec["log_file"], spec["pid_file"]):
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            os.makedirs(directory)
    env = dict(os.environ)
    env.pop(WORK_TOKEN_VARIABLE, None)  # the server is not the window's work
    env.update({str(k): str(v) for k, v in (spec.get("environment") or {}).items()})
    argv = [str(arg) for arg in spec["argv"]]
    with open(spec["log_file"], "ab") as log, open(os.devnull, "rb") as devnull:
        log.write("--- {} starting: {}\n".format(time.strftime("%Y-%m-%dT%H:%M:%S"), " ".join(argv)).encode())
        log.flush()
        try:
            # start_new_session: the server leads its own session and process group, so stop can
            # signal every child it forks and the play's end does not reach it.
            child = subprocess.Popen(
                argv,
                stdin=devnull,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=spec.get("working_dir") or "/",
                env=env,
                close_fds=True,
                start_new_session=True,
            )
        except OSError as error:
            raise ProcessError(f"cannot start {argv[0]}: {error} (check sglang_service_python)") from None
    write_atomic(spec["pid_file"], f"{child.pid}\n")
    identity = {"digest": spec_digest(spec), "start_time": start_time(child.pid), "argv": argv}
    write_atomic(identity_file(spec), json.dumps(identity) + "\n")
    return child.pid


def start(spec, args):
    pid = running_pid(spec)
    if pid is not None and read_json(identity_file(spec), {}).get("digest") == spec_digest(spec):
        return then_ready(spec, args, {"changed": False, "pid": pid, "msg": "already running with this spec"})
    restarted = False
    if pid is None:
        # Nothing serves (the window's start): check here rather than in a task of its own.
        problems = launch_problems(spec)[0]
        if problems:
            raise ProcessError("the server cannot start: " + "; ".join(problems))
    else:
        terminate(spec, pid, args.timeout)
        restarted = True
    return then_ready(spec, args, {"changed": True, "pid": launch(spec), "restarted": restarted})


def terminate(spec, pid, timeout):
    """SIGTERM the process group, wait up to timeout seconds, then SIGKILL what is left."""
    if args_tree_file(spec):
        write_atomic(args_tree_file(spec), json.dumps(describe_tree(tree(pid))) + "\n")
    try:
        os.killpg(pid, signal.SIGTERM)
    except OSError as error:
        if error.errno != errno.ESRCH:
            raise
    deadline = time.time() + timeout
    while time.time() < deadline and group_alive(pid):
        time.sleep(0.1)
    killed = False
    if group_alive(pid):
        killed = True
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError as error:
            if error.errno != errno.ESRCH:
                raise
        deadline = time.time() + 10
        while time.time() < deadline and group_alive(pid):
            time.sleep(0.1)
        if group_alive(pid):
            raise ProcessError(
                f"process group {pid} survived SIGKILL for 10 s (stuck in the kernel? check `ps -g {pid}`)"
            )
    remove(spec["pid_file"])
    remove(identity_file(spec))
    return killed


def args_tree_file(spec):
    return spec.get("tree_file") or ""


def stop(spec, args):
    pid = running_pid(spec)
    if pid is None:
        stale = remove(spec["pid_file"])
        remove(identity_file(spec))
        return {"changed": False, "pid": None, "msg": "not running", "stale_pid_file_removed": stale}
    # The moment the service goes down, on this host's clock (the window's downtime starts here).
    down_at = time.time()
    killed = terminate(spec, pid, args.timeout)
    return {
        "changed": True,
        "pid": pid,
        "sigkill": killed,
        "tree_file": args_tree_file(spec),
        "down_at": down_at,
    }


def status(spec, args):
    pid = running_pid(spec)
    return {
        "changed": False,
        "running": pid is not None,
        "pid": pid,
        "spec_matches": pid is not None
        and read_json(identity_file(spec), {}).get("digest") == spec_digest(spec),
        "deadman_armed": os.path.exists(cookie_path(spec)),
    }


def option_after(argv, name):
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def validate(spec, args):
    """Refuse a launch that cannot work, before anything is stopped: the settings name the fix."""
    problems, python, module = launch_problems(spec)
    if problems:
        raise ProcessError("the server would not start, so it is left as it is: " + "; ".join(problems))
    return {
        "changed": False,
        "msg": "launch settings look valid",
        "python": python,
        "module": module,
        "model_path": option_after([str(arg) for arg in spec["argv"]], "--model-path"),
    }


def launch_problems(spec):
    """What would keep the server from starting (each naming its setting), the Python and the module."""
    argv = [str(arg) for arg in spec["argv"]]
    python = argv[0]
    problems = []
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        problems.append(f"sglang_service_python {python} is not an executable file")
    module = option_after(argv, "-m")
    if module and not problems:
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in (spec.get("environment") or {}).items()})
        finder = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"
        probe = subprocess.run(
            [python, "-c", finder, module],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=spec.get("working_dir") or "/",
            check=False,
        )
        if probe.returncode != 0:
            problems.append(
                f"{python} cannot import the launcher module {module} (sglang_service_launcher_module): "
                "install it "
                "there or point sglang_service_python at the Python that has it"
            )
    model = option_after(argv, "--model-path")
    if model is not None and not os.path.isfile(os.path.join(model, "config.json")):
        problems.append(
            "sglang_service_model_path {} is not a model directory (no config.json){}".format(
                model, "" if os.path.isdir(model) else ": it does not exist"
            )
        )
    return problems, python, module


# --- systemd ---------------------------------------------------------------------------------


def unit_show(unit):
    name = unit if "." in unit else unit + ".service"
    try:
        out = subprocess.run(
            ["systemctl", "show", name, "--property=ActiveState,SubState,MainPID,Result"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            check=False,
        ).stdout
    except OSError as error:
        raise ProcessError(f"systemctl cannot be run: {error}") from None
    props = dict(line.split("=", 1) for line in out.decode("utf-8", "replace").splitlines() if "=" in line)
    return props


def record(spec, args):
    """Record the unit's processes before it is stopped, for gpu_release's leftovers check."""
    main = int(unit_show(args.unit).get("MainPID") or 0)
    entries = describe_tree(tree(main)) if main > 0 else []
    write_atomic(args.tree, json.dumps(entries) + "\n")
    # The unit is stopped right after this: its downtime starts here at the latest (host clock).
    return {"changed": False, "tree_file": args.tree, "processes": len(entries), "down_at": time.time()}


def journal(unit):
    try:
        return subprocess.run(
            ["journalctl", "--unit", unit, "--lines", str(LOG_LINES), "--no-pager", "--output", "cat"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            check=False,
        ).stdout.decode("utf-8", "replace")
    except OSError as error:
        return f"(journalctl cannot be run: {error})"


# --- HTTP ------------------------------------------------------------------------------------


def http(url, body=None, timeout=30.0):
    """(status, text); status -1 when nothing answers."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    request = Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="GET" if data is None else "POST"
    )
    try:
        with urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except HTTPError as error:
        return error.code, error.read().decode("utf-8", "replace")
    except (URLError, OSError) as error:
        return -1, str(getattr(error, "reason", error))


def port_of(url):
    return int(url.rsplit(":", 1)[1].split("/")[0])


# --- readiness -------------------------------------------------------------------------------


def our_server(args):
    """(root pid or None, why it will not become ready or None, where its log is, log tail reader)."""
    if args.unit:
        props = unit_show(args.unit)
        state, main = props.get("ActiveState", "unknown"), int(props.get("MainPID") or 0)
        source = f"journalctl -u {args.unit}"
        if state in ("failed", "inactive") or (state == "active" and main == 0):
            gone = "unit {} is {} ({}, result {})".format(
                args.unit, state, props.get("SubState", "?"), props.get("Result", "?")
            )
            return None, gone, source, lambda: journal(args.unit)
        return (main or None), None, source, lambda: journal(args.unit)
    spec = load_spec(args.spec)
    pid = running_pid(spec)
    gone = None if pid else "our server process (pid file {}) has exited".format(spec["pid_file"])
    return pid, gone, spec["log_file"], lambda: tail(spec["log_file"])


def foreign_listener(port, pid):
    """A process that is not ours listening on the port, or None (unknown owners are not foreign)."""
    owners = socket_owners(listeners(port))
    strangers = sorted(owners - (set(tree(pid)) if pid else set()))
    return strangers[0] if strangers and owners == set(strangers) else None


def then_ready(spec, args, result):
    """With --then-ready, wait for readiness in the same call: one task less inside the window.

    A server that does not become ready is reported (ready false, ready_msg), not raised: the start
    or resume itself succeeded, and the role's readiness step names the failure as it always does.
    """
    if not args.then_ready:
        return result
    try:
        answer = ready(spec, argparse.Namespace(**dict(vars(args), timeout=args.ready_timeout)))
    except ProcessError as error:
        return dict(result, ready=False, ready_msg=str(error), **error.fields)
    return dict(result, ready=True, ready_at=answer["ready_at"], ready_seconds=answer["seconds"])


def ready(spec, args):
    """Poll /health_generate until 200 from OUR server; fail at once when it cannot come."""
    started = time.monotonic()
    deadline = started + args.timeout
    port = port_of(args.url)
    answered = 0
    while True:
        pid, gone, source, log = our_server(args)
        # Checked first: a server that exited because the port was taken is named by the holder.
        stranger = foreign_listener(port, pid)
        if stranger:
            raise ProcessError(
                f"port {port} is held by pid {stranger} ({cmdline(stranger) or '?'}), not by our server "
                f"({f'pid {pid}' if pid else 'it is not running'}): an answer there is not ours. Stop that "
                f"process or move the server (sglang_service_port). Last lines of the server's log "
                f"({source}):\n{log()}",
                port=port,
                port_holder=stranger,
            )
        if gone:
            raise ProcessError(
                f"{gone}: it will not become ready (waited {time.monotonic() - started:.0f} s). "
                f"Last {LOG_LINES} lines of the server's log ({source}):\n{log()}"
            )
        status_code, _ = http(args.url.rstrip("/") + "/health_generate", timeout=args.health_timeout)
        answered += status_code != -1
        if status_code == 200 and pid:
            return {
                "changed": False,
                "ready": True,
                "seconds": round(time.monotonic() - started, 2),
                "pid": pid,
                "ready_at": time.time(),  # the window's downtime ends here, on this host's clock
            }
        if time.monotonic() >= deadline or (args.health_tries and answered >= args.health_tries):
            refused = " (connection refused or timed out)" if status_code == -1 else ""
            raise ProcessError(
                f"not ready at {args.url} after {time.monotonic() - started:.0f} s and {answered} answers "
                f"(sglang_service_ready_timeout, sglang_service_ready_retries): /health_generate last "
                f"answered {status_code}{refused}. Last {LOG_LINES} lines of the server's log "
                f"({source}):\n{log()}"
            )
        time.sleep(args.delay)


# --- memory saver ------------------------------------------------------------------------------


def release(spec, args):
    """Pause, drain, release; the marker says "released, not yet resumed"."""
    base = args.url.rstrip("/")
    code, text = http(base + "/get_server_info", timeout=args.health_timeout)
    if code != 200:
        raise ProcessError(
            f"GET {base}/get_server_info answered {code}: the server is not serving, so it is not "
            f"released: {text[:200]}"
        )
    info = json.loads(text)
    if not info.get("enable_memory_saver"):
        raise ProcessError(
            f"the server at {base} runs without --enable-memory-saver: a release would answer 200 and "
            "free nothing. Launch it with --enable-memory-saver --enable-weights-cpu-backup "
            "(sglang_service_memory_saver: true) "
            "or use the stop window (specops_gpu_window_mode: stop)"
        )
    if os.path.exists(args.marker):
        return {"changed": False, "msg": f"already released (marker {args.marker})"}
    # SGLang asserts an idle scheduler on release and dies otherwise: hold new work, then drain.
    # The service stops answering here: the window's downtime starts on this host's clock.
    down_at = time.time()
    code, text = http(base + "/pause_generation", body={}, timeout=args.health_timeout)
    if code != 200:
        raise ProcessError(f"POST {base}/pause_generation answered {code}: {text[:200]}")
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            code, text = http(base + "/flush_cache", body={}, timeout=args.health_timeout)
            if code == 200:
                break
            if time.monotonic() >= deadline:
                raise ProcessError(
                    f"POST {base}/flush_cache still answers {code} after {args.timeout:.0f} s: requests are "
                    "still running "
                    "(sglang_service_flush_timeout); nothing was released"
                )
            time.sleep(args.delay)
        write_atomic(args.marker, json.dumps({"tags": json.loads(args.tags), "at": time.time()}) + "\n")
        code, text = http(
            base + "/release_memory_occupation", body={"tags": json.loads(args.tags)}, timeout=300
        )
        if code != 200:
            remove(args.marker)
            raise ProcessError(f"POST {base}/release_memory_occupation answered {code}: {text[:300]}")
    except ProcessError:
        http(base + "/continue_generation", body={}, timeout=args.health_timeout)
        raise
    return {"changed": True, "msg": "paused, flushed and released", "marker": args.marker, "down_at": down_at}


def resume(spec, args):
    """Resume exactly once per release: the first caller to take the marker does it."""
    base = args.url.rstrip("/")
    with open(args.marker + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        released = os.path.exists(args.marker)
        if released:
            claimed = args.marker + ".claimed"
            os.rename(args.marker, claimed)
            tags = read_json(claimed, {}).get("tags", json.loads(args.tags))
            code, text = http(base + "/resume_memory_occupation", body={"tags": tags}, timeout=600)
            remove(claimed)
    # Readiness is waited for outside the lock: the guard's resume must not wait on it.
    if not released:
        return then_ready(
            spec,
            args,
            {"changed": False, "msg": f"not released (no marker {args.marker}): nothing to resume"},
        )
    if code != 200:
        raise ProcessError(
            f"POST {base}/resume_memory_occupation answered {code}: {text[:300]} (not retried: a "
            "second resume would "
            "crash SGLang's scheduler; restart the server if it does not answer)"
        )
    http(base + "/continue_generation", body={}, timeout=args.health_timeout)
    return then_ready(spec, args, {"changed": True, "msg": "resumed"})


# --- the window guard ------------------------------------------------------------------------


def cookie_path(spec):
    return spec["pid_file"] + ".deadman"


def guard_argv(args, token):
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "guard",
        "--spec",
        args.spec,
        "--after",
        str(args.after),
        "--token",
        token,
        "--action",
        args.action,
        "--url",
        args.url or "",
        "--tags",
        args.tags,
        "--grace",
        str(args.grace),
    ]
    for name in ("marker", "unit", "work_token"):
        if getattr(args, name):
            argv += ["--" + name.replace("_", "-"), getattr(args, name)]
    return argv


def arm(spec, args):
    token = uuid.uuid4().hex
    write_atomic(cookie_path(spec), token + "\n")
    argv = guard_argv(args, token)
    if args.systemd_run:
        # A transient unit: the guard outlives the play's ssh session and its cgroup.
        name = "{}-guard".format(args.unit or "sglang")
        subprocess.run(
            ["systemctl", "stop", name + ".service"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
        done = subprocess.run(
            [
                "systemd-run",
                "--unit=" + name,
                "--collect",
                "--description=window guard for " + (args.unit or "sglang"),
            ]
            + argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            check=False,
        )
        if done.returncode != 0:
            remove(cookie_path(spec))
            raise ProcessError(
                "systemd-run could not start the window guard: {}".format(
                    done.stdout.decode("utf-8", "replace").strip()
                )
            )
        return {
            "changed": True,
            "guard": name + ".service",
            "fires_in": args.after,
            "action": args.action,
            "cookie": cookie_path(spec),
        }
    env = dict(os.environ)
    env.pop(WORK_TOKEN_VARIABLE, None)  # the guard is not the window's work it watches
    # One file per statement: a parenthesised group of context managers needs Python 3.10.
    with open(spec["log_file"], "ab") as log:
        guard_process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=env,
            close_fds=True,
            start_new_session=True,
        )
    return {
        "changed": True,
        "guard_pid": guard_process.pid,
        "fires_in": args.after,
        "action": args.action,
        "cookie": cookie_path(spec),
    }


def disarm(spec, args):
    existed = remove(cookie_path(spec))
    return {"changed": existed, "cookie": cookie_path(spec)}


def cookie_is(spec, token):
    try:
        with open(cookie_path(spec)) as handle:
            return handle.read().strip() == token
    except OSError:
        return False


def guard(spec, args):
    started = time.monotonic()
    deadline = started + args.after
    last_work = started
    reason = f"max downtime of {args.after:.0f} s reached"
    while time.monotonic() < deadline:
        if not cookie_is(spec, args.token):
            return {"changed": False, "msg": "disarmed"}
        if args.work_token:
            if attended(args.work_token):
                last_work = time.monotonic()
            elif time.monotonic() - last_work >= args.grace:
                reason = f"the window's work is gone and the play did not disarm within {args.grace:.0f} s"
                break
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    if not cookie_is(spec, args.token):
        return {"changed": False, "msg": "disarmed"}
    remove(cookie_path(spec))
    return fire(spec, args, reason)


def stop_work(token, grace=10.0):
    """SIGTERM the window's remaining work, SIGKILL what outlives grace; the pids signalled."""
    pids = [(pid, start_time(pid)) for pid in work_processes(token)]
    for pid, _ in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            continue
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(start_time(p) == s and not is_zombie(p) for p, s in pids):
        time.sleep(0.1)
    for pid, started in pids:
        if start_time(pid) == started and not is_zombie(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
    return [pid for pid, _ in pids]


def fire(spec, args, reason="fired"):
    stopped = stop_work(args.work_token) if args.work_token else []
    sys.stderr.write(
        "--- {} window guard fired ({}): stopped the window's work {}, then {}\n".format(
            time.strftime("%Y-%m-%dT%H:%M:%S"), reason, stopped, args.action
        )
    )
    sys.stderr.flush()
    if args.action == "resume":
        result = resume(spec, args)
    elif args.action == "unit":
        subprocess.run(
            ["systemctl", "start", (args.unit if "." in args.unit else args.unit + ".service")], check=False
        )
        result = {"changed": True}
    else:
        result = start(spec, args)
    result.update({"reason": reason, "stopped_work": stopped})
    return result


COMMANDS = {
    "start": start,
    "stop": stop,
    "status": status,
    "validate": validate,
    "record": record,
    "ready": ready,
    "release": release,
    "resume": resume,
    "arm": arm,
    "disarm": disarm,
    "guard": guard,
    "fire": fire,
}
# Commands that need no spec file.
SPECLESS = ("record", "release", "resume", "ready")


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("--spec", default="", help="JSON spec file written by the role")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds: SIGTERM to SIGKILL, readiness, drain"
    )
    parser.add_argument("--delay", type=float, default=1.0, help="seconds between readiness or flush polls")
    parser.add_argument("--health-timeout", type=float, default=30.0, help="seconds one HTTP call may take")
    parser.add_argument(
        "--health-tries", type=int, default=0, help="ready: give up after this many answers that are not 200"
    )
    parser.add_argument(
        "--then-ready",
        action="store_true",
        help="start, resume: then wait for readiness in the same call (--url, --ready-timeout)",
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds --then-ready waits")
    parser.add_argument("--after", type=float, default=3600.0, help="guard: fire after this many seconds")
    parser.add_argument(
        "--grace",
        type=float,
        default=60.0,
        help="guard: fire when the window's work has been gone this many seconds",
    )
    parser.add_argument("--work-token", default="", help="guard: the window's SPECOPS_WINDOW_TOKEN value")
    parser.add_argument("--action", choices=("start", "resume", "unit"), default="start")
    parser.add_argument("--unit", default="", help="systemd unit of the server")
    parser.add_argument("--systemd-run", action="store_true", help="arm: run the guard as a transient unit")
    parser.add_argument("--tree", default="", help="record: where to write the unit's process tree")
    parser.add_argument("--url", default="", help="server base URL")
    parser.add_argument("--tags", default="[]", help="JSON list of memory tags")
    parser.add_argument("--marker", default="", help="memory saver: the released marker file")
    parser.add_argument("--token", default="", help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("release", "resume") and not (args.url and args.marker):
            raise ProcessError(f"{args.command} needs --url and --marker")
        spec = (
            {}
            if args.command in SPECLESS or (args.command == "fire" and not args.spec)
            else load_spec(args.spec)
        )
        result = COMMANDS[args.command](spec, args)
    except ProcessError as error:
        print(json.dumps(dict(error.fields, failed=True, changed=False, msg=str(error))))
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
