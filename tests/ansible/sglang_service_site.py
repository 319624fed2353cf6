"""A server site for the sglang_service module tests: its spec, state_dir, and the module run on it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from module_call import call_module

from specops.devserver.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
ML_PYTHON = ROOT / ".venv-ml/bin/python"
FIXTURES = Path(os.environ.get("SPECOPS_FIXTURES") or ROOT / ".work/fixtures")
# Tests that drive module_utils in-process (ProcessServer) import them as the collection ships them.
if str(ROOT / "collections") not in sys.path:
    sys.path.insert(0, str(ROOT / "collections"))


def module_env(**extra: str) -> dict:
    """The test's environment with EXTRA, for a module run that needs more."""
    return dict(os.environ, **extra)


def run_module(args: dict, tmp_path: Path, check: bool = False, env: dict | None = None) -> dict:
    """Run specops.drafter.sglang_service as a host runs it (module_call); its result, with failed set."""
    return call_module("sglang_service", args, check=check, env=env)


def wait_for(condition, timeout: float, step: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return bool(condition())


# Keys of a server started with both (SGLang 0.5.23's --api-key and --admin-api-key).
KEYS = {"api_key": "site-api-key-51d2", "admin_api_key": "site-admin-key-8e07"}


class Site:
    """One server: the development server with the memory saver, run by the process backend."""

    def __init__(
        self,
        root: Path,
        *server_flags: str,
        argv: list[str] | None = None,
        keys: dict | None = None,
        environment: dict | None = None,
    ) -> None:
        self.root = root
        self.keys = dict(keys or {})
        self.environment = {"PYTHONPATH": str(ROOT / "src"), **(environment or {})}
        key_flags = [
            word for name, value in self.keys.items() for word in ("--" + name.replace("_", "-"), value)
        ]
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
            *key_flags,
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
            **self.keys,
            "spec": {
                "argv": self.argv,
                "environment": self.environment,
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

    def headers(self, admin: bool = False) -> dict:
        key = self.keys.get("admin_api_key" if admin else "api_key")
        return {"Authorization": f"Bearer {key}"} if key else {}

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
