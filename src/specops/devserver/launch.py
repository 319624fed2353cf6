"""Start a development server as a child process and wait until it is ready, as a role would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

SRC_DIR = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def http_status(url: str, timeout: float = 30.0, session: requests.Session | None = None) -> int:
    """The HTTP status of a GET, or -1 when nothing answers (as Ansible's uri reports it)."""
    try:
        return (session or requests).get(url, timeout=timeout).status_code
    except requests.RequestException:
        return -1


class DevServerProcess:
    """One `python -m specops.devserver` child; `stop()` sends SIGTERM and returns the exit code."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *args: str,
        port: int | None = None,
        host: str = "127.0.0.1",
        python: str | None = None,
        log_path: str | os.PathLike[str] | None = None,
    ):
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        env = dict(os.environ)
        # The package may not be installed in the interpreter that runs it: point at this checkout.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC_DIR), env.get("PYTHONPATH")) if p)
        cmd = [
            python or sys.executable,
            "-m",
            "specops.devserver",
            "--model-path",
            str(model_path),
            "--host",
            host,
            "--port",
            str(self.port),
            *args,
        ]
        self.log_path = Path(log_path) if log_path else None
        self._log = open(self.log_path, "wb") if self.log_path else None
        stdout = self._log if self._log else subprocess.DEVNULL
        self.process = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 120.0, poll: float = 0.25) -> list[int]:
        """Poll /health_generate until 200; returns every status seen, to show what 'starting' looked like."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout
        with requests.Session() as session:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"devserver exited with {self.process.returncode} before it was ready"
                        + (f": see {self.log_path}" if self.log_path else "")
                    )
                status = http_status(self.url + "/health_generate", session=session)
                seen.append(status)
                if status == 200:
                    return seen
                time.sleep(poll)
        raise TimeoutError(
            f"devserver at {self.url} not ready within {timeout:g} s (statuses seen: {seen[-5:]})"
        )

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log:
            self._log.close()
        return self.process.returncode

    def __enter__(self) -> DevServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
