"""A server site for the sglang_service module tests: its spec, state_dir, and the module run by Ansible."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

from specops.devserver.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE = ROOT / ".venv/bin/ansible"
ML_PYTHON = ROOT / ".venv-ml/bin/python"
FIXTURES = Path(os.environ.get("SPECOPS_FIXTURES") or ROOT / ".work/fixtures")


def ansible_env(**extra: str) -> dict:
    return dict(
        os.environ,
        ANSIBLE_LOCALHOST_WARNING="false",
        ANSIBLE_INVENTORY_UNPARSED_WARNING="false",
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        **extra,
    )


def run_module(args: dict, tmp_path: Path, check: bool = False, env: dict | None = None) -> dict:
    """Run specops.drafter.sglang_service on localhost; its result, with failed set."""
    tree = tmp_path / f"tree-{uuid.uuid4().hex[:6]}"
    cmd = [
        str(ANSIBLE),
        "localhost",
        "-m",
        "specops.drafter.sglang_service",
        "-a",
        json.dumps(args),
        "--tree",
        str(tree),
    ] + (["--check"] if check else [])
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env or ansible_env(), capture_output=True, text=True, timeout=600
    )
    result_file = tree / "localhost"
    assert result_file.exists(), proc.stdout + proc.stderr
    result = json.loads(result_file.read_text())
    result["failed"] = proc.returncode != 0
    return result


def wait_for(condition, timeout: float, step: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return bool(condition())


class Site:
    """One server: the development server with the memory saver, run by the process backend."""

    def __init__(self, root: Path, *server_flags: str, argv: list[str] | None = None) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pid_file = root / "server.pid"
        self.state_dir = root / "server.pid.d"
        self.log = root / "server.log"
        self.argv = argv or [
            str(ML_PYTHON),
            "-m",
            "specops.devserver",
            "--model-path",
            str(FIXTURES / "target"),
            "--port",
            str(self.port),
            *server_flags,
        ]
        self.tmp = root / "runs"
        self.tmp.mkdir(parents=True, exist_ok=True)

    def args(self, state: str, **extra) -> dict:
        args = {
            "state": state,
            "backend": "process",
            "unit": "test-sglang",
            "url": self.url,
            "ready_delay": 0.2,
            "ready_timeout": 120,
            "stop_timeout": 10,
            "drain_timeout": 10,
            "spec": {
                "argv": self.argv,
                "environment": {"PYTHONPATH": str(ROOT / "src")},
                "working_dir": "/",
                "pid_file": str(self.pid_file),
                "log_file": str(self.log),
            },
        }
        args.update(extra)
        return args

    def run(self, state: str, check: bool = False, env: dict | None = None, **extra) -> dict:
        return run_module(self.args(state, **extra), self.tmp, check=check, env=env)

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if Path(f"/proc/{pid}").exists() else None

    def guard_log(self) -> str:
        path = self.state_dir / "guard.log"
        return path.read_text() if path.exists() else ""

    def cleanup(self) -> None:
        guard = self.state_dir / "guard.pid.json"
        if guard.exists():
            try:
                os.kill(json.loads(guard.read_text())["pid"], 15)
            except (OSError, ValueError, KeyError):
                pass
        pid = self.pid()
        if pid:
            try:
                os.killpg(pid, 9)
            except OSError:
                pass


def window(token: str, **extra) -> dict:
    return dict({"token": token, "owner": f"test run {token}", "guard_grace": 600}, **extra)
