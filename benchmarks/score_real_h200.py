"""Scoring throughput at the real drafter's shape, where the time goes, and the ceiling the arithmetic sets.

    PYTHONPATH=src python3 benchmarks/score_real_h200.py            # H200: Qwen3.6-27B's drafter, bf16
    PYTHONPATH=src python3 benchmarks/score_real_h200.py --smoke    # CPU: tiny shapes, seconds

The drafter has the shape of the DFlash drafter published for Qwen3.6-27B (hidden 5120, 5 layers,
32/8 heads of 128, intermediate 17408, block 16, vocabulary 248320, 5 target layers), random weights;
completions of 1,000 output tokens after a 128-token prompt; tokens planted as in score_h200.py
(same planted mean, so tau is comparable), features in pinned host memory as a loader would hand
them over. Timed on all completions:
  - the engine (specops.acceptance, frontier mode), the head computed only where the walk needs it;
  - the same with the head over all 15 positions of every block (what the engine did before);
  - the engine again with a StepTimer: inputs (features to the device, context K/V), drafter layers,
    head, and the walk's own steps (the rest);
and the sequential oracle on a subset. Accept lengths must be identical everywhere. The record also
counts the arithmetic (drafter and head FLOPs of the steps the walk took) against a bf16 matrix rate
measured in the same run: the ceiling in completions per second at this tau.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

try:
    import specops  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from score_h200 import build_models, logit_noise, plant_tokens, timed

import specops.leading_matches as matching
from specops.acceptance import SequenceInput, offline_acceptance, overall_tau, sequential_acceptance
from specops.step_timer import StepTimer

REAL = dict(
    hidden=5120,
    layers=5,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=17408,
    block=16,
    vocab=248320,
    sequences=512,
    length=1128,
    prompt=128,
    subset=2,
    dtype="bfloat16",
)
SMOKE = dict(
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    block=8,
    vocab=512,
    sequences=12,
    length=160,
    prompt=16,
    subset=2,
    dtype="float32",
)


def matmul_rate(device: str) -> float | None:
    """bf16 FLOP/s of an 8192^3 product (mean of 10 after 3 warm-ups): the ceiling for the arithmetic."""
    if device != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _, seconds = timed(lambda: [a @ b for _ in range(10)], device)
    return 10 * 2 * 8192**3 / seconds


def flops_per_completion(shape: dict, results, positions_per_pass: int) -> dict[str, float]:
    """Drafter and head FLOPs of the walk's steps, per completion (matrix products only; the attention
    over the context, under 3% at this shape, is left out)."""
    h, d, kv, ff = shape["hidden"], shape["head_dim"], shape["kv_heads"], shape["intermediate"]
    per_layer = h * shape["heads"] * d * 2 + 2 * h * kv * d + 3 * h * ff
    bs = shape["block"]
    steps = sum(r.steps for r in results)
    drafter = 2 * bs * shape["layers"] * per_layer * steps
    # Positions the head computes per step: whole passes up to the one holding the first mismatch.
    positions = 0
    for r in results:
        for a in r.accept_lengths:
            needed = min(a, bs - 1)  # a - 1 matches, then the mismatch (or the last position)
            positions += min(-(-needed // positions_per_pass) * positions_per_pass, bs - 1)
    head = 2 * h * shape["vocab"] * positions
    head_all = 2 * h * shape["vocab"] * (bs - 1) * steps
    context = 2 * shape["length"] * len(results) * (5 * h * h + shape["layers"] * 2 * h * kv * d)
    n = len(results)
    return {
        "drafter": drafter / n,
        "head": head / n,
        "head_all_positions": head_all / n,
        "context": context / n,
        "head_positions_per_step": positions / steps,
    }


def kernel_profile(drafter, head, sequences, rows: int = 30) -> list[dict]:
    """The kernels that take the most device time in one engine run (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        offline_acceptance(drafter, head, sequences)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    found = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0.0))[:rows]
    return [{"name": e.key[:90], "calls": e.count, "device_ms": getattr(e, key, 0.0) / 1e3} for e in found]


