"""Where the scoring runs, chosen before the window: `python -m specops.placement --plan|--run`.

  window  inside the window, right after the extraction, on the device the extraction freed: its
          planned time is added to the window's and must fit the operator's downtime budget;
  host    after the window on a scoring host named in the inventory (a machine with a GPU): the hidden
          states and what the scoring reads are shipped there with their checksums, verified on arrival,
          scored, and the report brought back (shipping.py, playbooks/tasks/score_on_host.yml);
  cpu     after the window on the host's CPU, its share and priority bounded (cpu_scope);
  auto    window where the extraction plus the scoring fit the budget, else the scoring host where one is
          named, else cpu (with a warning giving its expected duration where that is long).

The scoring's time is estimated from the shapes, before anything is loaded: each pass reads every
completion token once through the drafter and the target's head, so

    seconds = passes x tokens x 2 x (drafter parameters + head parameters) / throughput

plus what every scoring process pays before its first pass, whatever the number of completions: its
start (interpreter, torch, the device's context, the report and its plots after) and reading the
target's embedding and head and every drafter's weights onto the device (load_seconds)

(the engine's exact count depends on tau and the block; benchmarks/score_real_h200.json measures 11.3
TFLOP per completion of 1,000 tokens at the real shape, where this formula gives 6.4: the throughput
below is stated in this formula's FLOPs, so the two agree there). On a GPU the throughput is the
documented GPU_FLOPS; on the CPU it is measured on this host with the bounded thread count (a float32
product with numpy, its threads held by OMP_NUM_THREADS), times CPU_EFFICIENCY.

Request: {placement, device (the extraction's), window (whether one is taken), target, drafters: [...],
reference_drafter, completions, diagnostics, extraction_seconds, budget_seconds (0: none), threads,
scoring_host (an inventory name, or empty), scoring_device (the scoring host's, default cuda)}.
Result: {placement, why, device, host, window_seconds, host_seconds, cpu_seconds, warning, estimate: {...}}.
"""

from __future__ import annotations

import json
import math
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from specops.stage import StageError, serve

STAGE = "placement"
PLACEMENTS = ("auto", "window", "host", "cpu")
# One H200 scored 26.3 completions/s of 1,000 tokens at the real shape on 2026-12-04, 47.4/s on
# 2026-12-06 (benchmarks/score_real_h200_2026-12-06_38c49d0.json) and 53.1/s on 2026-12-07
# (benchmarks/score_real_h200.json), 6.4 TFLOP each by the formula above: about 1.7e14, 3.0e14 and
# 3.4e14 of its FLOPs per second. Other GPUs are slower; the figure is a planning figure kept at the
# lower rate, and the guard's margin covers a miss.
GPU_FLOPS = 1.5e14
# A pass is not all matrix products (the walk, the softmax, the bookkeeping): the measured product rate
# is halved, a planning discount (not a measurement) that errs towards a longer estimate.
CPU_EFFICIENCY = 0.5
# Passes only the layer-offset diagnostic needs (target layers shifted by -1 and +1), per drafter.
LAYER_OFFSET_PASSES = 2
# What a scoring process costs besides its passes, planning figures from the H100 rehearsal of
# 2026-12-05 (benchmarks/eval_h100_2026-12-05_evening.json: 8 short completions scored in the window in
# 26 s, nearly all of it the start and 11.2 GiB of head and drafters read and moved to the device; the
# FLOP term alone said 0.0 s): a fixed start, and seconds per GiB of weights read.
STARTUP_SECONDS = 8.0
LOAD_SECONDS_PER_GIB = 1.6
# A CPU scoring longer than this is warned about before the window.
LONG_CPU_SECONDS = 600


def _tensor_headers(directory: Path) -> Iterator[dict[str, Any]]:
    """Each tensor's header entry (dtype, shape, data_offsets) in a checkpoint's safetensors files."""
    for file in sorted(directory.glob("*.safetensors")):
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        yield from (entry for name, entry in header.items() if name != "__metadata__")


def safetensors_parameters(directory: Path) -> int:
    """The number of parameters in a checkpoint's safetensors files, from their headers only."""
    return sum(math.prod(t["shape"]) for t in _tensor_headers(directory))


def safetensors_bytes(directory: Path) -> int:
    """The bytes of a checkpoint's tensors, from their safetensors headers."""
    return sum(t["data_offsets"][1] - t["data_offsets"][0] for t in _tensor_headers(directory))


def head_parameters(target: Path) -> int:
    """The target head's parameters: vocabulary x hidden size (the lm_head the scoring multiplies by)."""
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config") or config
    try:
        return int(text["vocab_size"]) * int(text["hidden_size"])
    except KeyError as error:
        raise StageError(
            f"{target}/config.json has no {error}: is it the target model's directory?"
        ) from None


