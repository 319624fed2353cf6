"""Scoring throughput at the real drafter's shape, where the time goes, and the ceiling the arithmetic sets.

    PYTHONPATH=src python3 benchmarks/score_real_h200.py            # H200: Qwen3.6-27B's drafter, bf16
    PYTHONPATH=src python3 benchmarks/score_real_h200.py --smoke    # CPU: tiny shapes, fp32
    PYTHONPATH=src python3 benchmarks/score_real_h200.py --smoke --triton-references  # and the Triton
                                  # variants' stages, with the kernels' torch references in their place

The drafter has the shape of the DFlash drafter published for Qwen3.6-27B (hidden 5120, 5 layers,
32/8 heads of 128, intermediate 17408, block 16, vocabulary 248320, 5 target layers), random weights;
256 completions of 1,000 output tokens after a 128-token prompt; features in pinned host memory as a
loader would hand them over.

The tokens are planted as in score_h200.py (run lengths drawn uniform in 0..2 x --planted-mean, a run
stopping early at a draft whose top-2 gap is under --margin-factor x the measured logit noise, then a
sure mismatch), so that tau is that of a DFlash drafter at block 16 (~6) and every comparison the walk
makes is decided by a wide margin. A random drafter of this shape cannot carry such runs by itself:
its outputs point the same way for every block and position (cosine ~0.99, recorded as
drafter_output_cosine), so its logits are one fixed draw of ~N(0, 1) values over the vocabulary whose
top-2 gap (a few hundredths) is at the bf16 noise between the batched engine and the oracle (~0.02);
the planted runs then stop at once (tau 1.4). Scaling the head or the norm weights cannot help: the
noise scales with the logits. A trained drafter's logits are peaked, and the benchmark's head is made
peaked in the plainest way (`decisive_head`): the lm_head row of the drafter's usual top token is set
along the drafter's mean output direction, scaled so that its logit leads every other by --lead
logits on probe blocks. Every draft is then that token, by a margin many times the noise (the
smallest margin a planted token was chosen with, in units of the noise, is in the record), and runs
stop where they are drawn to stop. The engine's work does not depend on which tokens the drafts are:
every step drafts full blocks and takes the argmax over the whole vocabulary; what the accept lengths
decide (the number of steps, the positions the head needs) is what the planting sets.

Timed on all completions, each stage written to the record as it ends:
  - the engine (specops.score.acceptance, frontier mode): the head, and the drafter's last layer after its
    attention, computed only at the draft positions the walk needs; the process's first run at the full
    shape apart (it meets every batch size and kernel variant for the first time), then REPEATS runs,
    whose median is the engine's figure;
  - the engine with split walks if it does not split them by default, or without if it does
    (specops.score.split_walks), forwards and blocks drafted counted for every run;
  - with --alternate-passes N, N rounds of the engine in head passes of 2, 3 and 4 positions in turn;
  - with --alternate-switches N, N rounds of the engine at its defaults and with each switch of SWITCHED
    in turn (a run's time drifts over a process: a switch is read against the defaults of its rounds);
  - the sequential oracle on a subset;
  - the engine again with a StepTimer: inputs (the group's set-up), the context's K/V (each chunk's as
    the walk reaches it), drafter layers (every block position, up to the last layer's attention), the
    last layer's rest and the head at the needed positions, and the walk's own steps (the rest);
  - the same with each of the engine's switches in SWITCHED otherwise than by default (the block's own
    keys written into the context instead of merged by the Triton kernel, the trunk eager instead of
    replayed from a CUDA graph, every chunk's features copy queued at the start instead of two ahead of
    the walk, the context's K/V computed ahead on a side stream instead of on the walk's stream as it
    reaches them, the down projection's weight stored row-major instead of column-major, the residual
    sums apart from the products instead of in their epilogues, ended walks leaving the batch at a
    sixteenth or a quarter of it instead of an eighth, head passes widened to 384 or 512 rows instead of
    256), the drafter's attention through FlashAttention with the block merged or through the one-pass
    Triton kernel (whichever the kernel chooser did not pick);
  - the same with head passes not widened where few blocks are left (leading_matches.MIN_ROWS_PER_PASS),
    and with the first layer's mask rows projected from a strided slice (one 2-row product per block);
  - the same with the head and the last layer over all 15 draft positions of every block, and in
    passes of 2 or 4 positions instead of 3;
  - the same with the Triton kernels of specops.score.kernels (on CUDA with triton) switched otherwise
    than by default (the elementwise kernels and the block merge on, the head's off): the head's argmax
    in its product's epilogue on, and every kernel off;
    before them, the Triton head's tokens against the torch head's on the drafter's outputs (must be
    equal) and on random rows (a mismatch only at a near-tie: --head-tie-tolerance);
  - a kernel profile of the engine on every completion cut to its first --profile-tokens tokens.
Accept lengths must equal the planted ones on every completion, the oracle's on the subset, and the
first engine run's in every variant. The
record counts the arithmetic of the steps the walk took (matrix-product FLOPs per completion: drafter
layers, the last layer's rest, head, attention, context) against a bf16 matrix rate measured in the
same run: the ceiling in completions per second at this tau, and the fraction of it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

try:
    import specops  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from score_h200 import build_models, logit_noise, plant_tokens, timed

import specops.score.acceptance as acceptance
import specops.score.block_attention as block_attention
import specops.score.drafter as drafter_module
import specops.score.drafter_ops as drafter_ops
import specops.score.kernels as kernels
import specops.score.leading_matches as matching
import specops.score.streamed_context as streamed_context
import specops.score.target_head as target_head
import specops.score.trunk_graph as trunk_graph
from specops.score.acceptance import SequenceInput, offline_acceptance, overall_tau
from specops.score.drafter import DFlashAttention
from specops.score.sequential_acceptance import sequential_acceptance
from specops.score.step_timer import StepTimer

N_FEATURES = 5
REAL = dict(
    hidden=5120,
    layers=5,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=17408,
    block=16,
    vocab=248320,
    sequences=256,
    length=1128,
    prompt=128,
    subset=8,
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
POSITIONS_PER_PASS = 3
# The name choose_kernels gives `flash` with the block's keys written into the context.
FLASH_IN_CONTEXT = "flash, block keys in context"
# Runs of the engine at the defaults after the process's first; their median is the engine's figure.
REPEATS = 3
# The engine's switches measured against their defaults: name -> (module, attribute, value).
SWITCHED = {
    "block_keys_in_context": (block_attention, "BLOCK_KEYS", "in_context"),
    "trunk_eager": (trunk_graph, "GRAPH_DEVICES", ()),
    "copies_all_at_start": (streamed_context, "COPIES_AHEAD", None),
    "kv_ahead": (streamed_context, "KV_AHEAD_DEVICES", ("cuda",)),
    "down_row_major": (drafter_module, "DOWN_COLUMNS_DEVICES", ()),
    "sums_apart": (drafter_ops, "SUM_IN_PRODUCT", False),
    "leave_at_sixteenth": (acceptance, "ENDED_SHARE", 1 / 16),
    "leave_at_quarter": (acceptance, "ENDED_SHARE", 1 / 4),
    "min_rows_384": (matching, "MIN_ROWS_PER_PASS", {"cuda": 384}),
    "min_rows_512": (matching, "MIN_ROWS_PER_PASS", {"cuda": 512}),
    "attention_flash": (block_attention, "KERNEL", "flash"),
    "attention_triton": (block_attention, "KERNEL", "triton"),
}
# Switches read when the drafter's weights are laid out (`DFlashDrafter.fuse_projections`), not at each call:
# the weights are laid out again as the switch is set and again as it is restored.
LAYOUT_SWITCHES = {(drafter_module, "DOWN_COLUMNS_DEVICES")}
# Attention calls the engine makes at each batch size: 5 layers x about 7 forwards (the frontier drops
# finished sequences an eighth of the batch at a time). An attention kernel is chosen by
# CALLS_PER_BATCH_SIZE x its time per call + what its first call at a new batch size costs.
CALLS_PER_BATCH_SIZE = 35


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


@torch.inference_mode()
def probe_states(drafter, head, features, ids, prompt: int, sequences: int = 8, starts: int = 4):
    """Drafter outputs [N, hidden] (float32) at the draft positions of blocks across a few completions."""
    B, L = min(ids.shape[0], sequences), ids.shape[1]
    context = drafter.context_kv(features[:B])
    found = []
    for start in torch.linspace(prompt, L - 2, starts).long().tolist():
        at = torch.full((B, 1), start, device=ids.device)
        embeds = drafter.block_embeddings(head.embed, ids[:B].gather(1, at))
        found.append(drafter(embeds, at, context)[:, 0, 1:].reshape(-1, drafter.hidden_size).float())
    return torch.cat(found)


def decisive_head(drafter, head, features, ids, prompt: int, lead: float) -> dict:
    """Make the random head's logits peaked (see the module docstring); returns what was done and seen."""
    states = probe_states(drafter, head, features, ids, prompt)
    unit = F.normalize(states, dim=-1)
    direction = F.normalize(unit.mean(dim=0), dim=0)
    cosine = unit @ direction
    with torch.inference_mode():
        logits = head.logits(states.to(head.dtype), drafter.output_multiplier, drafter.logit_softcap).float()
    top2 = logits.topk(2, dim=-1).values
    token = int(torch.bincount(logits.argmax(dim=-1)).argmax())
    # The new row's logit is scale x (state . direction): the probe with the least of it leads by `lead`.
    along = states @ direction
    scale = (float(logits.max()) + lead) / max(float(along.min()), 1e-3 * float(along.max()), 1e-6)
    with torch.no_grad():
        head.lm_head_weight[token] = (direction * scale).to(head.dtype)
    with torch.inference_mode():
        after = head.logits(states.to(head.dtype), drafter.output_multiplier, drafter.logit_softcap).float()
    new_top2 = after.topk(2, dim=-1)
    return {
        "token": token,
        "lead": lead,
        "row_norm": scale,
        "probe_positions": states.shape[0],
        "drafter_output_cosine": {"min": float(cosine.min()), "mean": float(cosine.mean())},
        "random_head_top2_gap": _quantiles(top2[:, 0] - top2[:, 1]),
        "decisive_head_top2_gap": _quantiles(new_top2.values[:, 0] - new_top2.values[:, 1]),
        "decisive_head_drafts_that_token": float((new_top2.indices[:, 0] == token).float().mean()),
        "_random_gaps": top2[:, 0] - top2[:, 1],
    }


