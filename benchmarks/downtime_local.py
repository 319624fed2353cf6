"""Service downtime on the local default: stop/start versus memory-saver release/resume.

Runs the sglang_service role (process backend) on this machine with the development server and
the fixture model, and polls /health_generate while a GPU window runs: downtime is the time during
which it does not answer 200. Writes JSON and prints a Markdown table.

    .venv/bin/python benchmarks/downtime_local.py [--repeats 3] [--out .work/benchmarks/downtime_local.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".work" / "benchmarks" / "downtime"
ML_PYTHON = ROOT / ".venv-ml" / "bin" / "python"
PLAYBOOK = """\
- name: sglang_service window
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Take the server down
      ansible.builtin.include_role:
        name: sglang_service
      vars:
        sglang_service_state: "{{ sglang_bench_down }}"
      when: sglang_bench_down | length > 0
    - name: Bring the server back
      ansible.builtin.include_role:
        name: sglang_service
      vars:
        sglang_service_state: "{{ sglang_bench_up }}"
      when: sglang_bench_up | length > 0
"""
# The GPU window itself is empty: what is measured is the cost of leaving and coming back.
MODES = {"stop/start": ("stopped", "started"), "memory saver release/resume": ("released", "resumed")}


def role_vars(port: int, fixtures: Path, startup_delay: float) -> dict:
    return {
        "sglang_service_backend": "process",
        "sglang_service_python": str(ML_PYTHON),
        "sglang_service_launcher_module": "specops.devserver",
        "sglang_service_model_path": str(fixtures / "target"),
        "sglang_service_port": port,
        "sglang_service_memory_saver": True,
        "sglang_service_extra_args": ["--startup-delay", str(startup_delay)],
        "sglang_service_environment": {"PYTHONPATH": str(ROOT / "src")},
        "sglang_service_run_dir": str(WORK / "run"),
        "sglang_service_ready_delay": 0.2,
        "sglang_service_max_downtime": 600,
    }


def playbook(down: str, up: str, extra: dict) -> float:
    """Run one window; the play's wall time in seconds."""
    # The control node's Python runs the modules: interpreter discovery would pick a pyenv shim.
    variables = dict(
        extra,
        sglang_bench_down=down,
        sglang_bench_up=up,
        ansible_python_interpreter=str(ROOT / ".venv" / "bin" / "python"),
    )
    (WORK / "vars.json").write_text(json.dumps(variables))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    start = time.monotonic()
    done = subprocess.run(
        [
            str(ROOT / ".venv" / "bin" / "ansible-playbook"),
            "-i",
            "localhost,",
            str(WORK / "window.yml"),
            "-e",
            f"@{WORK / 'vars.json'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"the {down or up} play failed:\n{done.stdout[-4000:]}{done.stderr[-2000:]}")
    return time.monotonic() - start


class Poller:
    """Polls /health_generate and adds up the time it does not answer 200."""

    def __init__(self, url: str, interval: float = 0.05):
        self.url, self.interval = url, interval
        self.samples: list[tuple[float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _ok(self) -> bool:
        try:
            with urllib.request.urlopen(self.url, timeout=5) as answer:
                return answer.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self._ok()))
            self._stop.wait(self.interval)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def downtime(self) -> float:
        down = 0.0
        for (t0, ok), (t1, _) in zip(self.samples, self.samples[1:], strict=False):
            if not ok:
                down += t1 - t0
        return down


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=30124)
    parser.add_argument(
        "--startup-delay",
        type=float,
        default=2.0,
        help="the development server's --startup-delay (a real model loads for minutes)",
    )
    parser.add_argument("--out", default=str(ROOT / ".work" / "benchmarks" / "downtime_local.json"))
    args = parser.parse_args()

    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "window.yml").write_text(PLAYBOOK)
    fixtures = ROOT / ".work" / "sglang_service" / "fixtures"
    if not (fixtures / "target" / "config.json").is_file():
        build = [str(ML_PYTHON), "-m", "specops.fixtures", "--out", str(fixtures), "--no-reference-training"]
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        subprocess.run(build, env=env, check=True, capture_output=True)
    extra = role_vars(args.port, fixtures, args.startup_delay)
    url = f"http://127.0.0.1:{args.port}/health_generate"

    results: dict[str, dict] = {}
    playbook("", "started", extra)
    try:
        for mode, (down, up) in MODES.items():
            downtimes, walls = [], []
            for _ in range(args.repeats):
                with Poller(url) as poller:
                    walls.append(playbook(down, up, extra))
                    time.sleep(0.2)
                downtimes.append(poller.downtime())
            results[mode] = {
                "downtime_s": downtimes,
                "play_wall_s": walls,
                "median_downtime_s": statistics.median(downtimes),
            }
    finally:
        playbook("stopped", "", dict(extra, sglang_service_guard=False))

    report = {
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs), no GPU",
        "backend": "process",
        "server": "specops.devserver",
        "startup_delay_s": args.startup_delay,
        "repeats": args.repeats,
        "modes": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print("| mode | median downtime (s) | downtimes (s) | play wall time (s) |\n| --- | --- | --- | --- |")
    for mode, row in results.items():
        downtimes = ", ".join(f"{d:.2f}" for d in row["downtime_s"])
        walls = ", ".join(f"{w:.1f}" for w in row["play_wall_s"])
        print(f"| {mode} | {row['median_downtime_s']:.2f} | {downtimes} | {walls} |")
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
