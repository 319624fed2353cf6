"""Where a scoring step's time goes on the GPU at the real drafter's shape: kernels by kind, the GPU's
idle time between them, and what candidate changes would save, measured side by side.

    PYTHONPATH=src python3 benchmarks/score_step_profile.py --out $OUT/score_step_profile.json
    PYTHONPATH=src python3 benchmarks/score_step_profile.py --smoke     # CPU: tiny shapes, the same code
    PYTHONPATH=src python3 benchmarks/score_step_profile.py --products-only   # the products' rates alone

The models, features and planted tokens are those of score_real_h200.py (tau ~6), on completions cut to
--tokens output tokens so that the trace stays small. Recorded:
  - the engine's seconds on the cut completions, untraced;
  - a torch.profiler trace of the same run: device time per kernel kind (matrix products, attention,
    norms, elementwise, reductions, indexing, copies), the GPU's busy time (the union of its kernels)
    against the run's wall time, the idle gaps, and the host's time waiting in synchronizations;
  - the device time inside each of the engine's named parts (StepTimer's spans);
  - each of the drafter's products and the head's at the frontier's row counts, in FLOP/s; each drafter
    product also with its weight stored transposed and through cuBLASLt, and the head's product without
    its argmax and with logits in the weights' dtype (alone and with each row's maximum);
  - the drafter's trunk at the full batch, eager (its kernels traced) and replayed from a CUDA graph
    (what kernel launches cost it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
from score_h200 import build_models, logit_noise, plant_tokens, timed
from score_real_h200 import N_FEATURES, REAL, SMOKE, decisive_head, matmul_rate

import specops.score.acceptance as acceptance
import specops.score.block_attention as block_attention
from specops.score.acceptance import SequenceGroup, SequenceInput, offline_acceptance
from specops.score.step_timer import StepTimer
from specops.score.target_head import _fp32_linear

KINDS = (
    ("matrix products", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|ampere_|cublas", re.I)),
    ("attention", re.compile(r"flash|fmha|attention", re.I)),
    ("norms", re.compile(r"layer_norm|rms", re.I)),
    ("reductions", re.compile(r"reduce|argmax|cumprod|scan", re.I)),
    ("indexing", re.compile(r"index|gather|scatter", re.I)),
    ("copies", re.compile(r"copy|memcpy|memset|cat", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized", re.I)),
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


class AnnotatedTimer(StepTimer):
    """StepTimer whose spans are also profiler ranges, so the trace tells each part's device time."""

    @contextmanager
    def span(self, name: str):
        with torch.profiler.record_function(f"part:{name}"), super().span(name):
            yield


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def trace_summary(trace_file: str) -> dict:
    """Kernel time by kind, busy against wall, idle gaps, host synchronization, device time per part."""
    events = json.loads(Path(trace_file).read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return {"kernels": 0}
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    first, last = spans[0][0], max(stop for _, stop in spans)
    busy = union_length(spans)
    gaps, end = [], spans[0][1]
    for start, stop in spans[1:]:
        if start > end:
            gaps.append(start - end)
        end = max(end, stop)
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_kind[kind_of(e["name"])] += e["dur"]
        by_name[e["name"][:100]][0] += 1
        by_name[e["name"][:100]][1] += e["dur"]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    causes = gap_causes(events, kernels, runtime)
    syncs = [e for e in runtime if re.search(r"Synchronize|MemcpyAsync|Memcpy", e["name"])]
    launches = [e for e in runtime if "LaunchKernel" in e["name"] or "cuLaunch" in e["name"]]
    parts: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "gpu_user_annotation" and e["name"].startswith("part:"):
            parts[e["name"][5:]] += e["dur"]
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:25]
    return {
        "kernels": len(kernels),
        "wall_ms": (last - first) / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "gpu_busy_fraction": busy / (last - first),
        "idle_gaps": {
            "count": len(gaps),
            "total_ms": sum(gaps) / 1e3,
            "over_20us_count": sum(g > 20 for g in gaps),
            "over_20us_ms": sum(g for g in gaps if g > 20) / 1e3,
            "over_200us_ms": sum(g for g in gaps if g > 200) / 1e3,
            "causes_over_20us": causes,
        },
        "device_ms_by_kind": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "host_in_syncs_and_copies_ms": sum(e["dur"] for e in syncs) / 1e3,
        "host_syncs_and_copies": len(syncs),
        "launches": len(launches),
        "host_ms_per_launch": sum(e["dur"] for e in launches) / max(1, len(launches)) / 1e3,
        "device_ms_in_parts": {k: v / 1e3 for k, v in parts.items()},
        "top_kernels": [{"name": n, "calls": c, "ms": t / 1e3} for n, (c, t) in top],
    }