def _quantiles(values: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(values.float().cpu(), torch.tensor([0.0, 0.1, 0.5, 0.9]))
    return {"min": float(q[0]), "p10": float(q[1]), "median": float(q[2]), "p90": float(q[3])}


def flops_per_completion(
    shape: dict,
    results,
    positions_of: Callable[[int], int] | None = None,
    exact: bool = False,
    real_context: bool = False,
    positions: int | None = None,
) -> dict[str, float]:
    """Matrix-product FLOPs per completion of the steps the walk took.

    positions_of(a): the draft positions the last layer's rest (o_proj, MLP) and the head run at, in a
    step of accept length a; or positions: how many the engine ran them at in all (counted). Attention
    counts the scores and their mix over the whole padded context (the engine masks the context after a
    block's start, it does not shorten it). exact: the work no exact engine can skip: attention over the
    context before each block only, and the first layer's q/k/v of the mask rows once (they are the
    same in every block before RoPE). real_context: the engine's attention reads the context before each
    block only (the `flash` kernel).
    """
    h, heads, kv, d = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    bs, layers, T = shape["block"], shape["layers"], shape["length"]
    q, kvp, o, mlp = h * heads * d, 2 * h * kv * d, heads * d * h, 3 * h * shape["intermediate"]
    steps = sum(r.steps for r in results)
    if positions is None:
        assert positions_of is not None
        positions = sum(positions_of(a) for r in results for a in r.accept_lengths)
    n = len(results)
    # The engine projects a block's first two rows in the first layer (its mask rows are alike).
    first_layer_rows = 1 if exact else 2
    keys = sum(s + bs for r in results for s in r.block_starts) if exact or real_context else (T + bs) * steps
    parts = {
        "drafter_layers": 2
        * (bs * ((layers - 1) * (q + kvp + o + mlp) + q + kvp) - (bs - first_layer_rows) * (q + kvp))
        * steps
        / n,
        "last_layer_rest": 2 * (o + mlp) * positions / n,
        "head": 2 * h * shape["vocab"] * positions / n,
        "attention": 4 * layers * heads * d * bs * keys / n,
        "context": 2 * T * (N_FEATURES * h * h + layers * kvp),
    }
    parts["total"] = sum(parts.values())
    parts["head_positions_per_step"] = positions / steps
    parts["steps"] = steps / n
    return parts


@torch.inference_mode()
def choose_kernels(drafter, head, sequences, device: str, rows_per_pass: int) -> dict:
    """Time every attention kernel (specops.score.block_attention) on one layer of the engine's largest step,
    and the head's argmax with several vocabulary chunks on one pass's rows; keep the fastest of each.

    Same inputs for all: the attention outputs are compared with the reference's, the head's tokens
    with those of one product over the whole vocabulary (they must be equal).
    """
    B, bs = len(sequences), drafter.block_size
    T = sequences[0].input_ids.shape[0]
    features = torch.stack([s.features for s in sequences]).to(device)
    context = drafter.context_kv(features, block_slots=True)
    del features
    generator = torch.Generator(device=device).manual_seed(7)
    starts = torch.randint(T // 2, T - 1, (B, 1), device=device, generator=generator)
    anchors = torch.randint(0, head.vocab_size, (B, 1), device=device, generator=generator)
    layer = drafter.decoder_layers[0]
    x = layer.input_layernorm(drafter.block_embeddings(head.embed, anchors))
    cos, sin = drafter.rope(starts[..., None] + torch.arange(bs, device=device), x)
    q, k_blk, v_blk = layer.self_attn.qkv(x, cos, sin)
    attention = {}
    outputs = {}
    # `flash` with the block's own keys merged by the Triton kernel (the default where it applies) and
    # written into the context (block_attention.BLOCK_KEYS).
    candidates = {**block_attention.KERNELS, FLASH_IN_CONTEXT: block_attention.flash}
    for i, (name, kernel) in enumerate(candidates.items()):

        def call(rows=B, kernel=kernel, keys=context[0], name=name):
            k, v = keys
            args = (q[:rows], k_blk[:rows], v_blk[:rows], starts[:rows], k[:rows], v[:rows], T)
            if name == FLASH_IN_CONTEXT:
                with switched(block_attention, "BLOCK_KEYS", "in_context"):
                    return kernel(layer.self_attn, *args)
            return kernel(layer.self_attn, *args)

        # A batch size this kernel has not met yet: what a new size costs (cuDNN builds a plan), after
        # one call at another size, which loads the kernel's code once per process.
        try:
            call(max(1, B - 2 * len(candidates) - i))
            _, first = timed(lambda call=call, i=i: call(B - 1 - i), device)
        except (RuntimeError, TypeError) as error:  # a backend this torch or device lacks
            attention[name] = {"error": str(error).splitlines()[0][:300]}
            continue
        outputs[name] = call()
        _, seconds = timed(lambda call=call: [call() for _ in range(10)], device)
        attention[name] = {"ms": seconds / 10 * 1e3, "first_call_at_a_new_batch_size_ms": first * 1e3}
        attention[name]["score_ms"] = CALLS_PER_BATCH_SIZE * attention[name]["ms"] + first * 1e3
    reference = outputs["reference"].float()
    for name, out in outputs.items():
        attention[name]["max_abs_diff_vs_reference"] = float((out.float() - reference).abs().max())
    del context, outputs
    fastest_attention = min(
        (n for n in attention if "score_ms" in attention[n]), key=lambda n: attention[n]["score_ms"]
    )
    if fastest_attention == FLASH_IN_CONTEXT:
        block_attention.KERNEL, block_attention.BLOCK_KEYS = "flash", "in_context"
    else:
        block_attention.KERNEL = fastest_attention

    hidden = torch.randn(rows_per_pass, drafter.hidden_size, device=device, generator=generator)
    hidden = hidden.to(head.dtype)
    chunks: dict[str, dict] = {}
    whole = None
    saved = head.vocab_chunk
    for chunk in (head.vocab_size, 65536, 32768, 16384, 8192):
        head.vocab_chunk = chunk
        tokens = head.argmax(hidden)
        whole = tokens if whole is None else whole
        _, seconds = timed(lambda: [head.argmax(hidden) for _ in range(10)], device)
        chunks[str(chunk)] = {
            "ms": seconds / 10 * 1e3,
            "tokens_equal_whole_vocab": bool((tokens == whole).all()),
        }
    head.vocab_chunk = saved
    fastest_chunk = int(min(chunks, key=lambda c: chunks[c]["ms"]))
    target_head.DEFAULT_VOCAB_CHUNK = fastest_chunk
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "attention_kernels": {
            "batch": B,
            "context": T,
            "rule": f"least {CALLS_PER_BATCH_SIZE} x ms + first_call_at_a_new_batch_size_ms",
            "per_kernel": attention,
            "chosen": fastest_attention,
        },
        "head_vocab_chunks": {"rows": rows_per_pass, "per_chunk": chunks, "chosen": fastest_chunk},
    }


@torch.inference_mode()
def triton_head_tokens(head, rows, multiplier, softcap, tolerance: float, device: str) -> dict:
    """The Triton head's tokens against the torch head's on the same rows, and the time of each.

    The kernel sums in another order than cuBLAS, so a token may differ only where the two tokens'
    torch logits are within rounding: each mismatch's gap is measured, the largest must be <= tolerance.
    """
    saved = target_head.ARGMAX_KERNEL
    found = {"rows": rows.shape[0]}
    try:
        for kernel in ("torch", "triton"):
            target_head.ARGMAX_KERNEL = kernel
            if kernel == "triton":  # false where the rule keeps the torch path (a softcap, no CUDA)
                found["triton_kernel_ran"] = head.fused_argmax_applies(rows, softcap)
            found[kernel] = head.argmax(rows, multiplier, softcap)
            _, seconds = timed(lambda: [head.argmax(rows, multiplier, softcap) for _ in range(10)], device)
            found[f"{kernel}_ms"] = seconds / 10 * 1e3
    finally:
        target_head.ARGMAX_KERNEL = saved
    expected, tokens = found.pop("torch"), found.pop("triton")
    wrong = (tokens != expected).nonzero().flatten()
    gap = 0.0
    if len(wrong):
        logits = head.logits(rows[wrong], multiplier, softcap)
        gap = float((logits.gather(-1, expected[wrong, None]) - logits.gather(-1, tokens[wrong, None])).max())
    found.update(
        mismatches=len(wrong), largest_torch_logit_gap_at_a_mismatch=gap, within_tolerance=gap <= tolerance
    )
    return found


@contextmanager
def switched(module, name: str, value, drafter=None):
    """module.name = value for the block, the default back after; the drafter's weights laid out again
    both times where the switch is one of LAYOUT_SWITCHES."""
    saved = getattr(module, name)
    relay = drafter is not None and (module, name) in LAYOUT_SWITCHES
    setattr(module, name, value)
    if relay:
        drafter.fuse_projections()
    try:
        yield
    finally:
        setattr(module, name, saved)
        if relay:
            drafter.fuse_projections()


@contextmanager
def strided_mask_rows():
    """DFlashAttention.projections with its mask rows' slice handed to the product as it is (strided)."""
    projections = DFlashAttention.projections

    def strided(self, x, rows_alike=False):
        bs = x.shape[-2]
        if not (rows_alike and bs > 2 and self.fused_qkv() is not None):
            return projections(self, x, rows_alike)
        two = F.linear(x[..., :2, :], *self.fused_qkv())
        rest = two[..., 1:, :].expand(*two.shape[:-2], bs - 1, two.shape[-1])
        return torch.cat([two[..., :1, :], rest], dim=-2)

    DFlashAttention.projections = strided
    try:
        yield
    finally:
        DFlashAttention.projections = projections


def warm_triton(head, hidden: int, device: str) -> None:
    """Compile the Triton head for the row counts the engine meets: each row tile (16 to 128 rows), row
    counts that are and are not multiples of 16 (triton specialises on both)."""
    for rows in (1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 256):
        head.argmax(torch.randn(rows, hidden, device=device, dtype=head.dtype))


def kernel_profile(drafter, head, sequences, rows: int = 30) -> list[dict]:
    """The kernels that take the most device time in one engine run (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        offline_acceptance(drafter, head, sequences)
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    found = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0.0))[:rows]
    return [{"name": e.key[:90], "calls": e.count, "device_ms": getattr(e, key, 0.0) / 1e3} for e in found]


class Record:
    """The report, written after every stage, and a log line per stage: a run cut short still tells."""

    def __init__(self, out: str | None):
        self.out, self.started, self.data = out, time.perf_counter(), {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def begin(self, name: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {name} ...", file=sys.stderr, flush=True)

    def stage(self, name: str, **values) -> None:
        self.data.update(values)
        self.data.setdefault("stages_s", {})[name] = round(self.elapsed(), 1)
        print(f"[{self.elapsed():7.1f}s] {name} done", file=sys.stderr, flush=True)
        if self.out:
            Path(self.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.out).write_text(json.dumps(self.data, indent=2) + "\n")


def count_forwards() -> list[int]:
    """Count the engine's batched forwards (one `SequenceGroup.match_runs` each) and the blocks they
    drafted (the walks' steps, the steps a walk takes past a split, and rows of ended walks still in the
    batch) from now on; returns the counter [forwards, blocks]."""
    counter = [0, 0]
    match_runs = acceptance.SequenceGroup.match_runs

    def counted(self, starts, *args, **kwargs):
        counter[0] += 1
        counter[1] += starts.numel()
        return match_runs(self, starts, *args, **kwargs)

    acceptance.SequenceGroup.match_runs = counted
    return counter


def count_head_rows(head) -> list[int]:
    """Count the rows the head's argmax takes from now until `del head.argmax` (no host sync: the
    shapes are known on the host); returns the one-element counter."""
    counter = [0]
    argmax = head.argmax

    def counted(hidden, *args, **kwargs):
        counter[0] += hidden.numel() // hidden.shape[-1]
        return argmax(hidden, *args, **kwargs)

    head.argmax = counted
    return counter


def same(a, b) -> bool:
    return all(x.accept_lengths == y.accept_lengths for x, y in zip(a, b, strict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU in fp32")
    parser.add_argument("--sequences", type=int)
    parser.add_argument("--length", type=int, help="tokens per completion, prompt included")
    parser.add_argument("--subset", type=int, help="completions the sequential oracle checks")
    parser.add_argument("--planted-mean", type=int, default=5, help="mean planted run (tau ~ mean + 1)")
    parser.add_argument(
        "--margin-factor",
        type=float,
        default=4.0,
        help="planted runs stop at a draft whose top-2 gap is under this many times the logit noise",
    )
    parser.add_argument(
        "--lead",
        type=float,
        default=8.0,
        help="logits by which the decisive head's token leads on the probes (0: leave the random head)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--triton-references",
        action="store_true",
        help="run the Triton variants' stages with the kernels' torch references (the benchmark's own check)",
    )
    parser.add_argument(
        "--head-tie-tolerance",
        type=float,
        default=1e-3,
        help="largest torch logit gap between the Triton head's token and the torch head's where they differ",
    )
    parser.add_argument(
        "--profile-tokens",
        type=int,
        default=96,
        help="profile the engine on every completion cut to its prompt and this many tokens (0: no profile)",
    )
    parser.add_argument(
        "--alternate-passes",
        type=int,
        default=0,
        help="after the first engine run, this many rounds of head passes of 2, 3 and 4 positions in turn",
    )
    parser.add_argument(
        "--alternate-switches",
        type=int,
        default=0,
        help="after the first engine runs, this many rounds of the defaults and each SWITCHED switch in turn",
    )
    parser.add_argument(
        "--switches",
        help="comma-separated names of SWITCHED to alternate and time (default: all of them)",
    )
    parser.add_argument(
        "--deadline", type=float, default=0, help="skip the optional stages after this many s"
    )
    parser.add_argument(
        "--essential",
        action="store_true",
        help="before the timed parts, skip the optional stages (split walks, the Triton head's tokens): the "
        "engine, the sequential oracle and where the time goes, for a short lease",
    )
    parser.add_argument(
        "--out", help="JSON file to write (default $OUT/score_real_h200.json when OUT is set)"
    )
    args = parser.parse_args()
    unknown = set(args.switches.split(",")) - set(SWITCHED) if args.switches else set()
    if unknown:
        parser.error(f"--switches: {sorted(unknown)} not among {sorted(SWITCHED)}")
    chosen = {k: v for k, v in SWITCHED.items() if not args.switches or k in args.switches.split(",")}

    shape = dict(SMOKE if args.smoke else REAL)
    for key in ("sequences", "length", "subset"):
        if getattr(args, key):
            shape[key] = getattr(args, key)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    dtype = getattr(torch, shape["dtype"])
    B, L, P, bs = shape["sequences"], shape["length"], shape["prompt"], shape["block"]
    out = args.out or (
        os.path.join(os.environ["OUT"], "score_real_h200.json") if os.environ.get("OUT") else None
    )
    record = Record(out)

    def time_left() -> bool:
        return not args.deadline or record.elapsed() < args.deadline

    record.begin("matmul rate")
    rate = matmul_rate(device)
    record.stage(
        "matmul rate",
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        command="PYTHONPATH=src python3 benchmarks/score_real_h200.py " + " ".join(sys.argv[1:]),
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        torch=torch.__version__,
        shape=shape,
        planted_mean=args.planted_mean,
        margin_factor=args.margin_factor,
        positions_per_pass=POSITIONS_PER_PASS,
        matmul_flops_per_s=rate,
    )

    record.begin("models, decisive head, logit noise")
    drafter, head = build_models(shape, device, dtype, args.seed)
    drafter.fuse_projections()
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    features = torch.randn(B, L, N_FEATURES, shape["hidden"], device=device, generator=generator, dtype=dtype)
    ids = torch.randint(0, shape["vocab"] - 1, (B, L), device=device, generator=generator)
    decisive = decisive_head(drafter, head, features, ids, P, args.lead) if args.lead > 0 else {}
    noise = logit_noise(drafter, head, features, ids, P)
    # The drafter's outputs at draft positions, with the decisive head: the rows the Triton head is
    # checked on (later, when the features have left the device).
    probe_rows = probe_states(drafter, head, features, ids, P).to(dtype)
    threshold = max(args.margin_factor * noise, 1e-4)
    if decisive:
        random_gaps = decisive.pop("_random_gaps")
        decisive["random_head_gaps_over_threshold"] = float((random_gaps > threshold).float().mean())
    rows = torch.randn(1024, shape["hidden"], device=device, dtype=dtype)
    head.logits(rows)
    _, head_seconds = timed(lambda: [head.logits(rows) for _ in range(5)], device)
    record.stage(
        "models, decisive head, logit noise",
        decisive_head=decisive,
        logit_noise=noise,
        margin_threshold=threshold,
        head_logits_flops_per_s=5 * 2 * 1024 * shape["hidden"] * shape["vocab"] / head_seconds,
    )

    record.begin("planting")
    planted, plant_seconds = timed(
        lambda: plant_tokens(drafter, head, features, ids, P, args.planted_mean, threshold, args.seed + 2),
        device,
    )
    record.stage(
        "planted",
        plant_seconds=plant_seconds,
        planted_steps=planted.steps,
        planted_tau=B * (L - 1 - P) / planted.steps,
        smallest_planted_margin_in_noise={
            "matches (top-2 gap)": planted.smallest_match_margin / noise if noise else None,
            "mismatches (top over the planted token)": planted.smallest_mismatch_margin / noise
            if noise
            else None,
        },
    )

    record.begin("pinning the features, warm-up")
    # One pinned buffer for all completions, as a loader would fill it; each sequence holds a view.
    host = torch.empty(features.shape, dtype=dtype, pin_memory=device == "cuda")
    host.copy_(features)
    ids_host = ids.cpu()
    sequences = [SequenceInput(f"c{b:04d}", ids_host[b], host[b], P) for b in range(B)]
    features = None
    if device == "cuda":
        torch.cuda.empty_cache()

    def cut(tokens: int) -> list[SequenceInput]:
        return [SequenceInput(s.id, s.input_ids[:tokens], s.features[:tokens], P) for s in sequences]

    # Every completion for a few steps, in both head modes: the shapes the timed runs use.
    for per_pass in (POSITIONS_PER_PASS, bs - 1):
        matching.DEFAULT_POSITIONS_PER_PASS = per_pass
        offline_acceptance(drafter, head, cut(P + 3 * bs))
    sequential_acceptance(drafter, head, cut(P + 3 * bs)[0])
    record.stage("inputs pinned, warm-up")

    record.begin("kernels")
    record.stage("kernels", kernels=choose_kernels(drafter, head, sequences, device, B * POSITIONS_PER_PASS))
    offline_acceptance(drafter, head, cut(P + 3 * bs))

    forwards = count_forwards()

    def engine(per_pass: int, timer: StepTimer | None = None):
        matching.DEFAULT_POSITIONS_PER_PASS = per_pass
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        forwards[:] = [0, 0]
        found, seconds = timed(lambda: offline_acceptance(drafter, head, sequences, timer=timer), device)
        summary = {
            "seconds": seconds,
            "completions_per_s": B / seconds,
            "steps": sum(r.steps for r in found),
            "batched_forwards": forwards[0],
            "blocks_drafted": forwards[1],
        }
        if device == "cuda":
            summary["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return found, summary

    def switched_engine(module, switch: str, value):
        with switched(module, switch, value, drafter):
            return engine(POSITIONS_PER_PASS)

    def alternate(rounds: int, variants: dict, label: str) -> dict:
        """rounds of every variant's run in turn: seconds and median per variant, accept lengths checked."""
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, run in variants.items():
                found, summary = run()
                times[name].append(summary["seconds"])
                key = f"alternated_{label}_{name}_vs_default"
                identical[key] = identical.get(key, True) and same(found, results)
        return {name: {"seconds": t, "median_s": sorted(t)[len(t) // 2]} for name, t in times.items()}

    record.begin("engine")
    runs: dict = {}
    # The process's first run at the full shape meets every batch size, context chunk and kernel
    # specialization for the first time (cuBLAS's heuristics, Triton's variants, the allocator's growth):
    # recorded apart; the engine's figure is the median of the REPEATS runs after it.
    first, runs["first_in_process"] = engine(POSITIONS_PER_PASS)
    head_rows = count_head_rows(head)
    repeated = [engine(POSITIONS_PER_PASS) for _ in range(REPEATS)]
    del head.argmax
    results, runs["where_needed"] = sorted(repeated, key=lambda run: run[1]["seconds"])[REPEATS // 2]
    runs["where_needed"]["seconds_each"] = [summary["seconds"] for _, summary in repeated]
    head_rows[0] //= REPEATS
    real_context = block_attention.KERNEL in block_attention.REAL_CONTEXT_KERNELS
    arithmetic = {
        "engine": flops_per_completion(shape, results, real_context=real_context, positions=head_rows[0]),
        "minimum (up to each first mismatch, real context, mask rows once)": flops_per_completion(
            shape, results, lambda a: min(a, bs - 1), exact=True
        ),
        "all positions": flops_per_completion(shape, results, lambda a: bs - 1, real_context=real_context),
    }
    ceiling = {k: rate / v["total"] if rate else None for k, v in arithmetic.items()}
    measured = runs["where_needed"]["completions_per_s"]
    record.stage(
        "engine",
        tau=overall_tau(results),
        runs=runs,
        flops_per_completion=arithmetic,
        ceiling_completions_per_s=ceiling,
        fraction_of_ceiling=measured / ceiling["engine"] if rate else None,
        fraction_of_each_ceiling={k: measured / c if c else None for k, c in ceiling.items()},
        # What fell back to a slower path in this process (None: nothing), so a figure is read with it.
        fallbacks={
            "flash_unavailable": block_attention.FLASH_UNAVAILABLE,
            "one_pass_attention_failed": block_attention.ONE_PASS_FAILED,
            "block_merge_failed": block_attention.MERGE_FAILED,
            "triton_elementwise_failed": drafter_ops.TRITON_FAILED,
            "trunk_graph_failed": trunk_graph.GRAPH_FAILED,
        },
        identical={
            "planted_accept_lengths": [r.accept_lengths for r in results] == planted.accept_lengths,
            "first_in_process_vs_repeated": all(same(r, results) for r in (first, *(r for r, _ in repeated))),
        },
    )
    identical = record.data["identical"]
    if args.alternate_passes:
        # Head passes of 2, 3 and 4 positions in turn, several rounds: the width measured against the
        # run-to-run spread, with no other variant between them.
        record.begin("engine, pass widths alternated")
        widths = {str(w): partial(engine, w) for w in (2, POSITIONS_PER_PASS, 4)}
        record.stage(
            "engine, pass widths alternated",
            pass_widths_alternated=alternate(args.alternate_passes, widths, "passes"),
        )
    if args.alternate_switches:
        # The defaults and each switch of SWITCHED in turn, several rounds: a run's time drifts over a
        # process (later runs have measured a few percent faster), so a switch is read against the
        # defaults of the same rounds.
        record.begin("engine, switches alternated")
        variants = {"defaults": partial(engine, POSITIONS_PER_PASS)}
        for name, (module, switch, value) in chosen.items():
            if getattr(module, switch) != value:
                variants[name] = partial(switched_engine, module, switch, value)
        record.stage(
            "engine, switches alternated",
            switches_alternated=alternate(args.alternate_switches, variants, "switches"),
        )
    if time_left() and not args.essential:
        # Walks started inside the longest ranges as walks end, or one walk a completion, whichever the
        # engine does not do by default: what splitting saves.
        split_devices = acceptance.SPLIT_DEVICES
        default_split = device in split_devices
        name = "walks_not_split" if default_split else "walks_split"
        record.begin(f"engine, {name}")
        acceptance.SPLIT_DEVICES = () if default_split else (*split_devices, device)
        try:
            other, runs[name] = engine(POSITIONS_PER_PASS)
        finally:
            acceptance.SPLIT_DEVICES = split_devices
        identical[f"{name}_vs_default"] = same(other, results)
        record.stage(f"engine, {name}")
    if args.triton_references:
        from score_triton_check import references_as_kernels

        references_as_kernels()
    triton_ready = args.triton_references or (device == "cuda" and kernels.triton_available())

    if triton_ready and time_left() and not args.essential:
        record.begin("triton head tokens")
        random_rows = torch.randn(B * POSITIONS_PER_PASS, shape["hidden"], device=device, dtype=dtype)
        checks = {
            name: triton_head_tokens(
                head, rows, drafter.output_multiplier, drafter.logit_softcap, args.head_tie_tolerance, device
            )
            for name, rows in (("drafter_outputs", probe_rows), ("random_rows", random_rows))
        }
        identical["triton_head_tokens_on_drafter_outputs"] = checks["drafter_outputs"]["mismatches"] == 0
        identical["triton_head_mismatches_on_random_rows_at_near_ties"] = checks["random_rows"][
            "within_tolerance"
        ]
        record.stage("triton head tokens", triton_head_tokens=checks)
    del probe_rows

    record.begin("sequential oracle")
    subset = sequences[: shape["subset"]]
    oracle, oracle_seconds = timed(lambda: [sequential_acceptance(drafter, head, s) for s in subset], device)
    identical["sequential_vs_engine"] = same(oracle, results)
    record.stage(
        "sequential oracle",
        sequential={
            "completions": len(subset),
            "seconds_per_completion": oracle_seconds / len(subset),
            "tau": overall_tau(oracle),
        },
    )

    if time_left():
        record.begin("engine, timed parts")
        timer = StepTimer(device)
        timed_results, runs["where_needed_timed"] = engine(POSITIONS_PER_PASS, timer)
        parts = timer.seconds()
        identical["timed_vs_untimed"] = same(timed_results, results)
        engine_flops = arithmetic["engine"]
        named = {
            "inputs (the group's set-up: ids, the first chunks queued)": parts.get("inputs", 0.0),
            "context K/V (each chunk's, as the walk reaches it)": parts.get("context", 0.0),
            "drafter layers (all positions, to the last layer's attention)": parts.get("drafter", 0.0),
            "last layer's o_proj, MLP, norm (needed positions)": parts.get("last layer", 0.0),
            "head (needed positions)": parts.get("head", 0.0),
        }
        # The steps hold every part but the inputs: the rest of their time is the walk's own.
        named["walk (steps minus the four above)"] = parts.get("steps", 0.0) - sum(list(named.values())[1:])
        named["total (timed run)"] = runs["where_needed_timed"]["seconds"]
        seconds = {k: max(parts.get(k, 0.0), 1e-9) for k in ("drafter", "last layer", "head")}
        record.stage(
            "engine, timed parts",
            where_the_time_goes_s=named,
            batched_forwards=timer.counts.get("drafter", 0),
            achieved_flops_per_s={
                "drafter layers (with attention)": B
                * (engine_flops["drafter_layers"] + engine_flops["attention"])
                / seconds["drafter"],
                "last layer's rest": B * engine_flops["last_layer_rest"] / seconds["last layer"],
                "head": B * engine_flops["head"] / seconds["head"],
            },
        )

    # Switches of the engine other than their defaults, each alone, on the same inputs: what each saves.
    for name, (module, switch, value) in chosen.items():
        if getattr(module, switch) == value or not time_left():
            continue
        record.begin(f"engine, {name}")
        with switched(module, switch, value, drafter):
            other, runs[name] = engine(POSITIONS_PER_PASS)
        identical[f"{name}_vs_default"] = same(other, results)
        record.stage(f"engine, {name}")
    if time_left() and matching.MIN_ROWS_PER_PASS.get(device):
        # Every pass 3 positions wide, however few blocks it holds: what widening small passes saves.
        record.begin("engine, passes not widened")
        widen = matching.MIN_ROWS_PER_PASS
        matching.MIN_ROWS_PER_PASS = {}
        try:
            narrow, runs["passes_not_widened"] = engine(POSITIONS_PER_PASS)
        finally:
            matching.MIN_ROWS_PER_PASS = widen
        identical["passes_not_widened_vs_widened"] = same(narrow, results)
        record.stage("engine, passes not widened", min_rows_per_pass=widen)
    if time_left():
        # Every feature copied and the whole context computed before the first step, as before the
        # context was streamed (specops.score.streamed_context): what the overlap saves.
        record.begin("engine, context computed before the walk")
        chunk = streamed_context.CHUNK_POSITIONS
        streamed_context.CHUNK_POSITIONS = 1 << 30
        upfront, runs["context_before_the_walk"] = engine(POSITIONS_PER_PASS)
        streamed_context.CHUNK_POSITIONS = chunk
        identical["context_before_the_walk_vs_streamed"] = same(upfront, results)
        record.stage("engine, context computed before the walk")
    if time_left():
        # The first layer's mask rows projected from a strided slice of the blocks, as before 169bdcb:
        # torch's matmul then runs one 2-row product per block.
        record.begin("engine, mask rows from a strided slice")
        with strided_mask_rows():
            strided, runs["mask_rows_strided"] = engine(POSITIONS_PER_PASS)
        identical["mask_rows_strided_vs_contiguous"] = same(strided, results)
        record.stage("engine, mask rows from a strided slice")
    if time_left():
        # The plain attention and one head product over the whole vocabulary: the engine before the
        # fused kernels (with its fused projections and norms), on the same inputs.
        record.begin("engine, reference kernels")
        chosen = (block_attention.KERNEL, target_head.DEFAULT_VOCAB_CHUNK)
        block_attention.KERNEL, target_head.DEFAULT_VOCAB_CHUNK = "reference", None
        plain, runs["reference_kernels"] = engine(POSITIONS_PER_PASS)
        block_attention.KERNEL, target_head.DEFAULT_VOCAB_CHUNK = chosen
        identical["reference_kernels_vs_chosen"] = same(plain, results)
        record.stage("engine, reference kernels")
    # The Triton kernels' switches other than the defaults, on the same inputs; their first calls
    # compile (timed apart). Any failure is recorded and fails the run.
    switches = ((target_head, "ARGMAX_KERNEL"), (drafter_ops, "ELEMENTWISE"), (block_attention, "BLOCK_KEYS"))
    defaults = tuple(getattr(module, name) for module, name in switches)
    triton_variants = {
        "triton_head": ("triton", defaults[1], defaults[2]),
        "no_triton": ("torch", "eager", "in_context"),
    }
    for name, values in triton_variants.items():
        if values == defaults:
            continue
        if not (triton_ready and time_left()):
            runs.setdefault(
                name, {"skipped": "no CUDA device or no triton" if not triton_ready else "deadline"}
            )
            continue
        record.begin(f"engine, {name}")
        for (module, switch), value in zip(switches, values, strict=True):
            setattr(module, switch, value)
        try:
            _, compile_seconds = timed(
                lambda: (
                    warm_triton(head, shape["hidden"], device),
                    offline_acceptance(drafter, head, cut(P + 3 * bs)),
                ),
                device,
            )
            variant, runs[name] = engine(POSITIONS_PER_PASS)
            runs[name]["first_calls_with_compilation_s"] = compile_seconds
            identical[f"{name}_vs_default"] = same(variant, results)
        except Exception as error:  # noqa: BLE001 (recorded, and the run fails)
            runs[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            identical[f"{name}_vs_default"] = False
        finally:
            for (module, switch), value in zip(switches, defaults, strict=True):
                setattr(module, switch, value)
        record.stage(f"engine, {name}")
    if time_left():
        record.begin("engine, head over all positions")
        full_head, runs["all_positions"] = engine(bs - 1)
        identical["all_positions_vs_where_needed"] = same(full_head, results)
        record.stage("engine, head over all positions")
    # Smaller passes stop sooner after each first mismatch but take one more pass (and host sync) a step;
    # larger ones the other way round.
    for width, word in ((2, "two"), (4, "four")):
        if not time_left():
            break
        record.begin(f"engine, {width} positions per pass")
        other, runs[f"{word}_per_pass"] = engine(width)
        identical[f"{word}_per_pass_vs_three"] = same(other, results)
        record.stage(
            f"engine, {width} positions per pass",
            **{
                f"flops_per_completion_{word}_per_pass": flops_per_completion(
                    shape,
                    results,
                    lambda a, w=width: min(-(-a // w) * w, bs - 1),
                    real_context=real_context,
                )
            },
        )
    matching.DEFAULT_POSITIONS_PER_PASS = POSITIONS_PER_PASS

    if args.profile_tokens and time_left():
        record.begin("kernel profile")
        record.stage(
            "kernel profile",
            kernel_profile={
                "tokens_per_completion": args.profile_tokens,
                "kernels": kernel_profile(drafter, head, cut(P + args.profile_tokens)),
            },
        )
    if rate:
        for summary in runs.values():
            if "completions_per_s" in summary:
                summary["fraction_of_engine_ceiling"] = summary["completions_per_s"] / ceiling["engine"]
    record.stage("done", ok=all(identical.values()))
    print(json.dumps(record.data, indent=2))
    if not record.data["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
