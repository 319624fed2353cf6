"""Extraction over several devices: one worker process per model copy (data), or one model over them (split).

Data: each worker loads the model (up to the last captured layer) on its device, runs the parity probe
and the backend guard there, and writes its shards; the parent alone records finished shards in the
resume state and the progress log, so a worker that dies loses only the shards it had in flight.
Split: one process; each layer runs on the device it was placed on and its inputs follow it there.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specops.backend import BackendMonitor
from specops.extract.backend_guard import check_backend
from specops.extract.capture import LayerCapture, decoder_body
from specops.extract.devices import DevicePlan, assign_shards, describe_device, truncated_config
from specops.extract.extraction import extract_shards
from specops.extract.outputs import stage_result, write_extraction_manifest
from specops.extract.parity import checked_parity
from specops.extract.pipeline import Progress
from specops.extract.prepared import Prepared
from specops.extract.shards import ResumeState, ShardPlan
from specops.stage import StageError, log

# How often the parent looks at its workers while no message arrives.
POLL_S = 0.2


# ----------------------------------------------------------------------------- shared steps


def load_truncated(prep: Prepared, device: Any) -> Any:
    """The target with only the layers up to the last captured one, on `device` (cpu: host memory)."""
    from transformers import AutoModelForCausalLM

    config = truncated_config(prep.target.path, max(prep.layer_ids))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(prep.target.path),
            config=config,
            dtype=prep.dtype,
            device_map=str(device) if device.type == "cuda" else None,
        )
    except (OSError, ValueError) as error:
        raise StageError(f"cannot load the target from {prep.target.path}: {error}") from error
    return model.eval()


def device_labels(devices: list[str]) -> list[str]:
    """Names for per-device records: the device itself, numbered where a name repeats (cpu, cpu)."""
    return [name if devices.count(name) == 1 else f"{name}#{n}" for n, name in enumerate(devices)]


def _modeling_of(model: Any) -> Any:
    return sys.modules[type(decoder_body(model)[1][0]).__module__]


def _combined_backend(
    used: dict[str, dict[str, str]], prep: Prepared, force_torch: bool, devices: list[Any]
) -> dict[str, Any]:
    """One backend record for the manifest: an implementation shared by every device, else all of them."""
    families = sorted({family for summary in used.values() for family in summary})
    combined: dict[str, Any] = {}
    for family in families:
        ran = sorted({summary.get(family, "") for summary in used.values()})
        combined[family] = ran[0] if len(ran) == 1 else "mixed: " + ", ".join(ran)
    return {
        **combined,
        "device": ", ".join(describe_device(d) for d in devices),
        "dtype": prep.dtype_name,
        "required": prep.require,
        "forced_torch": force_torch,
        "per_device": used,
    }


def _write_manifest(
    prep: Prepared,
    state: ResumeState,
    backend: dict[str, Any],
    parity: Any,
    progress: dict[str, Any],
    plan: DevicePlan,
) -> dict[str, Any]:
    return write_extraction_manifest(prep, state, backend, parity, progress, plan.describe())


def run_on_devices(
    prep: Prepared, plan: DevicePlan, state: ResumeState, progress_log: Path, force_torch: bool
) -> dict[str, Any]:
    """Extract every shard not in `state` as `plan` says (data or split), then write the manifest."""
    runner = run_data_parallel if plan.mode == "data" else run_split
    stats, backend, parity = runner(prep, plan, state, progress_log, force_torch)
    check_backend(prep.require, {k: v for k, v in backend.items() if isinstance(v, str)})
    manifest = _write_manifest(prep, state, backend, parity, stats, plan)
    log(
        f"wrote {len(prep.shards)} shards to {prep.out_dir} on {', '.join(plan.devices)} ({plan.mode}, "
        f"{stats['tokens_per_second']:.0f} tok/s)"
    )
    result = stage_result(manifest, prep.out_dir, changed=True)
    result["parallel"] = manifest.get("parallel")
    return result


# ----------------------------------------------------------------------------- split


def _to_device(value: Any, device: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def place_model(model: Any, devices: list[Any], layer_devices: list[int]) -> Any:
    """Move the body's layers to their devices (the rest of the body to the first); inputs follow each layer.

    Returns the body. The lm_head never runs and stays where it was loaded (host memory).
    """
    import torch

    body, layers = decoder_body(model)
    for name, child in body.named_children():
        if name != "layers":
            child.to(devices[0])
    for layer, index in zip(layers, layer_devices, strict=True):
        device = devices[index]
        layer.to(device)

        def follow(module, args, kwargs, device=device):
            if device.type == "cuda":
                torch.cuda.set_device(device)  # triton kernels launch on the current device
            return _to_device(args, device), _to_device(kwargs, device)

        layer.register_forward_pre_hook(follow, with_kwargs=True)
    return body


class PlacedCapture(LayerCapture):
    """LayerCapture whose outputs are gathered on one device (they come from layers on several)."""

    def __init__(self, model: Any, layer_ids: list[int], gather_on: Any):
        super().__init__(model, layer_ids)
        self.gather_on = gather_on

    def __call__(self, input_ids: Any, attention_mask: Any = None) -> list[Any]:
        import torch

        outputs = super().__call__(input_ids, attention_mask)
        gathered = [o.to(self.gather_on, non_blocking=True) for o in outputs]
        if self.gather_on.type == "cuda":
            torch.cuda.set_device(self.gather_on)
        return gathered


def run_split(
    prep: Prepared, plan: DevicePlan, state: ResumeState, progress_log: Path, force_torch: bool
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    import torch

    devices = [torch.device(name) for name in plan.devices]
    started = time.perf_counter()
    model = load_truncated(prep, torch.device("cpu"))
    place_model(model, devices, plan.layer_devices or [])
    load_s = time.perf_counter() - started
    log(
        f"loaded {prep.target.path} in {load_s:.1f}s split over {', '.join(plan.devices)} "
        f"({prep.dtype_name}); capturing layers {prep.layer_ids}"
    )
    modeling = _modeling_of(model)
    settings = prep.settings(devices[0], progress_log)
    with (
        BackendMonitor(modeling, force_torch=force_torch) as monitor,
        PlacedCapture(model, prep.layer_ids, devices[0]) as capture,
    ):
        parity = checked_parity(capture, prep, devices[0], modeling, monitor, f" on {devices[0]}")
        stats = extract_shards(capture, prep.shards, prep.out_dir, state, settings, monitor)
        used = monitor.summary()
    backend = _combined_backend({" + ".join(plan.devices): used}, prep, force_torch, devices)
    return {**stats, "load_s": load_s}, backend, parity


# ----------------------------------------------------------------------------- data parallel


@dataclass
class WorkerTask:
    number: int
    device: str
    prep: Prepared
    shards: list[ShardPlan]
    force_torch: bool
    threads: int | None  # torch threads of a cpu worker, so workers do not oversubscribe the cores


class ForwardedState:
    """What extract_shards needs of a ResumeState; finished shards go to the parent, which records them."""

    def __init__(self, results: Any, number: int):
        self.shards: dict[str, dict[str, Any]] = {}
        self.results, self.number = results, number

    def add(self, name: str, digest: dict[str, Any]) -> None:
        self.shards[name] = digest
        self.results.put(("shard", self.number, (name, digest)))


def data_worker(task: WorkerTask, results: Any, start: Any = None) -> None:
    """One model copy on one device: load, probe, extract its shards, report each one finished.

    `start` (a barrier) holds every worker until all have loaded: the shards were divided for a common start.
    """
    import torch

    prep = task.prep
    try:
        device = torch.device(task.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif task.threads:
            torch.set_num_threads(task.threads)
        started = time.perf_counter()
        model = load_truncated(prep, device)
        load_s = time.perf_counter() - started
        log(f"{task.device}: loaded in {load_s:.1f}s; {len(task.shards)} shards to extract")
        modeling = _modeling_of(model)
        settings = prep.settings(device, echo=None)
        state = ForwardedState(results, task.number)
        with (
            BackendMonitor(modeling, force_torch=task.force_torch) as monitor,
            LayerCapture(model, prep.layer_ids) as capture,
        ):
            parity = checked_parity(capture, prep, device, modeling, monitor, f" on {device}")
            if start is not None:
                start.wait()
            span = [time.time()]  # wall clock: the parent lines the workers' spans up
            stats = extract_shards(
                capture,
                task.shards,
                prep.out_dir,
                state,  # type: ignore[arg-type]
                settings,
                monitor,
            )
            span.append(time.time())
            used = monitor.summary()
        check_backend(prep.require, used)
        results.put(
            (
                "done",
                task.number,
                {"stats": {**stats, "load_s": load_s}, "span": span, "backend": used, "parity": parity},
            )
        )
    except StageError as error:
        results.put(("failed", task.number, str(error)))
    except BaseException:
        results.put(("failed", task.number, traceback.format_exc(limit=8)))
        raise


WORKER = data_worker


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_data_parallel(
    prep: Prepared, plan: DevicePlan, state: ResumeState, progress_log: Path, force_torch: bool
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """Start one worker per device on its share of the unfinished shards; record what they finish."""
    import torch

    worker = WORKER  # looked up at call time: a test may put a module-level function of its own here

    todo = [s for s in prep.shards if s.name not in state.shards]
    by_name = {s.name: s for s in todo}
    groups = assign_shards([(s.name, s.num_tokens) for s in todo], len(plan.devices))
    total = sum(s.num_tokens for s in prep.shards)
    progress = Progress(progress_log, total, total - sum(s.num_tokens for s in todo))
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    results = context.Queue()
    start = context.Barrier(max(1, sum(1 for names in groups if names)))
    cpu_threads = max(1, (os.cpu_count() or 1) // len(plan.devices))
    workers = []
    for number, (device, names) in enumerate(zip(plan.devices, groups, strict=True)):
        if not names:
            continue
        task = WorkerTask(
            number,
            device,
            prep,
            [by_name[n] for n in names],
            force_torch,
            cpu_threads if device.startswith("cpu") else None,
        )
        process = context.Process(
            target=worker, args=(task, results, start), name=f"extract-{device}", daemon=True
        )
        process.start()
        workers.append((number, device, process))
    started = time.perf_counter()
    reports: dict[int, dict[str, Any]] = {}
    failure = None

    def handle(message: tuple[str, int, Any]) -> None:
        nonlocal failure
        kind, number, payload = message
        if kind == "shard":
            name, digest = payload
            state.add(name, digest)
            progress.advance(by_name[name].num_tokens)
        elif kind == "done":
            reports[number] = payload
        elif kind == "failed" and failure is None:
            failure = f"the worker on {plan.devices[number]} failed: {payload}"

    try:
        while failure is None and len(reports) < len(workers):
            try:
                handle(results.get(timeout=POLL_S))
                continue
            except queue.Empty:
                pass
            for number, device, process in workers:
                if number not in reports and not process.is_alive():
                    _drain(results, handle)
                    if number not in reports and failure is None:
                        failure = (
                            f"the worker on {device} died ({_exit_reason(process.exitcode)}) before "
                            "finishing its shards"
                        )
    finally:
        for _, _, process in workers:
            if process.is_alive():
                process.terminate()
        for _, _, process in workers:
            process.join(timeout=30)
        _drain(results, handle)  # shards other workers finished before they stopped
    if failure is not None:
        raise StageError(
            f"{failure}: finished shards are kept and a rerun resumes from them, on these devices or others"
        )
    finished = time.perf_counter()
    progress.write(progress.line() + " done")
    tokens = sum(s.num_tokens for s in todo)
    labels = device_labels(plan.devices)
    per_device = {
        labels[n]: {k: round(v, 3) if isinstance(v, float) else v for k, v in reports[n]["stats"].items()}
        for n in sorted(reports)
    }
    spans = [r["span"] for r in reports.values()]
    # From the first worker's first batch to the last worker's last write: the extraction proper,
    # without the workers' start and model load (those are in total_s).
    span_s = max(s[1] for s in spans) - min(s[0] for s in spans) if spans else 0.0
    stats = {
        "assignment": {labels[n]: names for n, names in enumerate(groups)},
        "extract_span_s": span_s,
        "total_s": finished - started,
        "load_s": max((r["stats"]["load_s"] for r in reports.values()), default=0.0),
        "tokens": tokens,
        "tokens_resumed": progress.resumed,
        "shards_written": len(todo),
        "shards_resumed": len(prep.shards) - len(todo),
        "tokens_per_second": tokens / span_s if todo and span_s > 0 else 0.0,
        "per_device": per_device,
    }
    used = {labels[n]: r["backend"] for n, r in sorted(reports.items())}
    devices = [torch.device(name) for name in plan.devices]
    parities = {labels[n]: r["parity"] for n, r in sorted(reports.items()) if r["parity"] is not None}
    parity = None
    if parities:
        parity = {
            **next(iter(parities.values())),
            "passed": all(p["passed"] for p in parities.values()),
            "per_device": parities,
        }
    return stats, _combined_backend(used, prep, force_torch, devices), parity


def _drain(results: Any, handle: Any) -> None:
    while True:
        try:
            handle(results.get(timeout=0.05))
        except queue.Empty:
            return
        except (EOFError, OSError):  # a worker killed mid-message leaves a broken pipe
            return
