# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Arm and disarm the guard from the module: place its files in state_dir, start it detached, stop it.

The guard must outlive AnsiballZ's temporary directory, so its stdlib-only module_utils are copied
out of the module's payload into <state_dir>/guard_lib and run from there.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

# The guard runs this outside Ansible, where there is no AnsibleModule.run_command or exit_json.
# pylint: disable=ansible-bad-function

import importlib
import os
import pkgutil
import signal
import subprocess
import sys
import time
import uuid

from ansible_collections.specops.drafter.plugins.module_utils.common import procfs
from ansible_collections.specops.drafter.plugins.module_utils.common.state_files import (
    ensure_dir,
    read_json,
    remove,
    write_atomic,
    write_json,
)
from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError
from ansible_collections.specops.drafter.plugins.module_utils.window.guard import armed_path

PACKAGE = "ansible_collections.specops.drafter.plugins.module_utils"
# The guard and everything it imports, by their names under module_utils; none of them imports Ansible.
GUARD_FILES = ("window.guard", "common.procfs", "common.state_files", "service.service_errors",
               "service.sglang_api", "service.service_process", "service.service_systemd", "service.readiness",
               "window.memory_window", "window.window_lock", "stages.async_job", "common.file_watch")


def _source(name: str) -> bytes:
    """The source of module_utils/<name> (a dotted name under module_utils, as in GUARD_FILES)."""
    package, dummy, module = (PACKAGE + "." + name).rpartition(".")
    # Imported above (guard) or by the module: AnsiballZ carries only the module_utils that are imported.
    try:
        data = pkgutil.get_data(package, module + ".py")
    except (IOError, OSError):
        data = None
    if data is None:
        # A namespace package (a directory without __init__.py, as module_utils itself is when run from
        # the collection's files rather than AnsiballZ's zip) has no loader that reads data: read the
        # imported module's own file.
        origin = getattr(importlib.import_module(PACKAGE + "." + name), "__file__", None)
        if origin and os.path.isfile(origin):
            with open(origin, "rb") as handle:
                data = handle.read()
    if data is None:
        raise ServiceError("cannot read module_utils/%s.py from the module's payload to place the guard"
                           % name.replace(".", "/"))
    return data


def place_guard_lib(state_dir: str) -> str:
    """Write the guard's code under <state_dir>/guard_lib; its PYTHONPATH."""
    lib = os.path.join(state_dir, "guard_lib")
    # Regular packages (with __init__.py) down to each file's subpackage of module_utils: an installed
    # ansible_collections namespace cannot shadow them.
    for name in GUARD_FILES:
        parts = (PACKAGE + "." + name).split(".")
        ensure_dir(os.path.join(lib, *parts[:-1]))
        for depth in range(1, len(parts)):
            init = os.path.join(lib, *(parts[:depth] + ["__init__.py"]))
            if not os.path.exists(init):
                write_atomic(init, "")
        write_atomic(os.path.join(lib, *parts[:-1] + [parts[-1] + ".py"]), _source(name).decode("utf-8"))
    return lib


def guard_unit(server: str) -> str:
    return "%s-guard" % server.replace("/", "-")


def current_guard(state_dir: str) -> dict | None:
    """The guard armed for this server ({pid, starttime, arm_id, unit}), if it still runs."""
    guard = read_json(os.path.join(state_dir, "guard.pid.json"))
    if isinstance(guard, dict) and procfs.is_same_process(int(guard.get("pid") or 0), guard.get("starttime")):
        return guard
    return None


def arm(state_dir: str, config: dict, use_systemd: bool) -> dict:
    """Write the 0600 configuration (it may hold the api key) and start the guard; its identity."""
    disarm(state_dir)
    lib = place_guard_lib(state_dir)
    arm_id = uuid.uuid4().hex
    config = dict(config, arm_id=arm_id, state_dir=state_dir, armed_at=time.time())
    config_path = os.path.join(state_dir, "guard.json")
    write_json(config_path, config, mode=0o600)
    write_atomic(armed_path(state_dir), arm_id + "\n")
    argv = [sys.executable, "-m", PACKAGE + ".window.guard", config_path]
    # The guard's PYTHONPATH is its copied code; a server it starts gets the module's (guard.main).
    env = dict(os.environ, PYTHONPATH=lib, SPECOPS_GUARD_OUTER_PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    env.pop(procfs.WINDOW_TOKEN_VARIABLE, None)  # the guard is not the window's work it watches
    log_path = os.path.join(state_dir, "guard.log")
    unit = None
    if use_systemd:
        # A transient unit outlives the play's ssh session and its cgroup.
        unit = guard_unit(config.get("server") or "sglang")
        subprocess.run(["systemctl", "stop", unit + ".service"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
        subprocess.run(["systemctl", "reset-failed", unit + ".service"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
        done = subprocess.run(
            ["systemd-run", "--unit=" + unit, "--collect", "--description=guard of " + (config.get("server") or ""),
             "--setenv=PYTHONPATH=" + lib, "--property=StandardError=append:" + log_path] + argv,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
        if done.returncode != 0:
            remove(armed_path(state_dir))
            raise ServiceError("systemd-run could not start the guard: %s" % done.stdout.decode("utf-8", "replace"))
        shown = subprocess.run(["systemctl", "show", unit + ".service", "--property=MainPID", "--value"],
                               stdout=subprocess.PIPE, check=False)
        pid = int(shown.stdout.decode().strip() or 0)
    else:
        with open(log_path, "ab") as log:
            pid = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env,
                                   close_fds=True, start_new_session=True, cwd=state_dir).pid
    identity = {"pid": pid, "starttime": procfs.start_time(pid), "arm_id": arm_id, "unit": unit,
                "fires_in": config["fire_after"], "action": config["action"], "log": log_path}
    write_json(os.path.join(state_dir, "guard.pid.json"), identity)
    return identity


def disarm(state_dir: str) -> bool:
    """Remove the arm file (the guard exits without acting) and stop the guard; True when one was armed."""
    armed = remove(armed_path(state_dir))
    guard = current_guard(state_dir)
    # A guard that already fired (it removed the arm file) is left to finish its start or resume.
    if guard and armed:
        if guard.get("unit"):
            subprocess.run(["systemctl", "stop", guard["unit"] + ".service"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, check=False)
        else:
            try:
                os.kill(int(guard["pid"]), signal.SIGTERM)
            except OSError:
                pass
    remove(os.path.join(state_dir, "guard.json"))
    if armed or guard is None:
        # A guard that fired keeps its pid file until it is done, so that wait_for_fired_guard can wait.
        remove(os.path.join(state_dir, "guard.pid.json"))
    return armed or guard is not None


def wait_for_fired_guard(state_dir: str, timeout: float) -> bool:
    """A guard that fired is bringing the server back: wait until it is done (True) or timeout (False)."""
    deadline = time.monotonic() + timeout
    while current_guard(state_dir) is not None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True
