"""Scoring on the CPU at the real drafter's shape: completions per second of the batched engine.

    PYTHONPATH=src python3 benchmarks/score_real_cpu.py --completions 2 --output-tokens 16

The drafter has the shape of score_real_h200.py's (hidden 5120, 5 layers, 32/8 heads of 128,
intermediate 17408, block 16, vocabulary 248,320), random weights, float32 as the CPU path scores
(`resolve_dtype` auto). The embedding and the lm_head share one matrix to keep the host's memory to
~12 GB; the arithmetic is the same. The features and tokens are random: a random drafter accepts
about one token a step, so the step count is the number of output tokens. The engine runs once to
warm up on one completion, then is timed on all of them (wall clock and the process's CPU time); the
record says how the engine grouped them.
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

import torch
from transformers import Qwen3Config

import specops.score.acceptance as acceptance
from specops.score.acceptance import SequenceInput, offline_acceptance, overall_tau
from specops.score.drafter import DFlashDrafter
from specops.score.target_head import TargetHead

SHAPE = dict(hidden=5120, layers=5, heads=32, kv_heads=8, head_dim=128, intermediate=17408, block=16)
VOCAB = 248320
N_FEATURES = 5
PROMPT = 128


def random_drafter(seed: int) -> DFlashDrafter:
    """The real shape with weights drawn at the scale of a trained drafter's (std 0.02), fast."""
    config = Qwen3Config(
        hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["intermediate"],
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"],
        head_dim=SHAPE["head_dim"],
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=32768,
        layer_types=["full_attention"] * SHAPE["layers"],
        block_size=SHAPE["block"],
        dflash_config={"mask_token_id": VOCAB - 1, "target_layer_ids": list(range(1, 1 + N_FEATURES))},
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    drafter.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    drafter.rotary_emb = type(drafter.rotary_emb)(config)
    if hasattr(drafter, "fuse_projections"):
        drafter.fuse_projections()
    return drafter.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=2)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="JSON file to write (default: print only)")
    args = parser.parse_args()

    drafter = random_drafter(args.seed)
    generator = torch.Generator().manual_seed(args.seed + 1)
    matrix = torch.randn(VOCAB, SHAPE["hidden"], generator=generator) * SHAPE["hidden"] ** -0.5
    head = TargetHead(matrix, matrix)
    length = PROMPT + args.output_tokens
    sequences = [
        SequenceInput(
            f"c{i}",
            torch.randint(0, VOCAB - 1, (length,), generator=generator),
            torch.randn(length, N_FEATURES, SHAPE["hidden"], generator=generator),
            PROMPT,
        )
        for i in range(args.completions)
    ]
    offline_acceptance(drafter, head, sequences[:1])
    budget = acceptance.default_memory_budget(torch.device("cpu"))
    started, cpu_started = time.perf_counter(), time.process_time()
    results = offline_acceptance(drafter, head, sequences)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    groups = acceptance.group_indices(drafter, sequences, budget)
    record = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python3 benchmarks/score_real_cpu.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "shape": {**SHAPE, "vocab": VOCAB, "prompt": PROMPT, "length": length},
        "completions": args.completions,
        "seconds": seconds,
        "completions_per_s": args.completions / seconds,
        # On a shared machine the wall clock counts the other processes too; the CPU time does not.
        "cpu_seconds": cpu_seconds,
        "completions_per_cpu_s": args.completions / cpu_seconds,
        "load_average": os.getloadavg(),
        "steps": sum(r.steps for r in results),
        "tau": overall_tau(results),
        "memory_budget_gib": budget / 2**30,
        "groups": len(groups),
        "accept_lengths": [r.accept_lengths for r in results],
    }
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