def gap_causes(events: list, kernels: list, runtime: list, threshold_us: float = 20, top: int = 20) -> list:
    """The GPU's idle gaps over threshold_us, by what ended them: the engine's part (StepTimer span) and the
    torch op that launched the next kernel, and whether the host had just waited for the device (a
    synchronization or copy returned inside the gap: the host then launched from nothing)."""
    import bisect

    op_of = {
        e["args"]["External id"]: e["name"]
        for e in events
        if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})
    }
    launch_of = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    parts = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][5:])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("part:")
    )
    waits = sorted(
        e["ts"] + e["dur"] for e in runtime if re.search(r"Synchronize|Memcpy", e["name"]) and e["dur"] > 5
    )
    found: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])
    ordered = sorted(kernels, key=lambda e: e["ts"])
    end = ordered[0]["ts"] + ordered[0]["dur"]
    for kernel in ordered[1:]:
        gap = kernel["ts"] - end
        end = max(end, kernel["ts"] + kernel["dur"])
        if gap <= threshold_us:
            continue
        args = kernel.get("args", {})
        launch = launch_of.get(args.get("correlation"))
        launched = launch["ts"] if launch else kernel["ts"]
        # The innermost part open at the launch (parts nest: 'drafter' inside 'steps').
        part = next((name for first, last, name in reversed(parts) if first <= launched <= last), "-")
        waited = bisect.bisect_left(waits, kernel["ts"] - gap) < bisect.bisect_right(waits, launched)
        key = (part, op_of.get(args.get("External id"), kernel["name"][:40]), waited)
        found[key][0] += 1
        found[key][1] += gap
    ranked = sorted(found.items(), key=lambda item: -item[1][1])[:top]
    return [
        {"part": part, "op": op, "after_a_wait": waited, "count": count, "ms": total / 1e3}
        for (part, op, waited), (count, total) in ranked
    ]


