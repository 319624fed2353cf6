"""Work moved out of the service window: done while the server still serves, so the window holds less.

Two parts, each timed and reported:
- read_weights: the target's safetensors files are read once, so the extraction's load inside the
  window finds them in the page cache instead of on disk (skipped when they would not fit in the
  host memory that is available).
- tune_kernels: fla's triton kernels are compiled and autotuned for the extraction's planned batch
  shapes, in a model built from the target's config with one layer of each kind and random weights
  (a few GB at most, beside the server). fla asks triton to keep autotuning results on disk
  (FLA_CACHE_RESULTS, default on) and triton keeps compiled kernels there too: with TRITON_CACHE_DIR
  on persistent storage, the extraction in the window (and every later run) finds both. The kernels'
  autotuning keys are head counts, head dims and chunk sizes, not the sequence length, so a model with
  the target's layer shapes tunes the same configurations; every distinct batch shape is still run
  once, because triton specialises compiled kernels on the integer arguments.

python -m specops.prewarm --plan|--run, JSON request on stdin: `REQUEST` below.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specops.extract import (
    LayerCapture,
    Record,
    inspect_target,
    pad_batch,
    plan_shards,
    read_completions,
    resolve_device_dtype,
)
from specops.extract.request import REQUEST as EXTRACT_REQUEST
from specops.schema import Option, Schema
from specops.stage import log, serve

# The batching options are the extraction's own, so the shapes tuned are the ones it runs.
REQUEST = Schema(
    "prewarm",
    (
        *(
            EXTRACT_REQUEST.option(name)
            for name in ("target", "completions", "batch_tokens", "shard_tokens", "dtype", "device")
        ),
        Option("read_weights", "bool", "Read the target's weights into the page cache.", default=True),
        Option(
            "tune_kernels",
            "bool",
            "Compile and autotune fla's kernels for the planned batch shapes.",
            default=True,
        ),
        Option("max_shapes", "int", "Most distinct batch shapes to tune.", default=64),
    ),
)
READ_CHUNK = 64 << 20
# Leave this share of the available memory to everything else on the host.
PAGE_CACHE_SHARE = 0.8


def parse_request(request: dict[str, Any]) -> dict[str, Any]:
    return REQUEST.merged(request, "give the target model dir and the completions dir")


def weight_files(target: Path) -> list[Path]:
    return sorted(target.glob("*.safetensors"))


def available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def read_into_page_cache(files: Sequence[Path]) -> dict[str, Any]:
    """Read every file once, sequentially; what the kernel keeps is what the next reader finds."""
    total = sum(f.stat().st_size for f in files)
    available = available_memory_bytes()
    if available is not None and total > available * PAGE_CACHE_SHARE:
        reason = (
            f"{total / 2**30:.1f} GiB of weights would not fit in {available / 2**30:.1f} GiB of "
            "available host memory"
        )
        return {"done": False, "bytes": total, "reason": reason}
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    started = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while handle.readinto(view):
                pass
    seconds = time.perf_counter() - started
    return {
        "done": True,
        "bytes": total,
        "files": len(files),
        "s": round(seconds, 3),
        "gb_per_s": round(total / seconds / 1e9, 2) if seconds else None,
    }


Shape = tuple[int, int, bool]


def batch_shapes(records: Sequence[Record], shard_tokens: int, batch_tokens: int) -> list[Shape]:
    """Distinct (batch size, padded length, padded?) of the extraction's plan, in the order it runs them."""
    seen: dict[Shape, None] = {}
    for shard in plan_shards(records, shard_tokens, batch_tokens):
        for batch in shard.batches:
            width = max(r.num_tokens for r in batch)
            seen.setdefault((len(batch), width, any(r.num_tokens < width for r in batch)), None)
    return list(seen)


def one_layer_of_each_kind(config: Any) -> Any:
    """The target's config cut to the layers up to the first of each kind (e.g. 3 linear + 1 full)."""
    import copy

    layer_types = list(getattr(config, "layer_types", None) or [])
    cut = copy.deepcopy(config)
    keep = max(layer_types.index(kind) for kind in set(layer_types)) + 1 if layer_types else 1
    cut.num_hidden_layers = keep
    if layer_types:
        cut.layer_types = layer_types[:keep]
    # The vocabulary only sizes the embedding and the head (plain matmuls): keep it small.
    cut.vocab_size = min(int(config.vocab_size), 1024)
    return cut


