#!/usr/bin/env python3
"""A run's tau against the sequential walk on the same hidden states (#42's rehearsal check).

    python benchmarks/score_sequential_check.py --run RUN_DIR --target DIR --drafter DIR [--device auto]
        [--dtype bfloat16] [--out FILE]

Reads RUN_DIR/hidden_states (the extraction the play wrote) and RUN_DIR/score/report.json (the tau the
play reported), walks every sequence with the batched engine (`offline_acceptance`, what the score stage
runs) and with the plain one-block-at-a-time loop (`sequential_acceptance`), and writes both taus, the
report's, and whether every accept length is identical. Exit 1 where they differ.

--device auto takes the GPU where its free memory holds the head and the drafter with room to spare, else
the CPU in float32: after a rehearsal the server has its KV pool back, and on an 80 GB GPU the check ran
out of memory beside it (2026-12-05).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specops.hidden_states import open_hidden_states
from specops.score.acceptance import offline_acceptance, overall_tau
from specops.score.drafter import load_drafter
from specops.score.inputs import drafter_layer_ids
from specops.score.sequential_acceptance import sequential_acceptance
from specops.score.target_head import load_target_head


def choose_device(asked: str, target: Path, drafter: Path) -> tuple[str, str]:
    """(device, why): auto is cuda where the free memory holds 1.5 x the head's and the drafter's bytes."""
    if asked != "auto":
        return asked, "asked"
    if not torch.cuda.is_available():
        return "cpu", "no CUDA device"
    from specops.placement import head_parameters, safetensors_bytes

    need = int(1.5 * (2 * 2 * head_parameters(target) + safetensors_bytes(drafter)))
    free, _ = torch.cuda.mem_get_info()
    if free >= need:
        return "cuda", f"{free >> 20} MiB free, {need >> 20} MiB needed"
    return "cpu", f"the GPU has {free >> 20} MiB free, {need >> 20} MiB needed (the server holds the rest)"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, type=Path)
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--drafter", required=True, type=Path)
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu")
    parser.add_argument("--dtype", default="bfloat16", help="on the GPU; the CPU computes in float32")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.device, why = choose_device(args.device, args.target, args.drafter)
    dtype = getattr(torch, args.dtype) if args.device == "cuda" else torch.float32
    config = json.loads((args.drafter / "config.json").read_text())
    layer_ids = drafter_layer_ids(config, "drafter")
    head = load_target_head(args.target, device=args.device, dtype=dtype)
    drafter = load_drafter(args.drafter, device=args.device, dtype=dtype)
    sequences = [
        {"id": str(meta["id"]), "input_ids": ids, "features": feats, "prompt_len": int(meta["prompt_tokens"])}
        for meta, ids, feats in open_hidden_states(args.run / "hidden_states").select_layers(layer_ids)
    ]
    started = time.perf_counter()
    engine = {r.id: r for r in offline_acceptance(drafter, head, sequences)}
    engine_s = time.perf_counter() - started
    started = time.perf_counter()
    sequential = {s["id"]: sequential_acceptance(drafter, head, s) for s in sequences}
    sequential_s = time.perf_counter() - started
    report = json.loads((args.run / "score" / "report.json").read_text())
    differing = [
        i for i in sequential if list(sequential[i].accept_lengths) != list(engine[i].accept_lengths)
    ]
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "device_why": why,
        "run": str(args.run),
        "drafter": str(args.drafter),
        "sequences": len(sequences),
        "tau_report": report["overall"]["tau"],
        "tau_engine": overall_tau(engine.values()),
        "tau_sequential": overall_tau(sequential.values()),
        "identical_accept_lengths": not differing,
        "differing": differing[:10],
        "engine_s": round(engine_s, 3),
        "sequential_s": round(sequential_s, 3),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if not differing else 1


if __name__ == "__main__":
    sys.exit(main())
