"""Time the batched offline-tau engine against a sequential z-lab-style loop, and check they agree.

    PYTHONPATH=src python3 benchmarks/score_h200.py            # H200: the realistic shape, bf16
    PYTHONPATH=src python3 benchmarks/score_h200.py --smoke    # CPU: tiny shapes, fp32, seconds

The drafter is random, of a realistic shape (hidden 2048, 5 layers, block 16, vocab 248320). The
target features are random. The target tokens are *planted* so that acceptance is realistic (~6)
rather than 1, and so that every comparison the walk makes is decided by a wide margin:

    at each anchor s, in a construction walk over all completions at once, the drafter's logits for
    the block at s give, per draft position j, the top token and its margin over the runner-up.
    A run length k is drawn (uniform in 0..2*planted_mean, at most bs-1); tokens s+1..s+k' are set
    to the drafts, k' <= k stopping early at the first draft whose margin is below the threshold,
    and token s+k'+1 (the bonus) to the draft position's *lowest*-scoring token, a sure mismatch.
    The walk then continues at s' = s + k' + 1, whose block starts with that token.

Since a block's drafts depend only on its first token and the context features before it (never on
the tokens after it), the walk over these tokens accepts exactly k' + 1 per step, as long as no path
moves a logit by more than half the threshold. The threshold is measured, not guessed: the logits
of the same blocks are computed by the batched engine and by the sequential loop, and the threshold
is 4x the largest difference seen (a top-2 gap moves by at most twice that difference). The engine
does the same work whatever the tokens are; only the number of steps (~L / tau) depends on them.

Timed: the batched engine on all completions, in each mode; the sequential loop (the oracle in
specops.score.acceptance: one completion at a time, one block at a time, the context K/V cached and
grown as tokens are accepted, one host sync per step, as z-lab's generate loop does) on a subset,
extrapolated per completion. Accept lengths must be identical on the subset, and on all completions
between modes and to the planted walk's. Prints JSON and writes $OUT/score_h200.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import specops  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
from transformers import Qwen3Config

from specops.score.acceptance import (
    SequenceInput,
    offline_acceptance,
    overall_tau,
)
from specops.score.drafter import DFlashDrafter
from specops.score.sequential_acceptance import SequentialDrafter, sequential_acceptance
from specops.score.target_head import TargetHead

REALISTIC = dict(
    hidden=2048,
    layers=5,
    heads=16,
    kv_heads=8,
    head_dim=128,
    intermediate=6144,
    block=16,
    vocab=248320,
    sequences=64,
    length=1024,
    prompt=128,
    subset=4,
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
    sequences=6,
    length=160,
    prompt=16,
    subset=2,
    dtype="float32",
)


def build_models(shape: dict, device: str, dtype: torch.dtype, seed: int):
    torch.manual_seed(seed)
    n_features = 5
    config = Qwen3Config(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        vocab_size=shape["vocab"],
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=32768,
        layer_types=["full_attention"] * shape["layers"],
        block_size=shape["block"],
        dflash_config={
            "mask_token_id": shape["vocab"] - 1,
            "target_layer_ids": list(range(1, 1 + n_features)),
        },
    )
    with torch.device(device):
        drafter = DFlashDrafter(config).to(dtype).eval()
        embed = torch.randn(shape["vocab"], shape["hidden"], dtype=dtype)
        lm_head = (torch.randn(shape["vocab"], shape["hidden"]) * shape["hidden"] ** -0.5).to(dtype)
    return drafter, TargetHead(embed, lm_head, logits_budget_bytes=1 << 30)


def block_logits(drafter, head, context, ids, starts):
    """Full logits [B, bs-1, vocab] (fp32) of the blocks at starts [B] of the sequences in `context`."""
    embeds = drafter.block_embeddings(head.embed, ids.gather(1, starts[:, None]))
    hidden = drafter(embeds, starts[:, None], context)[:, 0, 1:]
    return head.logits(hidden).float()


@torch.inference_mode()
def logit_noise(drafter, head, features, ids, prompt: int, probes: int = 4) -> float:
    """Largest logit difference between the batched engine's blocks and the sequential loop's."""
    B = min(ids.shape[0], 8)
    context = drafter.context_kv(features[:B])
    loops = [SequentialDrafter(drafter, head, features[b]) for b in range(min(B, 4))]
    worst = 0.0
    for step in range(probes):
        starts = torch.full((B,), min(prompt + 37 * step, ids.shape[1] - 2), device=ids.device)
        batched = block_logits(drafter, head, context, ids[:B], starts)
        for b, loop in enumerate(loops):  # the first sequences, whose anchors only grow
            single = head.logits(loop.block_hidden(int(ids[b, starts[b]]), int(starts[b]))).float()
            worst = max(worst, float((batched[b] - single).abs().max()))
    return worst


@dataclass
class Planted:
    """What the planting walk set up: per completion, the accept length of every step it planted, and
    the smallest margins its tokens were chosen with (planted matches: top-2 gap; the mismatch after
    each run: the top logit over the planted token's)."""

    accept_lengths: list[list[int]]
    smallest_match_margin: float
    smallest_mismatch_margin: float

    @property
    def steps(self) -> int:
        return sum(len(lengths) for lengths in self.accept_lengths)


def _top2_and_lowest(head, hidden, multiplier, softcap, rows_per_chunk):
    """Per row of hidden [N, H]: top logit and its token, the runner-up's logit, the lowest logit and its
    token; the float32 logits built a chunk of rows at a time."""
    out = []
    for i in range(0, hidden.shape[0], rows_per_chunk):
        logits = head.logits(hidden[i : i + rows_per_chunk], multiplier, softcap).float()
        lowest, lowest_token = logits.min(dim=-1)
        best, best_token = logits.max(dim=-1)
        second = logits.scatter_(-1, best_token[:, None], float("-inf")).amax(dim=-1)
        out.append((best, best_token, second, lowest, lowest_token))
    return [torch.cat(parts) for parts in zip(*out, strict=True)]


@torch.inference_mode()
def plant_tokens(
    drafter,
    head,
    features,
    ids,
    prompt: int,
    planted_mean: int,
    threshold: float,
    seed: int,
    logits_budget_bytes: int = 1 << 30,
) -> Planted:
    """Fill ids[:, prompt+1:] so the walk accepts planted runs (see the module docstring).

    All completions step at once on the device, with no host sync but the loop's own test; only the
    draft positions a run and its mismatch can reach (1..2 * planted_mean + 1) go through the head.
    """
    B, L = ids.shape
    bs = drafter.block_size
    reach = min(bs - 1, 2 * planted_mean + 1)
    device = ids.device
    generator = torch.Generator(device=device).manual_seed(seed)
    context = drafter.context_kv(features)
    rows_per_chunk = max(1, logits_budget_bytes // (4 * head.vocab_size))
    # Room for a block's positions past the end: what lands there is dropped at the end.
    work = torch.cat([ids, ids.new_full((B, bs), -1)], dim=1)
    j = torch.arange(1, reach + 1, device=device)
    starts = torch.full((B,), prompt, device=device)
    steps, match_margin, mismatch_margin = [], [], []
    while bool((starts < L - 1).any()):
        active = starts < L - 1
        s = starts.clamp_max(L - 2)
        embeds = drafter.block_embeddings(head.embed, work.gather(1, s[:, None]))
        hidden = drafter(embeds, s[:, None], context)[:, 0, 1 : reach + 1]  # [B, reach, H]
        parts = _top2_and_lowest(
            head,
            hidden.reshape(B * reach, -1),
            drafter.output_multiplier,
            drafter.logit_softcap,
            rows_per_chunk,
        )
        best, best_token, second, lowest, lowest_token = (t.view(B, reach) for t in parts)
        confident = (best - second) > threshold
        want = torch.randint(0, 2 * planted_mean + 1, (B,), device=device, generator=generator)
        want = want.clamp_max(bs - 1)
        # Stop a run early at its first low-margin draft so that no comparison is a near-tie.
        run = torch.minimum(want, confident.long().cumprod(dim=-1).sum(dim=-1))
        # Drafts up to the run, then the position's lowest-scoring token: a sure mismatch.
        token = torch.where(j <= run[:, None], best_token, lowest_token)
        write = active[:, None] & (j <= run[:, None] + 1)
        positions = s[:, None] + j
        work.scatter_(1, positions, torch.where(write, token, work.gather(1, positions)))
        remaining = L - 1 - s
        inside = positions <= L - 1
        matched = active[:, None] & (j <= run[:, None]) & inside
        mismatched = active[:, None] & (j == run[:, None] + 1) & inside
        match_margin.append(torch.where(matched, best - second, float("inf")).amin())
        mismatch_margin.append(torch.where(mismatched, best - lowest, float("inf")).amin())
        steps.append(torch.where(active, torch.minimum(run + 1, remaining), 0))
        starts = torch.where(active, starts + run + 1, starts)
    ids.copy_(work[:, :L])
    lengths = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in range(B)]
    return Planted(
        accept_lengths=[[a for a in row if a > 0] for row in lengths],
        smallest_match_margin=float(torch.stack(match_margin).amin()) if steps else float("inf"),
        smallest_mismatch_margin=float(torch.stack(mismatch_margin).amin()) if steps else float("inf"),
    )


def timed(fn, device: str):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    value = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU in fp32")
    parser.add_argument("--sequences", type=int)
    parser.add_argument("--length", type=int, help="tokens per completion, prompt included")
    parser.add_argument("--subset", type=int, help="completions the sequential loop is timed on")
    parser.add_argument("--planted-mean", type=int, default=5, help="mean planted run (tau ~ mean + 1)")
    parser.add_argument("--modes", default="frontier,all-anchors")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="JSON file to write (default $OUT/score_h200.json when OUT is set)")
    args = parser.parse_args()

    shape = dict(SMOKE if args.smoke else REALISTIC)
    for key in ("sequences", "length", "subset"):
        if getattr(args, key):
            shape[key] = getattr(args, key)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    dtype = getattr(torch, shape["dtype"])
    B, L, P = shape["sequences"], shape["length"], shape["prompt"]

    drafter, head = build_models(shape, device, dtype, args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    features = torch.randn(B, L, 5, shape["hidden"], device=device, generator=generator).to(dtype)
    ids = torch.randint(0, shape["vocab"] - 1, (B, L), device=device, generator=generator)

    noise = logit_noise(drafter, head, features, ids, P)
    # A top-2 gap moves by at most twice the largest logit deviation; demand twice that again.
    threshold = max(4 * noise, 1e-4)
    planted, plant_seconds = timed(
        lambda: plant_tokens(drafter, head, features, ids, P, args.planted_mean, threshold, args.seed + 2),
        device,
    )
    sequences = [SequenceInput(f"c{b:03d}", ids[b].cpu(), features[b].cpu(), P) for b in range(B)]
    features = None  # the sequences hold host copies; free the device one

    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": shape["dtype"],
        "shape": shape,
        "logit_noise": noise,
        "margin_threshold": threshold,
        "plant_seconds": plant_seconds,
        "planted_steps": planted.steps,
        "modes": {},
    }
    # Warm-up (cuBLAS handles, allocator) on two short completions, untimed.
    warm = [SequenceInput(s.id, s.input_ids[: P + 64], s.features[: P + 64], P) for s in sequences[:2]]
    for mode in args.modes.split(","):
        offline_acceptance(drafter, head, warm, mode=mode)
    sequential_acceptance(drafter, head, warm[0])

    results = {}
    for mode in args.modes.split(","):
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        results[mode], seconds = timed(
            lambda mode=mode: offline_acceptance(drafter, head, sequences, mode=mode), device
        )
        report["modes"][mode] = {
            "seconds": seconds,
            "completions_per_s": B / seconds,
            "tau": overall_tau(results[mode]),
            "steps": sum(r.steps for r in results[mode]),
            "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        }
        print(
            f"{mode}: {seconds:.2f} s for {B} completions, tau {overall_tau(results[mode]):.3f}",
            file=sys.stderr,
        )

    subset = sequences[: shape["subset"]]
    oracle, seq_seconds = timed(lambda: [sequential_acceptance(drafter, head, s) for s in subset], device)
    per_completion = seq_seconds / len(subset)
    report["sequential"] = {
        "completions_timed": len(subset),
        "seconds": seq_seconds,
        "seconds_per_completion": per_completion,
        "completions_per_s": 1 / per_completion,
        "steps": sum(r.steps for r in oracle),
        "ms_per_step": 1000 * seq_seconds / max(1, sum(r.steps for r in oracle)),
        "tau": overall_tau(oracle),
        "extrapolated_seconds_for_all": per_completion * B,
    }
    modes = list(results)
    report["identical"] = {
        "sequential_vs_" + mode: all(
            o.accept_lengths == r.accept_lengths for o, r in zip(oracle, results[mode], strict=False)
        )
        for mode in modes
    }
    if len(modes) > 1:
        report["identical"]["between_modes_all_completions"] = all(
            results[modes[0]][i].accept_lengths == results[m][i].accept_lengths
            for m in modes[1:]
            for i in range(B)
        )
    # The planted runs are what every path must reproduce, step for step.
    report["identical"]["planted_accept_lengths"] = all(
        [r.accept_lengths for r in results[m]] == planted.accept_lengths for m in modes
    )
    best = min(modes, key=lambda m: report["modes"][m]["seconds"])
    report["fastest_mode"] = best
    sequential_rate = report["sequential"]["completions_per_s"]
    report["speedup_vs_sequential"] = {
        m: report["modes"][m]["completions_per_s"] / sequential_rate for m in modes
    }
    report["ok"] = all(report["identical"].values())

    text = json.dumps(report, indent=2)
    print(text)
    out = args.out or (os.path.join(os.environ["OUT"], "score_h200.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    if not report["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
