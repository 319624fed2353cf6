"""The local fleet (inventory/fleet): development servers behind a real sglang-router, a load generator
sending through the router, and eval.yml rolling over them. Used by test_fleet.py (two of the inventory's
replicas, every play limited to them) and benchmarks/fleet_local.py (all three). Loopback only; every
process is started here and stopped here."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RECAP = re.compile(
    r"^(?P<host>\S+)\s*:\s*ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+"
    r"unreachable=(?P<unreachable>\d+)\s+failed=(?P<failed>\d+)",
    re.M,
)
HOSTS = ("replica1", "replica2", "replica3")


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def get_json(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


@dataclass
class Play:
    rc: int
    output: str
    seconds: float
    recap: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class LocalFleet:
    work_dir: Path
    models_dir: Path
    ports: list[int] = field(default_factory=lambda: free_ports(5))
    router: subprocess.Popen | None = None
    load: subprocess.Popen | None = None
    # Servers a test killed, by host: the pid each had.
    crashed: dict[str, int] = field(default_factory=dict)
    # The inventory's replicas this fleet runs: every play is limited to them (--limit), and only their
    # servers are behind the router.
    hosts: tuple[str, ...] = HOSTS
    # Replicas serving behind the router (or that did) outside the plays' --limit: a scoring replica.
    outside: tuple[str, ...] = ()

    @property
    def replica_ports(self) -> list[int]:
        # Indexed by the inventory's specops_replica, whichever hosts this fleet runs.
        return self.ports[:3]

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.ports[3]}"

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.replica_ports[HOSTS.index(host)]}" for host in self.hosts]

    def extra_vars(self, **overrides: Any) -> dict[str, Any]:
        return {
            "specops_fleet_work_dir": str(self.work_dir),
            "specops_models_dir": str(self.models_dir),
            "specops_fleet_ports": self.replica_ports,
            "sglang_router_url": self.router_url,
            "sglang_service_guard": False,
            # Each rollout takes its windows: no extraction is taken over from an earlier one.
            "specops_reuse_extractions": False,
            **overrides,
        }

    def command(
        self,
        playbook: str,
        args: tuple[str, ...] = (),
        hosts: tuple[str, ...] | None = None,
        **overrides: Any,
    ) -> list[str]:
        """ansible-playbook on the fleet's inventory, with the fleet's settings and these overrides, on the
        fleet's hosts (or these)."""
        hosts = hosts or self.hosts
        return [
            str(BIN / "ansible-playbook"),
            "-i",
            str(REPO / "inventory" / "fleet"),
            str(REPO / "playbooks" / playbook),
            "-e",
            json.dumps(self.extra_vars(**overrides)),
            *(() if hosts == HOSTS else ("--limit", ",".join(hosts))),
            *args,
        ]

    @staticmethod
    def environment() -> dict[str, str]:
        return {
            **os.environ,
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            # What a play publishes for AWX (set_stats) is printed at its end.
            "ANSIBLE_SHOW_CUSTOM_STATS": "1",
        }

    def play(
        self,
        playbook: str,
        timeout: int = 3600,
        args: tuple[str, ...] = (),
        hosts: tuple[str, ...] | None = None,
        **overrides: Any,
    ) -> Play:
        began = time.monotonic()
        proc = subprocess.run(
            self.command(playbook, args, hosts, **overrides),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.environment(),
        )
        output = proc.stdout + proc.stderr
        recap = {
            m["host"]: {k: int(m[k]) for k in ("ok", "changed", "unreachable", "failed")}
            for m in RECAP.finditer(output)
        }
        return Play(proc.returncode, output, time.monotonic() - began, recap)

    # -- the site ---------------------------------------------------------------------------
    def build_models(self, ml_python: Path) -> None:
        if not (self.models_dir / "fixtures.json").is_file():
            subprocess.run(
                [
                    str(ml_python),
                    "-m",
                    "specops.fixtures",
                    "--out",
                    str(self.models_dir),
                    "--prompts",
                    str(REPO / "prompts" / "coding.jsonl"),
                ],
                check=True,
                cwd=REPO,
            )

    def start(self) -> None:
        started = self.play("service.yml", sglang_service_state="started", timeout=600)
        if started.rc != 0:
            raise RuntimeError(f"the replicas did not start:\n{started.output[-4000:]}")
        self.start_router()

    def start_router(self) -> None:
        log = open(self.work_dir / "router.log", "w")
        self.router = subprocess.Popen(
            [
                str(BIN / "python"),
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.ports[3]),
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(self.ports[4]),
                "--worker-urls",
                *self.worker_urls,
                "--policy",
                "round_robin",
                # No retry: a request the drain failed to protect shows up as a failure.
                "--disable-retries",
                # Each check is a one-token generation on every replica: SGLang 0.5.23 serves /health
                # with health_generate (srt/entrypoints/http_server.py:721-722, generation on by default,
                # srt/environ.py:344), and so does the development server; here about 13 ms of CPU each.
                # A worker added back is probed when it is registered, so returns do not wait for them.
                "--health-check-interval-secs",
                "3",
                "--log-level",
                "warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.wait_for_workers(set(self.worker_urls), timeout=120)

    def healthy_workers(self) -> set[str]:
        try:
            listing = get_json(f"{self.router_url}/workers")
        except OSError:
            return set()
        return {w["url"] for w in listing.get("workers", []) if w.get("is_healthy")}

    def replica_url(self, host: str) -> str:
        return f"http://127.0.0.1:{self.replica_ports[HOSTS.index(host)]}"

    def serve_outside(self, host: str) -> None:
        """Start an inventory replica's server and put it behind the router, leaving it out of the plays'
        --limit (a replica the run does not evaluate: a scoring replica)."""
        self.outside = (*self.outside, host)
        self.put_behind_router(host)
        self.wait_for_workers({*self.worker_urls, self.replica_url(host)}, timeout=120)

    def leave(self, host: str) -> None:
        """Take a replica out of the router (its server keeps running) and wait until it is not listed."""
        url = self.replica_url(host)
        [worker] = [w for w in get_json(f"{self.router_url}/workers")["workers"] if w["url"] == url]
        request = urllib.request.Request(f"{self.router_url}/workers/{worker['id']}", method="DELETE")
        with urllib.request.urlopen(request, timeout=30):
            pass
        deadline = time.monotonic() + 60
        while any(w["url"] == url for w in get_json(f"{self.router_url}/workers")["workers"]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router still lists {url} 60 s after its removal")
            time.sleep(0.2)

    def join(self, host: str) -> None:
        """Start the server of an inventory replica this fleet did not run and put it behind the router."""
        self.put_behind_router(host)
        self.hosts = tuple(h for h in HOSTS if h in (*self.hosts, host))
        self.wait_for_workers(set(self.worker_urls), timeout=120)

    def put_behind_router(self, host: str) -> None:
        started = self.play("service.yml", timeout=600, hosts=(host,), sglang_service_state="started")
        if started.rc != 0:
            raise RuntimeError(f"{host} did not start:\n{started.output[-4000:]}")
        url = self.replica_url(host)
        if any(w["url"] == url for w in get_json(f"{self.router_url}/workers")["workers"]):
            return
        request = urllib.request.Request(
            f"{self.router_url}/workers",
            data=json.dumps({"url": url}).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30):
            pass

    def wait_for_workers(self, urls: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.healthy_workers() != urls:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router lists {self.healthy_workers()} healthy, not {urls}")
            time.sleep(0.5)

    def kill_server(self, host: str) -> int:
        """SIGKILL a replica's server (its process group), as a crash would, and wait until the router
        has seen it: no request of the load that follows is sent to it."""
        pid = self.server_pid(host)
        assert pid is not None, f"{host} has no server to kill"
        os.killpg(pid, signal.SIGKILL)
        url = self.worker_urls[self.hosts.index(host)]
        deadline = time.monotonic() + 120
        while url in self.healthy_workers():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router still lists {url} healthy 120 s after its server was killed")
            time.sleep(0.2)
        return pid

    def server_pid(self, host: str) -> int | None:
        pid_file = self.work_dir / host / "sglang.pid"
        return int(pid_file.read_text().split()[0]) if pid_file.is_file() else None

    def start_load(
        self,
        name: str,
        concurrency: int = 1,
        max_seconds: float = 3600,
        kinds: str = "short",
        long_max_new_tokens: int = 64,
        timeout: float = 120,
        interval: float = 0.0,
    ) -> None:
        self.stop_file(name).unlink(missing_ok=True)
        self.load = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "specops.loadgen",
                "--url",
                self.router_url,
                "--out",
                str(self.work_dir / f"{name}.jsonl"),
                "--stop-file",
                str(self.stop_file(name)),
                "--concurrency",
                str(concurrency),
                "--max-seconds",
                str(max_seconds),
                "--max-requests",
                "20000",
                "--kinds",
                kinds,
                "--long-max-new-tokens",
                str(long_max_new_tokens),
                "--timeout",
                str(timeout),
                "--interval",
                str(interval),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        )

    def stop_file(self, name: str) -> Path:
        return self.work_dir / f"{name}.stop"

    def stop_load(self, name: str) -> dict[str, Any]:
        assert self.load is not None
        self.stop_file(name).touch()
        out, _ = self.load.communicate(timeout=300)
        self.load = None
        return json.loads(out.strip().splitlines()[-1])

    def stop(self) -> None:
        if self.load is not None:
            self.load.kill()
            self.load.wait()
        if self.router is not None:
            os.killpg(self.router.pid, signal.SIGTERM)
            try:
                self.router.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.router.pid, signal.SIGKILL)
                self.router.wait()
            self.router = None
        every = tuple(h for h in HOSTS if h in (*self.hosts, *self.outside))
        self.play("service.yml", sglang_service_state="stopped", timeout=300, hosts=every)
