"""The extraction loop: each batch through the capture, the host copier and the shard writer."""

from __future__ import annotations

import errno
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specops.backend import BackendMonitor
from specops.extract.backend_guard import check_backend
from specops.extract.capture import LayerCapture, pad_batch
from specops.extract.pipeline import BatchResult, DeviceTimer, HostCopier, Progress, ShardWriter
from specops.extract.shards import ResumeState, ShardPlan
from specops.hidden_states import FORMAT_VERSION
from specops.stage import StageError, log


@dataclass
class ExtractionSettings:
    layer_ids: list[int]
    device: Any
    require: str = "any"  # fla | torch | any: checked on what actually ran
    writer_threads: int = 4
    fsync: bool = True
    progress_log: Path | None = None
    echo: Callable[[str], None] | None = log
    copier: HostCopier | None = None  # reuse one across runs to keep its pinned buffers


def extract_shards(
    capture: LayerCapture,
    shards: Sequence[ShardPlan],
    out_dir: Path,
    state: ResumeState,
    settings: ExtractionSettings,
    monitor: BackendMonitor | None = None,
) -> dict[str, Any]:
    """Run every shard not already in `state`; returns timings. The model must already be loaded."""
    import torch

    todo = [s for s in shards if s.name not in state.shards]
    total = sum(s.num_tokens for s in shards)
    progress = Progress(
        settings.progress_log, total, total - sum(s.num_tokens for s in todo), echo=settings.echo
    )
    pending = 2 * settings.writer_threads + 2
    batch_bytes = max(len(b) * max(r.num_tokens for r in b) for s in todo for b in s.batches) if todo else 0
    copier = settings.copier or HostCopier(
        settings.device,
        pending,
        batch_bytes * len(settings.layer_ids) * capture.hidden_size * capture.dtype.itemsize,
    )
    metadata = {
        "format": "specops.hidden_states",
        "format_version": str(FORMAT_VERSION),
        "layer_ids": json.dumps(settings.layer_ids),
    }
    dtype_name = str(capture.dtype).removeprefix("torch.")
    n_layers, hidden = len(settings.layer_ids), capture.hidden_size

    def layout(shard: ShardPlan) -> list:
        return [
            entry
            for batch in shard.batches
            for r in batch
            for entry in (
                (f"{r.index}.input_ids", "int64", (r.num_tokens,)),
                (f"{r.index}.hidden_states", dtype_name, (r.num_tokens, n_layers, hidden)),
            )
        ]

    writer = ShardWriter(
        out_dir, settings.writer_threads, state.add, metadata, layout, settings.fsync, pending
    )
    times = {"forward_s": 0.0, "copy_issue_s": 0.0}
    unchecked = monitor  # the backend is checked once, after the first forward
    waited_before = copier.waited_s
    device_timer = DeviceTimer(settings.device)
    started = time.perf_counter()
    try:
        for shard in todo:
            for number, batch in enumerate(shard.batches):
                ids, mask = pad_batch(batch)
                if settings.device.type == "cuda":
                    # From pageable memory the copy would wait for the device to drain: a bubble per batch.
                    ids, mask = ids.pin_memory(), (None if mask is None else mask.pin_memory())
                t0 = time.perf_counter()
                device_timer.begin()
                device_ids = ids.to(settings.device, non_blocking=True)
                device_mask = None if mask is None else mask.to(settings.device, non_blocking=True)
                outputs = capture(device_ids, device_mask)
                stacked = torch.stack(outputs, dim=2).to(capture.dtype)  # [B, T, n_layers, hidden]
                del outputs
                device_timer.end()
                t1 = time.perf_counter()
                host, ready, release = copier(stacked)
                del stacked
                times["forward_s"] += t1 - t0
                times["copy_issue_s"] += time.perf_counter() - t1
                if unchecked is not None:  # after the first forward, before anything reaches the disk
                    check_backend(settings.require, unchecked.summary())
                    unchecked = None
                writer.submit(
                    shard,
                    BatchResult(batch, ids, host, ready, release),
                    last=number == len(shard.batches) - 1,
                )
                progress.advance(sum(r.num_tokens for r in batch))
        device_timer.synchronize()  # what is left after this is the writers' alone
        loop_done = time.perf_counter()
        writer.finish()
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise StageError(
                f"no space left on the device of {out_dir}: free space or choose another "
                f"out_dir; "
                "finished shards are kept and a rerun resumes"
            ) from error
        raise
    finally:
        writer.close()
    finished = time.perf_counter()
    progress.write(progress.line() + " done")
    return {
        **times,
        **writer.times,
        **device_timer.summary(),
        "blocked_on_host_buffers_s": copier.waited_s - waited_before,
        "loop_s": loop_done - started,
        "drain_s": finished - loop_done,
        "total_s": finished - started,
        "tokens": sum(s.num_tokens for s in todo),
        "tokens_resumed": progress.resumed,
        "shards_written": len(todo),
        "shards_resumed": len(shards) - len(todo),
        "tokens_per_second": sum(s.num_tokens for s in todo) / (finished - started) if todo else 0.0,
    }