def traced(work, device: str) -> dict:
    """trace_summary of one call of work under torch.profiler (the kernels of a few forwards)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        work()
        if device == "cuda":
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as scratch:
        trace = os.path.join(scratch, "trace.json")
        prof.export_chrome_trace(trace)
        return trace_summary(trace)


def product_rates(shape: dict, drafter, head, device: str, rows: tuple[int, ...]) -> dict:
    """FLOP/s of each of the drafter's products and the head's at the given row counts."""
    layer = drafter.decoder_layers[0]
    weights = {
        "qkv": layer.self_attn._qkv[0] if layer.self_attn._qkv else layer.self_attn.q_proj.weight,
        "o_proj": layer.self_attn.o_proj.weight,
        "gate_up": layer._gate_up[0] if layer._gate_up else layer.mlp.gate_proj.weight,
        "down": layer.mlp.down_proj.weight,
    }
    found: dict = {}
    for name, weight in weights.items():
        for m in rows:
            x = torch.randn(m, weight.shape[1], device=device, dtype=weight.dtype)
            for _ in range(3):
                x @ weight.T
            _, seconds = timed(lambda x=x, weight=weight: [x @ weight.T for _ in range(20)], device)
            flops = 2 * m * weight.shape[0] * weight.shape[1]
            found[f"{name} M={m}"] = {"ms": seconds / 20 * 1e3, "tflop_per_s": 20 * flops / seconds / 1e12}
        # The same product with the weight stored transposed (cuBLAS picks its kernels by layout too): at
        # the full batch only, to tell whether a layout would bring a product nearer the matrix rate.
        m, transposed = rows[0], weight.T.contiguous()
        x = torch.randn(m, weight.shape[1], device=device, dtype=weight.dtype)
        for _ in range(3):
            x @ transposed
        _, seconds = timed(lambda x=x, w=transposed: [x @ w for _ in range(20)], device)
        flops = 2 * m * weight.shape[0] * weight.shape[1]
        found[f"{name} M={m} weight transposed"] = {
            "ms": seconds / 20 * 1e3,
            "tflop_per_s": 20 * flops / seconds / 1e12,
        }
        del transposed
        # The same product through cuBLASLt's heuristic instead of cuBLAS's (torch's preferred library).
        if device == "cuda":
            previous = torch.backends.cuda.preferred_blas_library()
            try:
                torch.backends.cuda.preferred_blas_library("cublaslt")
                for _ in range(3):
                    x @ weight.T
                _, seconds = timed(lambda x=x, weight=weight: [x @ weight.T for _ in range(20)], device)
                found[f"{name} M={m} cublaslt"] = {
                    "ms": seconds / 20 * 1e3,
                    "tflop_per_s": 20 * flops / seconds / 1e12,
                }
            finally:
                torch.backends.cuda.preferred_blas_library(previous)
    for m in (768, 558, 349, 140, 48):
        x = torch.randn(m, shape["hidden"], device=device, dtype=head.dtype)
        # The product alone (float32 logits), to tell the argmax's share of a pass.
        _fp32_linear(x, head.lm_head_weight)
        _, seconds = timed(lambda x=x: [_fp32_linear(x, head.lm_head_weight) for _ in range(10)], device)
        found[f"head product rows={m}"] = {"ms": seconds / 10 * 1e3}
        # The same product with logits in the weights' dtype, alone and with each row's maximum: what a head
        # that took its argmax from rounded logits (and settled their ties apart) would start from.
        weight = head.lm_head_weight
        (x @ weight.T).max(dim=-1)
        _, seconds = timed(lambda x=x, w=weight: [x @ w.T for _ in range(10)], device)
        found[f"head product rows={m} rounded logits"] = {"ms": seconds / 10 * 1e3}
        _, seconds = timed(lambda x=x, w=weight: [(x @ w.T).max(dim=-1) for _ in range(10)], device)
        found[f"head product and maximum rows={m} rounded logits"] = {"ms": seconds / 10 * 1e3}
        head.argmax(x)
        _, seconds = timed(lambda x=x: [head.argmax(x) for _ in range(10)], device)
        flops = 2 * m * shape["hidden"] * shape["vocab"]
        found[f"head argmax rows={m}"] = {
            "ms": seconds / 10 * 1e3,
            "tflop_per_s": 10 * flops / seconds / 1e12,
        }
    return found


def trunk_eager_and_graphed(drafter, head, sequences, device: str, start: int) -> dict:
    """The trunk over the whole batch at one block a sequence, eager and from a CUDA graph."""
    group = SequenceGroup(drafter, head, sequences)
    B = len(sequences)
    starts = torch.full((B, 1), start, device=device) + torch.arange(B, device=device)[:, None] % 64
    group.context.ensure(group.context_len)
    anchors = group.ids.gather(1, starts).clamp_min(0)

    def trunk():
        embeds = drafter.block_embeddings(head.embed, anchors)
        return drafter.trunk(embeds, starts, group.context.buffers, group.context_len, mask_rows_alike=True)

    for _ in range(3):
        trunk()
    _, eager = timed(lambda: [trunk() for _ in range(10)], device)
    found = {"batch": B, "start": start, "eager_ms": eager / 10 * 1e3}
    found["traced_10"] = traced(lambda: [trunk() for _ in range(10)], device)
    if device != "cuda":
        return found
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                trunk()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            trunk()
        graph.replay()
        _, replayed = timed(lambda: [graph.replay() for _ in range(10)], device)
        found["graph_ms"] = replayed / 10 * 1e3
    except Exception as error:  # noqa: BLE001 (recorded: the graph is a measurement, not a result)
        found["graph_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    return found


@torch.inference_mode()
def inputs_probe(drafter, sequences, device: str) -> dict:
    """What the engine's inputs cost: the features' copy to the device (from pinned memory, one chunk of
    streamed_context.CHUNK_POSITIONS positions and all of it), one chunk's context K/V, and the group's
    setup (StreamedContext: buffers, the first chunks' copies queued) until the first chunk is copied (and
    its K/V computed, where they are computed ahead), when the walk's first step can start."""
    from specops.score.streamed_context import CHUNK_POSITIONS, StreamedContext

    features = [s.features for s in sequences]
    positions = min(CHUNK_POSITIONS, features[0].shape[0])
    shape = (len(features), positions, *features[0].shape[1:])
    chunk = torch.empty(shape, dtype=features[0].dtype, device=device)

    def copy() -> None:
        for b, f in enumerate(features):
            chunk[b].copy_(f[:positions], non_blocking=True)

    copy()
    _, seconds = timed(copy, device)
    found = {"chunk_positions": positions, "chunk_gb": chunk.numel() * chunk.element_size() / 1e9}
    found["copy_gb_per_s"] = found["chunk_gb"] / seconds
    drafter.context_kv(chunk)
    _, seconds = timed(lambda: drafter.context_kv(chunk), device)
    found["context_kv_ms_per_chunk"] = seconds * 1e3
    length = max(f.shape[0] for f in features)

    def setup() -> None:
        context = StreamedContext(drafter, features, length, torch.device(device))
        # Copied, and its K/V computed where they are computed ahead (streamed_context.KV_AHEAD_DEVICES).
        if context.chunks[0].done is not None:
            context.chunks[0].done.synchronize()
        context.release()

    setup()
    started = time.perf_counter()
    setup()
    found["setup_and_first_chunk_s"] = time.perf_counter() - started
    found["all_features_gb"] = sum(f.numel() * f.element_size() for f in features) / 1e9
    if device == "cuda":
        torch.cuda.empty_cache()
    return found


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU in fp32")
    parser.add_argument("--tokens", type=int, default=448, help="output tokens per completion traced")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--walks-split",
        action="store_true",
        help="split walks on this device whatever acceptance.SPLIT_DEVICES says",
    )
    parser.add_argument(
        "--products-only", action="store_true", help="only the products' rates (no planting, trace or trunk)"
    )
    parser.add_argument("--out", help="JSON file to write (default $OUT/score_step_profile.json)")
    args = parser.parse_args()
    shape = dict(SMOKE if args.smoke else REAL)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    dtype = getattr(torch, shape["dtype"])
    B, P = shape["sequences"], shape["prompt"]
    L = min(shape["length"], P + 1 + args.tokens)
    if args.walks_split:
        acceptance.SPLIT_DEVICES = (*acceptance.SPLIT_DEVICES, device)
    out = args.out or (
        os.path.join(os.environ["OUT"], "score_step_profile.json") if os.environ.get("OUT") else None
    )
    record: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "PYTHONPATH=src python3 benchmarks/score_step_profile.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {**shape, "length": L},
        "attention_kernel": block_attention.KERNEL,
        "walks_split": device in acceptance.SPLIT_DEVICES,
    }

    def save() -> None:
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"[{time.strftime('%H:%M:%S')}] saved", file=sys.stderr, flush=True)

    record["matmul_tflop_per_s"] = (matmul_rate(device) or 0) / 1e12
    drafter, head = build_models(shape, device, dtype, args.seed)
    drafter.fuse_projections()
    rows = (B * shape["block"], B * shape["block"] // 2, B * 3)
    if args.products_only:
        record["products"] = product_rates(shape, drafter, head, device, rows)
        save()
        print(json.dumps(record, indent=2))
        return
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    features = torch.randn(B, L, N_FEATURES, shape["hidden"], device=device, generator=generator, dtype=dtype)
    ids = torch.randint(0, shape["vocab"] - 1, (B, L), device=device, generator=generator)
    decisive_head(drafter, head, features, ids, P, 8.0)
    threshold = max(4.0 * logit_noise(drafter, head, features, ids, P), 1e-4)
    plant_tokens(drafter, head, features, ids, P, 5, threshold, args.seed + 2)
    host = torch.empty(features.shape, dtype=dtype, pin_memory=device == "cuda")
    host.copy_(features)
    ids_host = ids.cpu()
    sequences = [SequenceInput(f"c{b:04d}", ids_host[b], host[b], P) for b in range(B)]
    del features
    if device == "cuda":
        torch.cuda.empty_cache()
    offline_acceptance(drafter, head, sequences)  # warm-up: every batch size the run meets
    results, seconds = timed(lambda: offline_acceptance(drafter, head, sequences), device)
    steps = sum(r.steps for r in results)
    record["untraced"] = {"seconds": seconds, "steps": steps, "tau": B * (L - 1 - P) / steps}
    save()

    timer = AnnotatedTimer(device)
    walked: list = []
    record["trace"] = traced(
        lambda: walked.extend(offline_acceptance(drafter, head, sequences, timer=timer)), device
    )
    record["trace"]["timer_parts_s"] = timer.seconds()
    record["trace"]["batched_forwards"] = timer.counts.get("drafter", 0)
    record["trace"]["same_as_untraced"] = [r.accept_lengths for r in walked] == [
        r.accept_lengths for r in results
    ]
    save()

    record["inputs"] = inputs_probe(drafter, sequences, device)
    save()
    record["products"] = product_rates(shape, drafter, head, device, rows)
    save()
    record["trunk"] = trunk_eager_and_graphed(drafter, head, sequences, device, start=(P + L) // 2)
    save()
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
