"""The service's cost of scoring on the host's CPU, on the local default: an outside client's latency.

One run, three phases side by side against one development server (the fixture target, on the CPU):
no scoring; the score stage run back to back, unbounded (as eval.yml scored before the placement); and
the same, bounded as `specops_score_placement: cpu` bounds it (module_utils/stages/cpu_scope.py: a systemd
scope where systemd is PID 1 and may be asked, else `nice -n 10` with one thread per quarter core). The
client (specops.loadgen) sends short greedy /generate requests (8 tokens, one thread, back to back);
its p50/p99 per phase go to JSON with the date and the machine.

    .venv-ml/bin/python benchmarks/score_placement_local.py [--phase-seconds 45] \
        [--out benchmarks/score_placement_local.json]

The fixture models are tiny: a scoring run is mostly its process start (importing torch) and a few
seconds of float32 work; what is measured is how much the scoring's CPU use takes from the server.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "unit"), str(ROOT / "collections")]

from ansible_collections.specops.drafter.plugins.module_utils.stages import cpu_scope  # noqa: E402

PYTHON = sys.executable


def wait_ready(url: str, deadline_s: float = 600) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url + "/health_generate", timeout=30) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"the development server at {url} did not answer /health_generate")


def build_inputs(fixtures: Path, run: Path) -> None:
    """Completions and hidden states of the fixture target, more of them than the tests use."""
    import score_data

    if (run / "hidden_states" / "manifest.json").is_file():
        return
    ids = score_data.layer_ids_of(fixtures / "drafter")
    score_data.write_completions(
        fixtures / "target", fixtures / "prompts.jsonl", run / "completions", n_prompts=8, max_new_tokens=96
    )
    score_data.write_hidden_states(fixtures / "target", run / "completions", run / "hidden_states", ids, (0,))


def score_loop(command: list[str], env: dict, request: dict, stop: threading.Event, runs: list) -> None:
    """The score stage back to back (force: every run scores) until stopped; each run's seconds."""
    while not stop.is_set():
        start = time.monotonic()
        done = subprocess.run(command, input=json.dumps(request), text=True, env=env, capture_output=True)
        if done.returncode != 0:
            raise SystemExit(f"the score stage failed: {done.stderr[-2000:]}")
        runs.append(time.monotonic() - start)


def phase(name: str, url: str, seconds: float, work: Path, scoring: tuple[list[str], dict] | None, request):
    rows = work / f"{name.replace(' ', '_')}.jsonl"
    stop, runs = threading.Event(), []
    loop = None
    if scoring:
        loop = threading.Thread(target=score_loop, args=(*scoring, request, stop, runs), daemon=True)
        loop.start()
        time.sleep(3)  # the first run's imports under way before the client starts
    client = subprocess.run(
        [PYTHON, "-m", "specops.loadgen", "--url", url, "--out", str(rows), "--kinds", "short",
         "--concurrency", "1", "--max-seconds", str(seconds), "--max-requests", "100000"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, check=True,
    )  # fmt: skip
    stop.set()
    if loop:
        loop.join()
    summary = json.loads(client.stdout.splitlines()[-1])
    return {
        "phase": name,
        "requests": summary["requests"],
        "failed": summary["failed"],
        "p50_s": summary["p50_s"],
        "p99_s": summary["p99_s"],
        "score_runs": len(runs),
        "score_run_s_mean": round(sum(runs) / len(runs), 2) if runs else None,
        "command_prefix": (scoring[0][: scoring[0].index(PYTHON)] if scoring else None),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-seconds", type=float, default=45)
    parser.add_argument("--port", type=int, default=30417)
    models = os.environ.get("SPECOPS_TEST_MODELS", ROOT / ".work/test-models")
    parser.add_argument("--fixtures", default=models)
    parser.add_argument("--work", default="/tmp/specops-score-placement-bench")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "score_placement_local.json"))
    args = parser.parse_args()
    fixtures, work = Path(args.fixtures), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    build_inputs(fixtures, work / "run")
    url = f"http://127.0.0.1:{args.port}"
    # Unbounded means what the math libraries choose: no thread count inherited from the caller's shell.
    threads = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in threads} | {"PYTHONPATH": str(ROOT / "src")}
    serve = ["specops.devserver", "--model-path", str(fixtures / "target"), "--port", str(args.port)]
    server = subprocess.Popen(
        [PYTHON, "-m", *serve],
        env=env, stdout=open(work / "server.log", "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_ready(url)
        cores = os.cpu_count() or 1
        bounds = cpu_scope.with_defaults({"nice": 10}, cores)
        manager = cpu_scope.host_systemd_manager()
        command = [PYTHON, "-m", "specops.score", "--run"]
        request = {
            "hidden_states": str(work / "run/hidden_states"),
            "completions": str(work / "run/completions"),
            "target": str(fixtures / "target"),
            "drafter": [str(fixtures / "drafter")],
            "out_dir": str(work / "score"),
            "device": "cpu",
            "dtype": "float32",
            "diagnostics": ["backend", "vocabulary"],
            "force": True,
        }
        bounded = cpu_scope.bounded_argv(command, bounds, manager)
        phases = [
            phase("no scoring", url, args.phase_seconds, work, None, request),
            phase("scoring unbounded", url, args.phase_seconds, work, (command, env), request),
            phase(
                "scoring bounded",
                url,
                args.phase_seconds,
                work,
                (bounded, {**env, **cpu_scope.thread_environment(bounds)}),
                {**request, "cpu_bounds": bounds},
            ),
        ]
    finally:
        server.terminate()
        server.wait(timeout=60)
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
            "systemd_manager": manager,
        },
        "bounds": bounds,
        "client": "specops.loadgen, short requests (8 tokens), 1 thread, back to back",
        "phase_seconds": args.phase_seconds,
        "phases": phases,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for row in phases:
        print(f"{row['phase']:>18}: p50 {row['p50_s']} s, p99 {row['p99_s']} s, {row['requests']} requests, "
              f"{row['failed']} failed, {row['score_runs']} score runs")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
