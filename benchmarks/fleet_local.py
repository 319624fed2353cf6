"""Rolling evaluation of the local fleet (inventory/fleet) under user traffic, against the same
traffic without an evaluation.

Three development servers behind a real sglang-router (retries off, so the drain alone must keep
requests from failing), a load generator sending greedy /generate requests through the router:
1. baseline: the load alone for --baseline-seconds;
2. rolling: the load during `eval.yml -i inventory/fleet` (one host at a time).
Writes benchmarks/fleet_local.json: requests, failed, p50/p99 latency of each phase; the fleet's
wall time against the sum of the per-host windows (from the merged fleet report).

    PYTHONPATH=src .venv/bin/python benchmarks/fleet_local.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))
from fleet_site import LocalFleet  # noqa: E402

LOAD_FIGURES = ("requests", "failed", "p50_s", "p99_s", "span_s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-seconds", type=float, default=120)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "fleet_local.json"))
    args = parser.parse_args()
    models = Path(os.environ.get("SPECOPS_TEST_MODELS", REPO / ".work" / "test-models"))
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    site = LocalFleet(work_dir=work, models_dir=models)
    site.build_models(REPO / ".venv-ml" / "bin" / "python")
    try:
        site.start()
        site.start_load("baseline", concurrency=args.concurrency)
        time.sleep(args.baseline_seconds)
        baseline = site.stop_load("baseline")

        site.start_load("rolling", concurrency=args.concurrency)
        play = site.play("eval.yml")
        rolling = site.stop_load("rolling")
        if play.rc != 0:
            print(play.output[-6000:], file=sys.stderr)
            return 1
        returned = sorted(site.healthy_workers()) == sorted(site.worker_urls)
        fleet = json.loads((work / "replica1" / "run" / "fleet" / "report.json").read_text())
    finally:
        site.stop()
    result = {
        "what": "rolling evaluation of 3 development servers behind sglang-router 0.3.2 under load",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), "
        f"Python {platform.python_version()}",
        "load": {
            "concurrency": args.concurrency,
            "max_new_tokens": 8,
            "router_retries": "disabled",
            "policy": "round_robin",
        },
        "baseline_no_evaluation": {k: baseline[k] for k in LOAD_FIGURES},
        "during_rolling_evaluation": {k: rolling[k] for k in LOAD_FIGURES},
        "every_host_returned_to_the_router": returned,
        "playbook_s": round(play.seconds, 1),
        "fleet_wall_s": fleet["fleet"]["wall_s"],
        "sum_of_host_windows_s": fleet["fleet"]["sum_window_s"],
        # The service's own downtime (host clocks, server stop to ready) and the play's (control node,
        # drained to answering again): two figures, named apart.
        "sum_of_host_service_downtimes_s": fleet["fleet"]["sum_service_downtime_s"],
        "sum_of_host_play_downtimes_s": fleet["fleet"]["sum_play_downtime_s"],
        "per_host": [
            {
                "host": row["host"],
                "n_prompts": row["n_prompts"],
                **{
                    k: row["window"].get(k)
                    for k in ("window_s", "drain_s", "play_downtime_s", "service_downtime_s", "return_s")
                },
            }
            for row in fleet["per_host"]
        ],
        "tau": fleet["overall"]["tau"],
        "reference_tau": (fleet["reference"] or {}).get("tau"),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
