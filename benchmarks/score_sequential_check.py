#!/usr/bin/env python3
"""A run's tau against the sequential walk on the same hidden states (#42's rehearsal check).

    python benchmarks/score_sequential_check.py --run RUN_DIR --target DIR --drafter DIR [--device cuda]
        [--dtype bfloat16] [--out FILE]

Reads RUN_DIR/hidden_states (the extraction the play wrote) and RUN_DIR/score/report.json (the tau the
play reported), walks every sequence with the batched engine (`offline_acceptance`, what the score stage
runs) and with the plain one-block-at-a-time loop (`sequential_acceptance`), and writes both taus, the
report's, and whether every accept length is identical. Exit 1 where they differ.
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, type=Path)
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--drafter", required=True, type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
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
