"""Run the real playbooks against the local default, in a work directory and port of the test's own."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
RECAP = re.compile(
    r"^(?P<host>\S+)\s*:\s*ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+"
    r"unreachable=(?P<unreachable>\d+)\s+failed=(?P<failed>\d+)",
    re.M,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PlayResult:
    rc: int
    output: str
    recap: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class LocalDefault:
    work_dir: Path
    port: int
    # The host's cache (specops_host_cache_dir: the environment's verification, triton's kernels): one
    # per host, as /var/cache/specops is, so every site of the run shares it.
    host_cache_dir: Path
    # Settings of this site that every play on it passes (a server launched otherwise would be restarted).
    settings: dict = field(default_factory=dict)

    @property
    def models_dir(self) -> Path:
        # Shared between runs: building the models (and training the reference) takes a while.
        return Path(os.environ.get("SPECOPS_TEST_MODELS", REPO / ".work" / "test-models"))

    def extra_vars(self, **overrides) -> dict:
        values = {
            "specops_work_dir": str(self.work_dir),
            "specops_models_dir": str(self.models_dir),
            "sglang_service_port": self.port,
            "sglang_service_pid_file": str(self.work_dir / "sglang.pid"),
            "sglang_service_log_file": str(self.work_dir / "sglang.log"),
            "specops_host_cache_dir": str(self.host_cache_dir),
            # The development server is ready within seconds: look every second, not every five.
            "sglang_service_ready_delay": 1,
            # The tests seed run directories with the shared run's completions to take a window of their
            # own: the same work is not taken over from the shared run (test_faults.py tests that it is).
            "specops_reuse_extractions": False,
            **self.settings,
        }
        values.update(overrides)
        return values

    def popen(self, playbook: str, args: tuple[str, ...] = (), **overrides) -> subprocess.Popen:
        """The play started, its output (stdout and stderr) read line by line as it runs."""
        return subprocess.Popen(
            [
                str(ANSIBLE_PLAYBOOK),
                str(REPO / "playbooks" / playbook),
                "-e",
                json.dumps(self.extra_vars(**overrides)),
                *args,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
        )

    # A bound, not an expectation: a run from scratch takes minutes, more on a busy machine.
    def play(self, playbook: str, timeout: int = 1800, args: tuple[str, ...] = (), **overrides) -> PlayResult:
        cmd = [
            str(ANSIBLE_PLAYBOOK),
            str(REPO / "playbooks" / playbook),
            "-e",
            json.dumps(self.extra_vars(**overrides)),
            *args,
        ]
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={
                **os.environ,
                "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
                "ANSIBLE_NOCOLOR": "1",
                "ANSIBLE_FORCE_COLOR": "0",
            },
        )
        output = proc.stdout + proc.stderr
        recap = {
            m["host"]: {k: int(m[k]) for k in ("ok", "changed", "unreachable", "failed")}
            for m in RECAP.finditer(output)
        }
        return PlayResult(proc.returncode, output, recap)

    @property
    def run_dir(self) -> Path:
        return self.work_dir / "run"

    def health_generate_status(self) -> int:
        import urllib.error
        import urllib.request

        try:
            url = f"http://127.0.0.1:{self.port}/health_generate"
            with urllib.request.urlopen(url, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:
            return -1

    def server_pid(self) -> int | None:
        pid_file = self.work_dir / "sglang.pid"
        return int(pid_file.read_text().split()[0]) if pid_file.is_file() else None

    def seed_run_dir(self, source: Path, run_dir: Path, stages: tuple[str, ...] = ("completions",)) -> Path:
        """A run directory that starts from a finished run's stage outputs (copied, never shared), so a
        play redoes only what the test is about. Completions do not depend on the server's port or on the
        run directory: a server of the same models reuses them."""
        run_dir.mkdir(parents=True, exist_ok=True)
        for stage in stages:
            shutil.copytree(source / stage, run_dir / stage, symlinks=True)
        return run_dir


@pytest.fixture(scope="session")
def host_cache_dir(tmp_path_factory) -> Path:
    """This host's cache directory, shared by the sites of every pytest-xdist worker of the run."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    (shared / "host-cache").mkdir(exist_ok=True)
    return shared / "host-cache"