def tune_kernels(target: Path, shapes: Sequence[Shape], device: Any, dtype: Any) -> dict[str, Any]:
    if device.type != "cuda":
        # Decided before transformers and the modeling module are imported: that import is most of
        # this process's time (about 5 of 8 CPU-s on a 2-core host), spent to learn nothing here.
        return {"done": False, "reason": f"nothing to tune: device {device} (fla's kernels run on CUDA only)"}
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specops.backend import modeling_module_for, planned_backends

    config = AutoConfig.from_pretrained(str(target))
    modeling = modeling_module_for(config)
    plan = planned_backends(modeling) if modeling is not None else {}
    if plan.get("gated_delta_rule") != "fla":
        return {
            "done": False,
            "reason": f"nothing to tune: gated_delta_rule {plan.get('gated_delta_rule')} on {device} "
            "(only fla's kernels are tuned)",
            "backends": plan,
        }
    cut = one_layer_of_each_kind(config)
    started = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cut, dtype=dtype).eval()
    build_s = time.perf_counter() - started
    timings = []
    # Through the extractor's own call (its masks, use_cache=False, inference mode): a kernel's compiled
    # variants depend on such flags (e.g. whether the final state is stored), not only on the shapes.
    with LayerCapture(model, [cut.num_hidden_layers - 1]) as capture:
        for size, width, padded in shapes:
            t0 = time.perf_counter()
            # Rows after the first are shorter when the planned batch is padded, so it gets a mask too.
            lengths = [max(1, width - (i if padded else 0)) for i in range(size)]
            records = [
                Record(i, i, torch.randint(0, cut.vocab_size, (n,)).numpy(), 0) for i, n in enumerate(lengths)
            ]
            ids, mask = pad_batch(records)
            capture(ids.to(device), None if mask is None else mask.to(device))
            torch.cuda.synchronize(device)
            seconds = round(time.perf_counter() - t0, 3)
            timings.append({"batch": size, "tokens": width, "padded": padded, "s": seconds})
    del model
    torch.cuda.empty_cache()
    return {
        "done": True,
        "layers": cut.num_hidden_layers,
        "build_s": round(build_s, 3),
        "shapes": timings,
        "s": round(time.perf_counter() - started, 3),
        "backends": plan,
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
    }


def _inputs(req: dict[str, Any]) -> tuple[Path, list[Shape], int]:
    target = inspect_target(req["target"])
    records = read_completions(Path(req["completions"]), target.vocab_size)
    shapes = batch_shapes(records, req["shard_tokens"], req["batch_tokens"])
    return target.path, shapes[: req["max_shapes"]], len(shapes)


def plan(request: dict[str, Any]) -> dict[str, Any]:
    req = parse_request(request)
    target, shapes, total = _inputs(req)
    return {
        "changed": True,
        "weights_bytes": sum(f.stat().st_size for f in weight_files(target)),
        "shapes": [list(s) for s in shapes],
        "shapes_planned": total,
    }


def run(request: dict[str, Any]) -> dict[str, Any]:
    req = parse_request(request)
    target, shapes, total = _inputs(req)
    result: dict[str, Any] = {"changed": True, "shapes_planned": total}
    started = time.perf_counter()
    if req["read_weights"]:
        result["read_weights"] = read_into_page_cache(weight_files(target))
        log(f"prewarm: weights {result['read_weights']}")
    if req["tune_kernels"]:
        device, dtype = resolve_device_dtype(req["device"], req["dtype"])
        result["tune_kernels"] = tune_kernels(target, shapes, device, dtype)
        log(f"prewarm: kernels {result['tune_kernels'].get('s', result['tune_kernels'].get('reason'))}")
    result["s"] = round(time.perf_counter() - started, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    return serve("prewarm", plan, run, argv)


if __name__ == "__main__":
    sys.exit(main())
