#!/usr/bin/env python3
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Process backend of the sglang_service role: a detached server without systemd.

The role copies this file to the host and runs it with the server's Python (>= 3.10, stdlib only).
A JSON spec file (written by the role, like a systemd unit) describes the server:
    {"argv": [...], "environment": {...}, "working_dir": "/", "pid_file": "...", "log_file": "..."}

Commands print one JSON object on stdout ({"changed": bool, ...}; {"failed": true, "msg": ...} on
error, exit 2):
    start   --spec F                   start the server unless it already runs with this spec
    stop    --spec F --timeout S       SIGTERM the process group, SIGKILL after S seconds
    status  --spec F                   running or not, pid, whether the spec matches
    arm     --spec F --after S [--action start|resume --url U --tags JSON]
                                       start the dead-man watchdog (see below)
    disarm  --spec F                   remove the cookie: the watchdog exits without acting
    resume  --url U [--tags JSON]      POST /resume_memory_occupation (the systemd dead-man action)

Dead-man watchdog: `arm` writes a cookie file (<pid_file>.deadman) holding a random token and
spawns a detached watchdog that holds the same token. When the cookie disappears or holds another
token, the watchdog exits quietly; if the cookie is still its own after S seconds, it removes the
cookie and starts the server again (action start) or POSTs /resume_memory_occupation (action
resume). It survives the loss of the control node because nothing ties it to the play.
"""


import argparse
import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from urllib.request import Request, urlopen


class ProcessError(Exception):
    """An error the user can act on."""


def load_spec(path):
    try:
        with open(path) as handle:
            spec = json.load(handle)
    except (OSError, ValueError) as error:
        raise ProcessError(
            f"cannot read the server spec {path}: {error} (the role writes it: rerun the role)") from None
    for key in ("argv", "pid_file", "log_file"):
        if not spec.get(key):
            raise ProcessError(f"the server spec {path} has no {key!r}")
    return spec


def spec_digest(spec):
    # What makes two launches "the same server": the command, its environment and directory.
    relevant = {key: spec.get(key) for key in ("argv", "environment", "working_dir")}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode("utf-8")).hexdigest()


def read_pid(pid_file):
    try:
        with open(pid_file) as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def is_zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def record(spec):
    try:
        with open(spec["pid_file"] + ".json") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def running_pid(spec):
    """The pid of the server this spec started, or None; a reused pid does not count."""
    pid = read_pid(spec["pid_file"])
    if pid is None or is_zombie(pid):
        return None
    # The start time tells our server from a later process that got the same pid
    # (the command line cannot: servers may rename themselves with setproctitle).
    if start_time(pid) != record(spec).get("start_time"):
        return None
    return pid


def recorded_digest(spec):
    return record(spec).get("digest")


def write_atomic(path, text):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as handle:
        handle.write(text)
    os.rename(tmp, path)


def remove(path):
    try:
        os.unlink(path)
        return True
    except OSError as error:
        if error.errno != errno.ENOENT:
            raise
        return False


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
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == pgid:
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def launch(spec):
    """Start the server detached: own session and process group, output to the log file."""
    for path in (spec["log_file"], spec["pid_file"]):
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            os.makedirs(directory)
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (spec.get("environment") or {}).items()})
    log = open(spec["log_file"], "ab")
    command = " ".join(map(str, spec["argv"]))
    log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {command}\n".encode())
    log.flush()
    try:
        child = subprocess.Popen(
            [str(arg) for arg in spec["argv"]],
            stdin=open(os.devnull, "rb"),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=spec.get("working_dir") or "/",
            env=env,
            close_fds=True,
            # setsid: the server leads its own process group, so stop can signal every child it forks.
            preexec_fn=os.setsid,
        )
    except OSError as error:
        raise ProcessError(f"cannot start {spec['argv'][0]}: {error} (check sglang_service_python)") from None
    finally:
        log.close()
    write_atomic(spec["pid_file"], f"{child.pid}\n")
    identity = {"digest": spec_digest(spec), "start_time": start_time(child.pid),
                "argv": [str(arg) for arg in spec["argv"]]}
    write_atomic(spec["pid_file"] + ".json", json.dumps(identity) + "\n")
    return child.pid


def start(spec, args):
    pid = running_pid(spec)
    if pid is not None and recorded_digest(spec) == spec_digest(spec):
        return {"changed": False, "pid": pid, "msg": "already running with this spec"}
    restarted = False
    if pid is not None:
        terminate(spec, pid, args.timeout)
        restarted = True
    new_pid = launch(spec)
    return {"changed": True, "pid": new_pid, "restarted": restarted}


def terminate(spec, pid, timeout):
    """SIGTERM the process group, wait up to timeout seconds, then SIGKILL what is left."""
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
    remove(spec["pid_file"] + ".json")
    return killed


def stop(spec, args):
    pid = running_pid(spec)
    if pid is None:
        stale = remove(spec["pid_file"])
        remove(spec["pid_file"] + ".json")
        return {"changed": False, "pid": None, "msg": "not running", "stale_pid_file_removed": stale}
    killed = terminate(spec, pid, args.timeout)
    return {"changed": True, "pid": pid, "sigkill": killed}


def status(spec, args):
    pid = running_pid(spec)
    return {
        "changed": False,
        "running": pid is not None,
        "pid": pid,
        "spec_matches": pid is not None and recorded_digest(spec) == spec_digest(spec),
        "deadman_armed": os.path.exists(cookie_path(spec)),
    }


def cookie_path(spec):
    return spec["pid_file"] + ".deadman"


def arm(spec, args):
    token = uuid.uuid4().hex
    write_atomic(cookie_path(spec), token + "\n")
    command = [
        sys.executable, os.path.abspath(__file__), "watchdog", "--spec", args.spec,
        "--after", str(args.after), "--token", token, "--action", args.action,
        "--url", args.url or "", "--tags", args.tags,
    ]
    watchdog = subprocess.Popen(
        command,
        stdin=open(os.devnull, "rb"),
        stdout=open(os.devnull, "wb"),
        stderr=open(spec["log_file"], "ab"),
        close_fds=True,
        preexec_fn=os.setsid,
    )
    return {"changed": True, "watchdog_pid": watchdog.pid, "fires_in": args.after, "action": args.action,
            "cookie": cookie_path(spec)}


def disarm(spec, args):
    existed = remove(cookie_path(spec))
    return {"changed": existed, "cookie": cookie_path(spec)}


def cookie_is(spec, token):
    try:
        with open(cookie_path(spec)) as handle:
            return handle.read().strip() == token
    except OSError:
        return False


def watchdog(spec, args):
    deadline = time.time() + args.after
    while time.time() < deadline:
        if not cookie_is(spec, args.token):
            return {"changed": False, "msg": "disarmed"}
        time.sleep(min(1.0, max(0.0, deadline - time.time())))
    if not cookie_is(spec, args.token):
        return {"changed": False, "msg": "disarmed"}
    remove(cookie_path(spec))
    sys.stderr.write("--- {} dead-man watchdog fired after {}s: {}\n".format(
        time.strftime("%Y-%m-%dT%H:%M:%S"), args.after, args.action))
    sys.stderr.flush()
    if args.action == "resume":
        return resume(spec, args)
    return start(spec, args)


def resume(spec, args):
    """POST /resume_memory_occupation: the dead-man action of the memory-saver mode."""
    if not args.url:
        raise ProcessError("resume needs --url, the server's base URL")
    body = json.dumps({"tags": json.loads(args.tags)}).encode("utf-8")
    request = Request(args.url.rstrip("/") + "/resume_memory_occupation", data=body,
                      headers={"Content-Type": "application/json"})
    try:
        urlopen(request, timeout=600).read()
    except OSError as error:
        raise ProcessError(f"POST {args.url}/resume_memory_occupation failed: {error}") from None
    return {"changed": True, "msg": "resumed"}


COMMANDS = {"start": start, "stop": stop, "status": status, "arm": arm, "disarm": disarm,
            "watchdog": watchdog, "resume": resume}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("--spec", default="", help="JSON spec file written by the role (all but resume)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--after", type=float, default=3600.0, help="dead-man delay in seconds")
    parser.add_argument("--action", choices=("start", "resume"), default="start")
    parser.add_argument("--url", default="", help="server base URL for the resume action")
    parser.add_argument("--tags", default="[]", help="JSON list of memory tags for the resume action")
    parser.add_argument("--token", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec) if args.command != "resume" else {}
        result = COMMANDS[args.command](spec, args)
    except ProcessError as error:
        print(json.dumps({"failed": True, "msg": str(error)}))
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
