"""Is the extraction's forward bound by the GPU or by the CPU that launches its kernels?

    PYTHONPATH=src python3 benchmarks/extract_launch_h200.py     # on the GPU host, about 3 minutes

extract_h200.py found the device never idle between batches, yet each forward slower when the host
copies and shard writes run beside it: only a CPU on the critical path explains that. This measures,
on the same model: the CPU time to enqueue one forward while the GPU is held busy by a sleep kernel
(so the enqueue never waits for the device), against the device time of that forward; the
operations that synchronise with the device inside a forward (torch's sync debug mode); and the
full forward against the extractor at two batch sizes. Writes $OUT/extract_launch_h200.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import extract_h200 as bench  # noqa: E402

from specops import extract  # noqa: E402
from specops.backend import BackendMonitor  # noqa: E402
from specops.fixtures.drafter import build_target_layer_ids  # noqa: E402


def enqueue_and_device_ms(device, function, ids, sleep_cycles: int) -> tuple[float, float]:
    """(CPU ms to enqueue `function(ids)`, device ms it ran) with the device busy while it is enqueued."""
    torch.cuda.synchronize(device)
    torch.cuda._sleep(sleep_cycles)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    started = time.perf_counter()
    function(ids)
    enqueued = time.perf_counter() - started
    end.record()
    torch.cuda.synchronize(device)
    return enqueued * 1e3, begin.elapsed_time(end)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seqs", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    device, dtype = torch.device("cuda:0"), torch.bfloat16
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    config = bench.model_config(False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config)
    model = model.to(dtype).eval()
    layer_ids = build_target_layer_ids(config.num_hidden_layers, 5)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (args.seqs, args.seq_len), generator=generator)
    records = [extract.Record(i, f"seq-{i}", tokens[i].numpy(), args.seq_len // 4) for i in range(args.seqs)]
    result: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": extract.describe_device(device),
        "versions": bench.versions(),
        "command": " ".join(["benchmarks/extract_launch_h200.py", *sys.argv[1:]]),
        "workload": {"sequences": args.seqs, "seq_len": args.seq_len, "layer_ids": layer_ids},
    }
    scratch = Path(tempfile.mkdtemp(prefix="extract-launch-"))

    def full(ids):
        return model(input_ids=ids, use_cache=False).logits

    with BackendMonitor(modeling) as monitor, torch.inference_mode():
        ids = tokens[:4].to(device)
        full(ids)
        capture = extract.LayerCapture(model, layer_ids)
        capture(ids)
        capture.close()
        # 1. Enqueue time against device time, one batch of 4 x seq_len, three times each; the hooks
        # are installed only for the captured forward.
        sleep = int(1.98e9 * 0.5)  # about half a second of device time at the boost clock
        launch = {}
        for name in ("full_forward", "capture_masks_built", "capture_stop_after_last"):
            skip = name != "capture_masks_built"
            capture = None if name == "full_forward" else extract.LayerCapture(model, layer_ids, skip)
            function = capture or full
            pairs = [enqueue_and_device_ms(device, function, ids, sleep) for _ in range(3)]
            if capture is not None:
                capture.close()
            launch[name] = {
                "enqueue_ms": round(statistics.median(p[0] for p in pairs), 2),
                "device_ms": round(statistics.median(p[1] for p in pairs), 2),
            }
            launch[name]["enqueue_over_device"] = round(
                launch[name]["enqueue_ms"] / launch[name]["device_ms"], 3
            )
        result["launch"] = launch
        # 2. Operations inside one captured forward that synchronise with the device, counted.
        for skip in (False, True):
            with extract.LayerCapture(model, layer_ids, skip_mask_creation=skip) as capture:
                torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    capture(ids)
                    torch.cuda.set_sync_debug_mode("default")
            synchronising = [w for w in caught if "synchroniz" in str(w.message)]
            result["synchronising_ops_" + ("masks_given" if skip else "masks_built")] = {
                "count": len(synchronising),
                "where": sorted({f"{Path(w.filename).name}:{w.lineno}" for w in synchronising}),
            }
        print(json.dumps(result, indent=1), flush=True)

        # 3. Full forward against the extractor (page cache) at two batch sizes, interleaved.
        sizes = {}
        for batch_tokens in (8192, 16384):
            per_batch = batch_tokens // args.seq_len
            batches = [tokens[i : i + per_batch].to(device) for i in range(0, args.seqs, per_batch)]
            copier = extract.HostCopier(device, 10, batch_tokens * len(layer_ids) * config.hidden_size * 2)

            def extractor(bt=batch_tokens, copier=copier) -> float:
                out = scratch / f"run-{bt}"
                shards = extract.plan_shards(records, 32768, bt)
                out.mkdir()
                started = time.perf_counter()
                state = extract.ResumeState.open(out, "launch", [s.name for s in shards])
                settings = extract.ExtractionSettings(
                    layer_ids, device, "any", 4, fsync=False, echo=None, copier=copier
                )
                with extract.LayerCapture(model, layer_ids) as cap:
                    extract.extract_shards(cap, shards, out, state, settings, monitor)
                seconds = time.perf_counter() - started
                shutil.rmtree(out)
                os.sync()
                return seconds

            def forward(bs=batches) -> float:
                return bench.timed(device, full, bs)

            def captured(bs=batches) -> float:
                with extract.LayerCapture(model, layer_ids) as cap:
                    return bench.timed(device, cap, bs)

            runs = {
                "full_forward": forward,
                "capture_stop_after_last": captured,
                "extractor_page_cache": extractor,
            }
            for function in runs.values():  # warm-up: autotuning for this batch shape, pinned pool
                function()
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, function in runs.items():
                    times[name].append(function())
            full_s = statistics.median(times["full_forward"])
            sizes[str(batch_tokens)] = {
                name: {
                    "seconds": [round(t, 4) for t in ts],
                    "vs_full_forward": round(full_s / statistics.median(ts), 4),
                }
                for name, ts in times.items()
            }
        result["batch_sizes"] = sizes
    shutil.rmtree(scratch, ignore_errors=True)
    text = json.dumps(result, indent=2)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "extract_launch_h200.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
