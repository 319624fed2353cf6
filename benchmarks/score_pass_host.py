"""The host's time to queue one head pass against the GPU's time to run it, at the real shape.

Each head pass of the frontier walk (`specops.score.leading_matches`) starts right after a host
synchronization (the previous pass's surviving blocks are read back), so the GPU waits while the host
queues the pass's first kernels. This measures, for passes of several row counts:
  - host_ms: the host's time to queue the pass while the GPU is busy with earlier work (no waiting);
  - gpu_ms: the GPU's time for the pass when it was queued ahead (CUDA events, no host gaps);
  - from_idle_ms: the wall time of the pass started on an idle GPU and read back, as the walk runs it;
  - idle_ms: from_idle_ms - gpu_ms, what the walk loses per pass to the host.
for the engine's pass (`leading_matches` with `DFlashDrafter.finish` and `TargetHead.argmax`) and for a
lean statement of the same pass (the same products, fewer and cheaper host calls), whose tokens must
equal the engine's. idle_ms holds the harness's own few calls too (the targets made, the residual copied,
the final synchronization), so it is an upper bound.

On two H100s on 2026-12-06 (benchmarks/score_pass_host_h100_2026-12-06_8aef59a.json, _bca0284.json) the
hosts queued a pass in 0.8 and 0.56 ms; passes idled 0.5-0.7 and 0.3-0.4 ms, and the straight line saved
about 0.2 ms a pass on the slower host, nothing on the faster one. Built into the engine, it changed the
engine's time by less than the rounds' spread (score_real_h100_2026-12-06_host_calls.json), so the engine
keeps the modules' path.

    PYTHONPATH=src python3 benchmarks/score_pass_host.py --out $OUT/score_pass_host.json
    PYTHONPATH=src python3 benchmarks/score_pass_host.py --smoke      # CPU: tiny shapes, the same code
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
import torch.nn.functional as F
from score_h200 import build_models
from score_real_h200 import REAL, SMOKE

from specops.score import kernels
from specops.score.leading_matches import leading_matches

ROUNDS = 30


def lean_pass(drafter, head, residual, mixed, targets, alive, first, last, runs, read_back=True):
    """One pass as `leading_matches` runs it, in the fewest host calls: the same kernels as the engine's,
    called in a straight line. Returns the blocks still matching where read_back (a host synchronization,
    as in the engine), else None."""
    layer = drafter.decoder_layers[-1]
    hidden = residual.shape[-1]
    x = residual[:, first:last].index_select(0, alive)
    m = mixed[:, first:last].index_select(0, alive)
    flat = x.view(-1, hidden)
    flat.addmm_(m.view(-1, m.shape[-1]), layer.self_attn.o_proj.weight.T)
    normed = F.rms_norm(
        flat,
        (hidden,),
        layer.post_attention_layernorm.weight,
        layer.post_attention_layernorm.variance_epsilon,
    )
    gate, up = F.linear(normed, layer._gate_up[0]).chunk(2, dim=-1)
    if kernels.applies(gate):
        from specops.score.kernels.silu_mul import silu_mul

        act = silu_mul(gate, up)
    else:
        act = F.silu(gate) * up
    flat.addmm_(act, layer.mlp.down_proj.weight.T)
    out = F.rms_norm(flat, (hidden,), drafter.norm.weight, drafter.norm.variance_epsilon)
    if out.is_cuda:
        logits = torch.mm(out, head.lm_head_weight.T, out_dtype=torch.float32)
    else:
        logits = F.linear(out.float(), head.lm_head_weight.float())
    drafts = logits.argmax(dim=-1).view(alive.shape[0], last - first)
    matched = (drafts == targets[:, first:last].index_select(0, alive)).cumprod(dim=-1)
    runs.index_add_(0, alive, matched.sum(dim=-1))
    return alive.index_select(0, matched[:, -1].nonzero().squeeze(1)) if read_back else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU in fp32")
    parser.add_argument(
        "--out", help="JSON file to write (default $OUT/score_pass_host.json when OUT is set)"
    )
    args = parser.parse_args()
    shape = dict(SMOKE if args.smoke else REAL)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    drafter, head = build_models(shape, device, dtype, 0)
    drafter.fuse_projections()
    B, bs, H = shape["sequences"], shape["block"], shape["hidden"]
    attn_width = shape["heads"] * shape["head_dim"]
    generator = torch.Generator(device=device).manual_seed(1)
    residual = torch.randn(B, bs - 1, H, device=device, dtype=dtype, generator=generator)
    mixed = torch.randn(B, bs - 1, attn_width, device=device, dtype=dtype, generator=generator) * 0.05
    busy_a = torch.randn(4096, 4096, device=device, dtype=dtype)

    def busy() -> None:
        """Queue about 20 ms of GPU work so that the host's queueing is timed alone."""
        for _ in range(1 if device == "cpu" else 120):
            busy_a @ busy_a

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def engine_pass(rows: int, width: int, read_back: bool):
        """One pass of `leading_matches` over rows blocks at `width` positions, its states gathered and
        finished as the engine's group does (`SequenceGroup.match_runs`); read_back: the targets go on after
        the pass, so it reads the surviving blocks back (the synchronization)."""
        alive_targets = torch.full((rows, 2 * width if read_back else width), -1, device=device)
        res, mix = residual[:rows].clone(), mixed[:rows]

        def states(blocks, first, last):
            return drafter.finish(
                res[:, first:last].index_select(0, blocks),
                mix[:, first:last].index_select(0, blocks),
                owned=True,
            )

        return leading_matches(head, states, alive_targets, positions_per_pass=width)

    def lean(rows: int, width: int, read_back: bool):
        targets = torch.full((rows, 2 * width), -1, device=device)
        runs = torch.zeros(rows, dtype=torch.long, device=device)
        alive = torch.arange(rows, device=device)
        lean_pass(
            drafter, head, residual[:rows].clone(), mixed[:rows], targets, alive, 0, width, runs, read_back
        )
        return runs

    cases = [(256, 3), (180, 3), (120, 3), (86, 3), (50, 5), (20, 13)]
    if device == "cpu":
        cases = [(12, 3), (6, 3), (4, 5)]
    results: dict = {}
    with torch.inference_mode():
        # The engine's and the lean pass's leading matches, on targets set to the engine's drafts.
        rows, width = cases[0]
        states = drafter.finish(residual[:rows, :width].clone(), mixed[:rows, :width], owned=True)
        drafts = head.argmax(states)
        targets = torch.cat([drafts, torch.full_like(drafts, -1)], dim=1)
        targets[rows // 2 :, 1] = -1
        expected = leading_matches(
            head,
            lambda b, f, e: drafter.finish(residual[:rows].clone()[b, f:e], mixed[:rows][b, f:e], owned=True),
            targets,
            positions_per_pass=width,
        )
        runs = torch.zeros(rows, dtype=torch.long, device=device)
        lean_pass(
            drafter,
            head,
            residual[:rows].clone(),
            mixed[:rows],
            targets,
            torch.arange(rows, device=device),
            0,
            width,
            runs,
        )
        results["lean_equals_engine"] = bool(torch.equal(runs, expected))
        for name, fn in (("engine", engine_pass), ("lean", lean)):
            per_case = {}
            for rows, width in cases:
                for _ in range(3):
                    fn(rows, width, True)
                sync()
                host, gpu, cold = [], [], []
                for _ in range(ROUNDS):
                    busy()
                    if device == "cuda":
                        start, end = (
                            torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True),
                        )
                        start.record()
                    t = time.perf_counter()
                    fn(rows, width, False)
                    host.append(time.perf_counter() - t)
                    if device == "cuda":
                        end.record()
                        end.synchronize()
                        gpu.append(start.elapsed_time(end) / 1e3)
                    sync()
                    t = time.perf_counter()
                    fn(rows, width, True)
                    sync()
                    cold.append(time.perf_counter() - t)
                med = lambda xs: statistics.median(xs) * 1e3 if xs else None  # noqa: E731
                entry = {
                    "rows": rows * width,
                    "blocks": rows,
                    "width": width,
                    "host_ms": med(host),
                    "from_idle_ms": med(cold),
                }
                if gpu:
                    entry["gpu_ms"] = med(gpu)
                    entry["idle_ms"] = entry["from_idle_ms"] - entry["gpu_ms"]
                per_case[f"{rows}x{width}"] = entry
                print(name, entry, flush=True)
            results[name] = per_case
    record = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "PYTHONPATH=src python3 benchmarks/score_pass_host.py"
        + (" --smoke" if args.smoke else ""),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": shape,
        **results,
    }
    out = args.out or (
        os.path.join(os.environ["OUT"], "score_pass_host.json") if os.environ.get("OUT") else None
    )
    if out:
        Path(out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "shape"}, indent=1))
    if not results["lean_equals_engine"]:
        sys.exit("the lean pass's leading matches differ from the engine's")


if __name__ == "__main__":
    main()