def completion_tokens(completions: Path) -> int:
    """Every completion's tokens, from the prefetch's output."""
    path = completions / "completions.jsonl"
    if not path.is_file():
        raise StageError(
            f"{path} does not exist: the prefetch stage writes it before the placement is chosen"
        )
    tokens = 0
    for line in path.read_text().splitlines():
        if line.strip():
            tokens += len(json.loads(line).get("output_ids") or [])
    return tokens


def cpu_flops(size: int = 384, repeats: int = 5) -> float:
    """float32 matrix-product FLOP/s on this host, with the threads the environment bounds
    (OMP_NUM_THREADS / OPENBLAS_NUM_THREADS, set by the play to the scoring's thread count). numpy,
    not torch: quick to import, and the same BLAS-style kernel a pass spends its time in."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    elapsed = time.perf_counter() - start
    return 2 * size**3 * repeats / max(elapsed, 1e-9)


def passes(n_drafters: int, reference: bool, diagnostics: Sequence[str]) -> dict[str, int]:
    """Passes inside the window (the drafters' and the reference's) and those only diagnostics need."""
    return {
        "scores": n_drafters + (1 if reference else 0),
        "layer_offset": LAYER_OFFSET_PASSES * n_drafters if "layer_offset" in diagnostics else 0,
    }


def _s(seconds: float) -> str:
    """Seconds as a plan states them: whole above 10, one decimal below (a tiny model's scoring)."""
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.1f}"


def choose(
    placement: str,
    window_seconds: float,
    extraction_seconds: float,
    budget_seconds: float,
    window_taken: bool = True,
    scoring_host: str = "",
) -> tuple[str, str]:
    """(where, why): the rule that chose it, in words. A forced window that cannot fit, and a forced
    scoring host that is not named, are refused."""
    if placement == "host":
        if not scoring_host:
            raise StageError(
                "specops_score_placement is host but no scoring host is named: set specops_scoring_host to "
                "an inventory host with a GPU, or choose auto, window or cpu"
            )
        return "host", f"forced: specops_score_placement is host ({scoring_host})"
    if not window_taken and placement != "cpu":
        if scoring_host:
            return "host", (
                "no window is taken (the hidden states are up to date); "
                f"the scoring host {scoring_host} is named"
            )
        return "cpu", "no window is taken (the hidden states are up to date), so it scores on the bounded CPU"
    planned = extraction_seconds + window_seconds
    fits = budget_seconds <= 0 or planned <= budget_seconds
    budget = (
        f"the downtime budget of {budget_seconds:.0f} s"
        if budget_seconds > 0
        else "any downtime (no budget: sglang_service_max_downtime is 0 or the guard is off)"
    )
    sums = f"extraction {_s(extraction_seconds)} s + scoring {_s(window_seconds)} s = {_s(planned)} s"
    if placement == "cpu":
        return "cpu", "forced: specops_score_placement is cpu"
    if placement == "window":
        if not fits:
            raise StageError(
                f"scoring in the window does not fit {budget}: {sums}; raise sglang_service_max_downtime, "
                "score fewer prompts, or set specops_score_placement to cpu or auto"
            )
        return "window", f"forced: specops_score_placement is window ({sums}, within {budget})"
    if fits:
        return "window", f"auto: the window with scoring fits {budget} ({sums})"
    if scoring_host:
        return "host", (
            f"auto: the window with scoring would not fit {budget} ({sums}), so it scores on {scoring_host}"
        )
    return (
        "cpu",
        f"auto: the window with scoring would not fit {budget} ({sums}) and no scoring host is named "
        "(specops_scoring_host), so it scores on the bounded CPU",
    )


def _paths(request: Mapping[str, Any]) -> tuple[Path, list[Path], Path | None, Path]:
    try:
        target = Path(request["target"])
        drafters = [Path(p) for p in request["drafters"]]
        completions = Path(request["completions"])
    except KeyError as error:
        raise StageError(f"the placement request needs {error}") from None
    reference = Path(request["reference_drafter"]) if request.get("reference_drafter") else None
    return target, drafters, reference, completions


