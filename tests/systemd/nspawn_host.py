"""The systemd host the suite runs on: a Debian root booted with systemd-nspawn (the sglang_service
role's molecule scenario, roles/sglang_service/molecule/default).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
# The role's molecule scenario, run from the role's directory with the checkout as the project.
ROLE = ROOT / "roles" / "sglang_service"
SCENARIO = ROLE / "molecule" / "default"
# Written by the scenario's create.yml: the container, reached with community.docker.nsenter.
INVENTORY = ROOT / ".work" / "sglang_service" / "inventory.yml"
SETTINGS = yaml.safe_load((SCENARIO / "vars" / "nspawn.yml").read_text())
FIXTURES = ROOT / ".work" / "sglang_service" / "fixtures"
MACHINE = "specops-sglang"


def molecule_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}:{env.get('PATH', '')}"
    env["MOLECULE_PROJECT_DIRECTORY"] = str(ROOT)
    env["ANSIBLE_NOCOLOR"] = "1"
    env["PY_COLORS"] = "0"
    return env


def molecule(*command: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["molecule", *command, "-s", SCENARIO.name],
        cwd=ROLE,
        env=molecule_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def container_pid() -> int:
    """The container's PID 1, as create.yml wrote it into the inventory."""
    hosts = yaml.safe_load(INVENTORY.read_text())["all"]["children"]["nspawn"]["hosts"]
    return int(next(iter(hosts.values()))["ansible_nsenter_pid"])


def run_in_container(
    *argv: str, stdin: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run a command inside the container (the way community.docker.nsenter does)."""
    enter = ["nsenter", f"--target={container_pid()}", "--mount", "--pid", "--uts", "--ipc", "--net", "--"]
    return subprocess.run([*enter, *argv], input=stdin, capture_output=True, text=True, timeout=timeout)


def in_container(*argv: str, stdin: str | None = None) -> str:
    """A command's output inside the container."""
    return run_in_container(*argv, stdin=stdin).stdout.strip()


def http_status(url: str, timeout: float = 10) -> int:
    """The status of a GET; -1 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return -1


def nspawn_unusable() -> str | None:
    """Why the suite cannot run here, or None."""
    if os.geteuid() != 0:
        return "systemd-nspawn needs root"
    if shutil.which("systemd-nspawn") is None and shutil.which("apt-get") is None:
        return "systemd-nspawn is not installed and apt-get is not there to install it"
    return None
