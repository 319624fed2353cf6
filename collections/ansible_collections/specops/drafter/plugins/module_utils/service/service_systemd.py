# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The systemd backend: a unit's state through `systemctl show`, start/stop, and what an adopted unit's ExecStart says.

Standard library only: the guard starts units with it outside Ansible.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

# The guard runs this outside Ansible, where there is no AnsibleModule.run_command or exit_json.
# pylint: disable=ansible-bad-function

import re
import shlex
import subprocess
import time

from ansible_collections.specops.drafter.plugins.module_utils.common import procfs
from ansible_collections.specops.drafter.plugins.module_utils.common.state_files import write_json
from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError

# SGLang's own defaults when the command line leaves them out (sglang 0.5.23
# srt/arg_groups/fields/serving.py:65-66: host "127.0.0.1", port 30000).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000


def unit_name(unit: str) -> str:
    return unit if "." in unit else unit + ".service"


def run(argv: list[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              check=False)
    except OSError as error:
        raise ServiceError("%s cannot be run: %s (the systemd backend needs systemd on the host)" % (argv[0], error))
    return done.returncode, done.stdout.decode("utf-8", "replace")


def exec_start_argv(exec_start: str) -> list[str]:
    """The argv of `systemctl show -p ExecStart`: `{ path=... ; argv[]=python -m ... ; ignore_errors=no ; ... }`."""
    match = re.search(r"argv\[\]=(.*?) ; ", exec_start + " ; ")
    return shlex.split(match.group(1)) if match else shlex.split(exec_start)


def command_line_facts(argv: list[str]) -> dict:
    """Port, host and memory flags of an SGLang command line; the keys' presence, never their values."""

    def value(name):
        for index, word in enumerate(argv):
            if word == name and index + 1 < len(argv):
                return argv[index + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
        return None

    port = value("--port")
    return {
        "port": int(port) if port and port.isdigit() else DEFAULT_PORT,
        "host": value("--host") or DEFAULT_HOST,
        "enable_memory_saver": "--enable-memory-saver" in argv,
        "enable_weights_cpu_backup": "--enable-weights-cpu-backup" in argv,
        "api_key_required": value("--api-key") is not None,
        "admin_api_key_required": value("--admin-api-key") is not None,
    }


class SystemdUnit(object):
    """One unit, seen through systemctl."""

    def __init__(self, unit: str) -> None:
        self.unit = unit_name(unit)

    def show(self) -> dict:
        rc, out = run(["systemctl", "show", self.unit,
                       "--property=LoadState,ActiveState,SubState,MainPID,Result,ExecStart,FragmentPath"])
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def exists(self) -> bool:
        return self.show().get("LoadState") == "loaded"

    def running_pid(self) -> int | None:
        props = self.show()
        pid = int(props.get("MainPID") or 0)
        return pid if props.get("ActiveState") in ("active", "activating", "reloading") and pid > 0 else None

    def failure(self) -> str | None:
        """Why the unit will not become ready, or None while it may."""
        props = self.show()
        state = props.get("ActiveState", "unknown")
        if state in ("failed", "inactive") or (state == "active" and int(props.get("MainPID") or 0) == 0):
            return "unit %s is %s (%s, result %s)" % (self.unit, state, props.get("SubState", "?"),
                                                      props.get("Result", "?"))
        return None

    def adopted_facts(self) -> dict:
        """What the user's unit says about its server (the unit itself is never written)."""
        props = self.show()
        if props.get("LoadState") != "loaded":
            raise ServiceError(
                "unit %s is not installed (LoadState=%s): name the unit that runs SGLang (sglang_service_unit_name), "
                "or set sglang_service_manage_unit: true to have the role write it"
                % (self.unit, props.get("LoadState", "?")))
        facts = command_line_facts(exec_start_argv(props.get("ExecStart", "")))
        facts["fragment_path"] = props.get("FragmentPath", "")
        return facts

    def systemctl(self, verb: str) -> None:
        rc, out = run(["systemctl", verb, self.unit])
        if rc != 0:
            raise ServiceError("systemctl %s %s failed: %s (see journalctl -u %s)"
                               % (verb, self.unit, out.strip(), self.unit))

    def launch(self) -> int | None:
        self.systemctl("start")
        return self.running_pid()

    def stop(self, timeout: float, tree_file: str = "") -> dict:
        """Record the unit's processes (for gpu_release), then systemctl stop (KillMode signals the cgroup)."""
        pid = self.running_pid()
        if pid is None:
            return {"changed": False, "pid": None}
        if tree_file:
            write_json(tree_file, procfs.describe_tree(procfs.process_tree(pid)))
        down_at = time.time()
        self.systemctl("stop")
        return {"changed": True, "pid": pid, "down_at": down_at}

    def log_tail(self) -> str:
        rc, out = run(["journalctl", "--unit", self.unit, "--lines", "40", "--no-pager", "--output", "cat"])
        return procfs.redact_text(out)

    def log_source(self) -> str:
        return "journalctl -u %s" % self.unit