def plan(request: Mapping[str, Any]) -> dict[str, Any]:
    placement = str(request.get("placement") or "auto")
    if placement not in PLACEMENTS:
        raise StageError(f"specops_score_placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    target, drafters, reference, completions = _paths(request)
    tokens = completion_tokens(completions)
    head = head_parameters(target)
    params = [safetensors_parameters(p) for p in drafters]
    reference_params = safetensors_parameters(reference) if reference else 0
    counted = passes(len(drafters), reference is not None, list(request.get("diagnostics") or []))
    # Each pass: tokens x 2 x (its drafter's + the head's parameters).
    score_flops = sum(2 * tokens * (p + head) for p in params) + (
        2 * tokens * (reference_params + head) if reference else 0
    )
    offset_flops = (
        LAYER_OFFSET_PASSES * sum(2 * tokens * (p + head) for p in params) if counted["layer_offset"] else 0
    )
    # The embedding and the head, in 16 bits as checkpoints store them, and every drafter's weights.
    load_bytes = 2 * 2 * head + sum(safetensors_bytes(p) for p in drafters)
    load_bytes += safetensors_bytes(reference) if reference else 0
    load_seconds = STARTUP_SECONDS + LOAD_SECONDS_PER_GIB * load_bytes / 2**30
    device = str(request.get("device") or "cpu")
    threads = int(request.get("threads") or 1)
    cpu_rate = cpu_flops() * CPU_EFFICIENCY
    window_rate, window_source = (
        (GPU_FLOPS, f"documented {GPU_FLOPS:.1e} FLOP/s per GPU (benchmarks/score_real_h200.json)")
        if device.startswith("cuda")
        else (cpu_rate, f"measured on this host with {threads} thread(s), x{CPU_EFFICIENCY}")
    )
    window_seconds = load_seconds + score_flops / window_rate
    cpu_seconds = load_seconds + (score_flops + offset_flops) / cpu_rate
    scoring_host = str(request.get("scoring_host") or "")
    scoring_device = str(request.get("scoring_device") or "cuda")
    # The scoring host's own rate is not measured from here: a GPU's documented one, this host's CPU else.
    host_rate = GPU_FLOPS if scoring_device.startswith("cuda") else cpu_rate
    where, why = choose(
        placement,
        window_seconds,
        float(request.get("extraction_seconds") or 0),
        float(request.get("budget_seconds") or 0),
        window_taken=bool(request.get("window", True)),
        scoring_host=scoring_host,
    )
    offsets_after = load_seconds + offset_flops / cpu_rate if offset_flops else 0.0
    after = {"window": offsets_after, "host": 0.0}.get(where, cpu_seconds)
    warning = None
    if after > LONG_CPU_SECONDS:
        warning = (
            f"scoring on the bounded CPU is expected to take {after / 60:.0f} min "
            f"({'layer-offset diagnostics' if where == 'window' else 'every pass'}, {threads} thread(s))"
        )
    return {
        "changed": False,
        "placement": where,
        "why": why,
        "window_seconds": round(window_seconds, 1) if where == "window" else 0.0,
        "host_seconds": round(load_seconds + (score_flops + offset_flops) / host_rate, 1)
        if where == "host"
        else 0.0,
        "cpu_seconds": round(after, 1),
        "warning": warning,
        "device": {"window": device, "host": scoring_device}.get(where, "cpu"),
        "host": scoring_host if where == "host" else "",
        "estimate": {
            "tokens": tokens,
            "passes": counted,
            "head_parameters": head,
            "drafter_parameters": params,
            "reference_parameters": reference_params,
            "score_flops": score_flops,
            "layer_offset_flops": offset_flops,
            "load_bytes": load_bytes,
            "load_seconds": round(load_seconds, 1),
            "window_device": device,
            "window_throughput": window_rate,
            "window_throughput_source": window_source,
            "cpu_throughput": cpu_rate,
            "cpu_threads": threads,
        },
    }


def record(placement: Mapping[str, Any] | None, seconds: float, bounds: Mapping[str, Any]) -> dict[str, Any]:
    """The report's placement: where and why (as the play said), how long the scoring took, the bounds
    the stage observed."""
    placed = dict(placement or {})
    return {
        "where": placed.get("where", "not placed by the play"),
        "why": placed.get("why", "the score stage was run on its own"),
        "estimated_seconds": placed.get("estimated_seconds"),
        "seconds": round(seconds, 3),
        "bounds": dict(bounds),
        **{
            k: v for k, v in placed.items() if k not in ("where", "why", "estimated_seconds", "finished_file")
        },
    }


def render_markdown(placement: Mapping[str, Any] | None) -> str:
    """The report's section: where scoring ran, why, how long, and the bounds it observed."""
    if not placement:
        return ""
    lines = ["", "## Where scoring ran", ""]
    lines.append(f"- placement: **{placement.get('where', '?')}** ({placement.get('why', 'not said')})")
    if placement.get("host"):
        lines.append(
            f"- scored on **{placement['host']}** ({placement.get('device', '?')}); the hidden states were "
            "shipped with their checksums and verified there before scoring"
        )
    if placement.get("seconds") is not None:
        estimated = placement.get("estimated_seconds")
        lines.append(
            f"- the score stage took {placement['seconds']:.1f} s"
            + (f" (estimated {estimated:.1f} s before the window)" if estimated is not None else "")
        )
    bounds = placement.get("bounds")
    if bounds:
        lines.append(
            f"- bounds observed: nice {bounds.get('nice')}, "
            f"cpu.max {bounds.get('cpu_max') or 'not readable'}, "
            f"{bounds.get('threads')} torch thread(s)"
        )
    after = placement.get("after_window")
    if after:
        lines.append(
            f"- after the window, on the CPU: the layer-offset diagnostics took {after['seconds']:.1f} s"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    return serve(STAGE, plan, plan)


if __name__ == "__main__":
    raise SystemExit(main())
