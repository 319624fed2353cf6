"""roles/sglang_router against a real sglang-router (the Rust binary of the sglang-router package),
with small stand-in workers that answer what the router and the drain ask of an SGLang server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Worker(BaseHTTPRequestHandler):
    """/health, server and model info, and /get_load as SGLang answers them (one DP rank, idle)."""

    def do_GET(self):
        answers = {
            "/health": {},
            "/health_generate": {},
            "/get_server_info": {"model_path": "m"},
            "/server_info": {"model_path": "m"},
            "/get_model_info": {"model_path": "m"},
            "/model_info": {"model_path": "m"},
            "/get_load": [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}],
        }
        body = answers.get(self.path.split("?")[0])
        data = json.dumps(body).encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def workers():
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Worker) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for server in servers:
        server.shutdown()


def listing(router: str) -> dict[str, bool]:
    with urllib.request.urlopen(f"{router}/workers", timeout=5) as response:
        return {w["url"]: w["is_healthy"] for w in json.loads(response.read())["workers"]}


def start_router(tmp_path, urls):
    port = free_port()
    proc = subprocess.Popen(
        [
            str(BIN / "python"),
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--worker-urls",
            *urls,
            "--health-check-interval-secs",
            "1",
            "--log-level",
            "warn",
        ],
        stdout=open(tmp_path / "router.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    router = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if all(listing(router).get(url) for url in urls):
                return proc, router
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError((tmp_path / "router.log").read_text()[-2000:])
        time.sleep(0.3)


@pytest.fixture
def router(tmp_path, workers):
    proc, url = start_router(tmp_path, workers)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)


def run_role(tmp_path, actions, show: str = "", **variables):
    """The role's actions in order; `show`: a template whose value the play prints at the end."""
    tasks = [
        {
            "name": f"sglang_router {a}",
            "ansible.builtin.include_role": {"name": "sglang_router"},
            "vars": {"sglang_router_action": a},
        }
        for a in actions
    ]
    if show:
        tasks.append({"name": "show", "ansible.builtin.debug": {"msg": f"SHOWN {show} END"}})
    play = [{"hosts": "localhost", "gather_facts": False, "vars": variables, "tasks": tasks}]
    playbook = tmp_path / "play.yml"
    playbook.write_text(json.dumps(play))
    proc = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            "localhost,",
            "-c",
            "local",
            str(playbook),
            "-e",
            f"ansible_python_interpreter={sys.executable}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_check_fails_naming_a_router_that_cannot_be_reached(tmp_path):
    rc, output = run_role(
        tmp_path,
        ["check"],
        sglang_router_url=f"http://127.0.0.1:{free_port()}",
        sglang_router_worker_url="http://127.0.0.1:1",
    )
    assert rc != 0
    assert "cannot be reached" in output and "no host was drained" in output


def test_check_fails_when_the_router_does_not_list_the_host(tmp_path, router):
    rc, output = run_role(
        tmp_path, ["check"], sglang_router_url=router, sglang_router_worker_url="http://127.0.0.1:1"
    )
    assert rc != 0
    assert "does not list" in output and "http://127.0.0.1:1" in output


def test_drain_removes_the_host_and_return_brings_it_back_healthy(tmp_path, router, workers):
    rc, output = run_role(
        tmp_path, ["check", "drain"], sglang_router_url=router, sglang_router_worker_url=workers[0]
    )
    assert rc == 0, output[-3000:]
    assert set(listing(router)) == {workers[1]}
    # A drained host is not listed, so check would refuse it: return runs alone, as in eval.yml's window.
    rc, output = run_role(
        tmp_path,
        ["return"],
        sglang_router_url=router,
        sglang_router_worker_url=workers[0],
        sglang_router_return_retries=60,
    )
    assert rc == 0, output[-3000:]
    assert listing(router) == {workers[0]: True, workers[1]: True}


def test_drain_refuses_to_take_the_last_healthy_replica(tmp_path, router, workers):
    rc, output = run_role(
        tmp_path,
        ["check", "drain"],
        sglang_router_url=router,
        sglang_router_worker_url=workers[0],
        sglang_router_min_healthy_others=2,
    )
    assert rc != 0
    assert "would leave 1 healthy replica" in output
    assert set(listing(router)) == set(workers)


def test_health_says_whether_the_server_answers_and_the_router_reports_it_healthy(tmp_path, router, workers):
    shown = "{{ sglang_router_serving }}: {{ sglang_router_health_seen }}"
    rc, output = run_role(
        tmp_path, ["health"], show=shown, sglang_router_url=router, sglang_router_worker_url=workers[0]
    )
    assert rc == 0, output[-3000:]
    said = " ".join(output.split())
    assert "SHOWN True: its server answers /health_generate 200, the router reports it healthy END" in said
    # A server that is gone, and that the router does not list: not serving, and nothing was changed.
    rc, output = run_role(
        tmp_path,
        ["health"],
        show=shown,
        sglang_router_url=router,
        sglang_router_worker_url=f"http://127.0.0.1:{free_port()}",
    )
    assert rc == 0, output[-3000:]
    said = " ".join(output.split())
    assert "SHOWN False: its server answers /health_generate nothing, the router does not list it END" in said
    assert listing(router) == {workers[0]: True, workers[1]: True}