@pytest.fixture(scope="session")
def local_default(tmp_path_factory, host_cache_dir):
    """The shared site; its server runs as SGLang's process tree, so the stop window's GPU release meets
    scheduler children holding their devices."""
    work_dir = tmp_path_factory.mktemp("eval")
    site = LocalDefault(
        work_dir=work_dir, port=free_port(), host_cache_dir=host_cache_dir, settings=process_tree(work_dir)
    )
    yield site
    # The play leaves the service running, as production would: stop what the test started.
    site.play("service.yml", sglang_service_state="stopped", sglang_service_guard=False, timeout=120)


@pytest.fixture(scope="session")
def finished_run(local_default) -> PlayResult:
    """eval.yml run once to the end on the shared site, for every module: the server is left serving and
    the run directory holds every stage's output (tests copy it, or run only the stages they need)."""
    result = local_default.play("eval.yml")
    assert result.rc == 0, result.output[-6000:]
    return result


@pytest.fixture(scope="session")
def first_run(finished_run) -> PlayResult:
    """The shared finished run's play (its output is the first run's)."""
    return finished_run


@pytest.fixture(scope="session")
def served(local_default, finished_run) -> LocalDefault:
    """The shared site with its finished evaluation and its server up."""
    return local_default


# SGLang launched with --enable-memory-saver --enable-weights-cpu-backup, and the window that releases
# and resumes its GPU memory instead of stopping it; with both keys (0.5.23: the admin key alone opens
# pause, flush, release and resume), which nothing the plays print, record or log may carry.
API_KEY = "specops-test-api-key-7f3a"
ADMIN_API_KEY = "specops-test-admin-key-9c1e"
MEMORY_SAVER = {
    "sglang_service_memory_saver": True,
    "specops_gpu_window_mode": "memory_saver",
    "sglang_service_api_key": API_KEY,
    "sglang_service_admin_api_key": ADMIN_API_KEY,
    "sglang_service_extra_args": ["--api-key", API_KEY, "--admin-api-key", ADMIN_API_KEY],
}


def process_tree(work_dir: Path, *more: str) -> dict:
    """Settings that run the development server as SGLang's process tree (--tp-size 2: a scheduler child
    per rank, each holding its stand-in device file under work_dir/devices, and a detokenizer), with the
    window's GPU check pointed at those files."""
    devices = work_dir / "devices"
    devices.mkdir(exist_ok=True)
    return {
        "sglang_service_extra_args": [
            "--tp-size",
            "2",
            "--device-file",
            str(devices / "nvidia{rank}"),
            *more,
        ],
        "gpu_release_device_pattern": str(devices / "nvidia*"),
    }


@pytest.fixture(scope="session")
def memory_saver_site(tmp_path_factory, host_cache_dir):
    """A server of its own with the memory saver, run as SGLang's process tree, serving, for the tests of
    the memory-saver window (each in a run directory of its own); stopped at the end. Its releases read
    the fault to inject from work_dir/release-fault (empty: none)."""
    work_dir = tmp_path_factory.mktemp("memory-saver")
    fault_file = work_dir / "release-fault"
    fault_file.write_text("")
    # A simulated 16 GiB device, as the local inventory's: the memory plan keeps the weights resident.
    # A constrained request waits 0.2 s for its grammar: the window's flush and release meet it queued.
    # Not 1 s: with a constrained request every fourth at three at a time, the grammar queue then never
    # empties while generation runs (0 empty readings of 150 over 15 s), so no release can flush: SGLang's
    # limit, which the module meets by failing after sglang_service_drain_timeout with generation
    # continued (docs/faults.md); tests/ansible/test_sglang_service_module.py lets one through at 1 s.
    more = ("--release-fault-file", str(fault_file), "--device-memory-gib", "16")
    more += ("--grammar-compile-delay", "0.2")
    # The tree's arguments replace MEMORY_SAVER's: its keys go with them.
    keys = MEMORY_SAVER["sglang_service_extra_args"]
    settings = {**MEMORY_SAVER, **process_tree(work_dir, *keys, *more)}
    site = LocalDefault(work_dir=work_dir, port=free_port(), host_cache_dir=host_cache_dir, settings=settings)
    started = site.play("service.yml", sglang_service_state="started")
    assert started.rc == 0, started.output[-4000:]
    yield site
    site.play("service.yml", sglang_service_state="stopped", sglang_service_guard=False, timeout=120)