class Record:
    """The report, written after every stage, and a log line per stage: a run cut short still tells."""

    def __init__(self, out: str | None):
        self.out, self.started, self.data = out, time.perf_counter(), {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def stage(self, name: str, **values) -> None:
        self.data.update(values)
        self.data.setdefault("stages_s", {})[name] = round(self.elapsed(), 1)
        print(f"[{self.elapsed():7.1f}s] {name}", file=sys.stderr, flush=True)
        if self.out:
            Path(self.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.out).write_text(json.dumps(self.data, indent=2) + "\n")


def same(a, b) -> bool:
    return all(x.accept_lengths == y.accept_lengths for x, y in zip(a, b, strict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU in fp32")
    parser.add_argument("--sequences", type=int)
    parser.add_argument("--planted-mean", type=int, default=5, help="mean planted run (as score_h200.py)")
    parser.add_argument(
        "--margin-factor",
        type=float,
        default=4.0,
        help="planted runs stop at a draft whose top-2 gap is under this many times the logit noise; "
        "lower plants longer runs (tau nearer planted-mean + 1) with closer calls",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile", type=int, default=0, help="also profile the engine on this many completions"
    )
    parser.add_argument(
        "--deadline", type=float, default=0, help="skip the optional stages after this many s"
    )
    parser.add_argument(
        "--out", help="JSON file to write (default $OUT/score_real_h200.json when OUT is set)"
    )
    args = parser.parse_args()

    shape = dict(SMOKE if args.smoke else REAL)
    if args.sequences:
        shape["sequences"] = args.sequences
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    dtype = getattr(torch, shape["dtype"])
    B, L, P = shape["sequences"], shape["length"], shape["prompt"]
    out = args.out or (
        os.path.join(os.environ["OUT"], "score_real_h200.json") if os.environ.get("OUT") else None
    )
    record = Record(out)

    def time_left() -> bool:
        return not args.deadline or record.elapsed() < args.deadline

    rate = matmul_rate(device)
    record.stage(
        "matmul rate",
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        command="PYTHONPATH=src python3 benchmarks/score_real_h200.py " + " ".join(sys.argv[1:]),
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        torch=torch.__version__,
        shape=shape,
        matmul_flops_per_s=rate,
    )
    drafter, head = build_models(shape, device, dtype, args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    features = torch.randn(B, L, 5, shape["hidden"], device=device, generator=generator, dtype=dtype)
    ids = torch.randint(0, shape["vocab"] - 1, (B, L), device=device, generator=generator)
    noise = logit_noise(drafter, head, features, ids, P)
    threshold = max(args.margin_factor * noise, 1e-4)
    rows = torch.randn(1024, shape["hidden"], device=device, dtype=dtype)
    head.logits(rows)
    _, head_seconds = timed(lambda: [head.logits(rows) for _ in range(5)], device)
    record.stage(
        "models and noise",
        logit_noise=noise,
        margin_threshold=threshold,
        head_logits_flops_per_s=5 * 2 * 1024 * shape["hidden"] * shape["vocab"] / head_seconds,
    )
    planted_steps, plant_seconds = timed(
        lambda: plant_tokens(drafter, head, features, ids, P, args.planted_mean, threshold, args.seed + 2),
        device,
    )
    record.stage(
        "planted",
        plant_seconds=plant_seconds,
        planted_steps=planted_steps,
        planted_tau=B * (L - 1 - P) / planted_steps,
    )
    sequences = []
    for b in range(B):
        host = torch.empty(features[b].shape, dtype=dtype, pin_memory=device == "cuda").copy_(features[b])
        sequences.append(SequenceInput(f"c{b:04d}", ids[b].cpu(), host, P))
    features = None
    warm = [SequenceInput(s.id, s.input_ids[: P + 64], s.features[: P + 64], P) for s in sequences[:4]]
    offline_acceptance(drafter, head, warm)
    record.stage("inputs pinned, warm-up")

    def engine(per_pass: int, timer: StepTimer | None = None):
        matching.DEFAULT_POSITIONS_PER_PASS = per_pass
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        found, seconds = timed(lambda: offline_acceptance(drafter, head, sequences, timer=timer), device)
        summary = {"seconds": seconds, "completions_per_s": B / seconds, "steps": sum(r.steps for r in found)}
        if device == "cuda":
            summary["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return found, summary

    per_pass = 3
    runs: dict = {}
    results, runs["head_where_needed"] = engine(per_pass)
    flops = flops_per_completion(shape, results, per_pass)
    step_flops = flops["drafter"] + flops["head"] + flops["context"]
    record.stage(
        "engine",
        tau=overall_tau(results),
        runs=runs,
        flops_per_completion=flops,
        ceiling_completions_per_s=rate / step_flops if rate else None,
        mfu=step_flops * B / runs["head_where_needed"]["seconds"] / rate if rate else None,
        identical={"planted_steps": runs["head_where_needed"]["steps"] == planted_steps},
    )
    identical = record.data["identical"]
    timer = StepTimer(device)
    timed_results, runs["head_where_needed_timed"] = engine(per_pass, timer)
    parts = timer.seconds()
    identical["timed_vs_untimed"] = same(timed_results, results)
    record.stage(
        "engine, timed parts",
        where_the_time_goes_s={
            "inputs (features to the device, context K/V)": parts.get("inputs", 0.0),
            "drafter layers": parts.get("drafter", 0.0),
            "head (only where the walk needs it)": parts.get("head", 0.0),
            "walk (steps minus drafter and head)": parts.get("steps", 0.0)
            - parts.get("drafter", 0.0)
            - parts.get("head", 0.0),
            "total (timed run)": runs["head_where_needed_timed"]["seconds"],
        },
    )
    if time_left():
        full_head, runs["head_all_positions"] = engine(shape["block"] - 1)
        identical["head_all_positions_vs_where_needed"] = same(full_head, results)
        record.stage("engine, head over all positions")
    matching.DEFAULT_POSITIONS_PER_PASS = per_pass
    if time_left():
        subset = sequences[: shape["subset"]]
        oracle, oracle_seconds = timed(
            lambda: [sequential_acceptance(drafter, head, s) for s in subset], device
        )
        identical["sequential_vs_engine"] = same(oracle, results)
        record.stage(
            "sequential oracle",
            sequential={
                "completions_timed": len(subset),
                "seconds_per_completion": oracle_seconds / len(subset),
                "tau": overall_tau(oracle),
            },
        )
    if args.profile and time_left():
        record.stage(
            "kernel profile", kernel_profile=kernel_profile(drafter, head, sequences[: args.profile])
        )
    record.stage("done", ok=all(identical.values()))
    print(json.dumps(record.data, indent=2))
    if not record.data["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
