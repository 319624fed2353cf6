"""Stage extract_hidden_states: the target's hidden states at the drafter's layers, streamed to shards.

`python -m specops.extract --plan|--run` with a JSON request on stdin (docs/architecture.md).
Only the captured layers run: forward hooks record them and the hook of the last one stops the
forward, so later layers and the lm_head never run. Records are sorted by length and packed into
right-padded batches (padding cannot reach earlier tokens: every layer is causal). Shards are planned
up front from the lengths alone, written atomically by writer threads while the GPU computes, and
recorded in a resume file, so a killed run continues where it stopped.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specops import preflight
from specops.backend import BackendMonitor, modeling_module_for
from specops.extract import start_signal
from specops.extract.backend_guard import backend_plan, check_backend
from specops.extract.capture import LayerCapture, decoder_body
from specops.extract.devices import (
    DevicePlan,
    activation_reserve,
    describe_device,
    footprint,
    plan_for,
    resolve_device_dtype,
    truncated_config,
)
from specops.extract.extraction import extract_shards
from specops.extract.host_memory import plan_host_memory, read_meminfo
from specops.extract.outputs import stage_result, write_extraction_manifest
from specops.extract.parity import checked_parity
from specops.extract.prepared import Prepared, prepare
from specops.extract.shards import ResumeState, ShardPlan, resumable_shards
from specops.manifest import fingerprint, is_up_to_date, load_manifest, staleness
from specops.stage import StageError, log, serve


def disk_check(prep: Prepared, todo: Sequence[ShardPlan]) -> int:
    """Refuse an extraction whose shards would not fit; returns the bytes they need."""
    needed = preflight.shard_bytes(
        sum(s.num_tokens for s in todo), sum(len(s.records) for s in todo), len(todo), prep.bytes_per_token
    )
    preflight.check_disk(prep.out_dir, needed, prep.req["disk_reserve_bytes"], len(todo))
    return needed


def load_model(prep: Prepared) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(prep.target.path),
            dtype=prep.dtype,
            device_map=str(prep.device) if prep.device.type == "cuda" else None,
        )
    except (OSError, ValueError) as error:
        raise StageError(f"cannot load the target from {prep.target.path}: {error}") from error
    return model.eval()


def plan(request: dict[str, Any]) -> dict[str, Any]:
    # What the run would refuse after the service is down, refused now: every problem at once, so that
    # one run names all there is to fix.
    problems: list[str] = []
    prep = prepare(request, problems)
    fp = fingerprint(prep.inputs)
    reason = staleness(prep.out_dir, fp)
    if reason is None:
        preflight.refuse(problems)
        return {
            **stage_result(load_manifest(prep.out_dir) or {}, prep.out_dir, changed=False),
            "estimated_seconds": 0.0,
            "estimated_seconds_prestarted": 0.0,
        }
    resumable = resumable_shards(prep, fp)
    from transformers import AutoConfig

    modeling = modeling_module_for(AutoConfig.from_pretrained(str(prep.target.path)))
    checked(problems, backend_plan, prep, modeling)
    todo = [s for s in prep.shards if s.name not in resumable]
    needed = checked(problems, disk_check, prep, todo)
    memory = checked(problems, host_memory, prep)  # refused here, before the service is touched
    preflight.refuse(problems)
    log(memory["msg"])
    return {
        "changed": True,
        "reason": reason,
        # What the output is made from: a finished extraction of the same inputs is reused, not redone.
        "inputs_fingerprint": fp,
        "inputs": prep.inputs,
        "out_dir": str(prep.out_dir),
        "layer_ids": prep.layer_ids,
        "records": len(prep.records),
        "tokens": sum(r.num_tokens for r in prep.records),
        "shards": [s.name for s in prep.shards],
        "resumable_shards": resumable,
        "device": str(prep.device),
        "dtype": prep.dtype_name,
        "require_backend": prep.require,
        "parallel": plan_for(prep, free=False).describe(),  # at run time the choice uses free memory
        "gpu_need": gpu_need(prep),
        "estimated_bytes": needed,
        "estimated_seconds": round(estimated_seconds(prep, todo, needed), 1),
        # The same inside the window of an extraction started ahead of it (eval.yml's window plans with it).
        "estimated_seconds_prestarted": round(estimated_seconds(prep, todo, needed, prestarted=True), 1),
        "host_memory": memory,
    }


def checked(problems: list[str], check: Callable[..., Any], *args: Any) -> Any:
    """check(*args), its refusal added to problems instead of raised."""
    try:
        return check(*args)
    except StageError as error:
        problems.append(str(error))
        return None


def gpu_need(prep: Prepared) -> dict[str, int]:
    """What the extraction needs on the GPUs, for the server's memory plan: one copy of the target up to its
    last captured layer (the head included, as it loads), the same without the head where split, and the
    working memory of a forward at the planned batch."""
    config = truncated_config(prep.target.path, max(prep.layer_ids))
    measured = footprint(config, prep.dtype)
    reserve = activation_reserve(config, prep.req["batch_tokens"], len(prep.layer_ids), prep.dtype.itemsize)
    return {
        "copy_bytes": measured.body_bytes + measured.lm_head_bytes,
        "body_bytes": measured.body_bytes,
        "reserve_bytes": reserve,
    }


def stored_itemsize(prep: Prepared) -> int:
    """Bytes per weight in the target's files, from its config (bf16 unless it says float32)."""
    text = prep.target.config.get("text_config") or prep.target.config
    stored = str(
        text.get("dtype")
        or text.get("torch_dtype")
        or prep.target.config.get("dtype")
        or prep.target.config.get("torch_dtype")
        or "bfloat16"
    )
    return 4 if stored == "float32" else 2


def host_memory(prep: Prepared) -> dict[str, Any]:
    """The host memory plan (host_memory.py) from the host's figures now; StageError when refused."""
    stored = sum(w["size"] for w in prep.target.identity["weights"])
    held = stored * prep.dtype.itemsize // stored_itemsize(prep)  # held in the run's dtype
    req = prep.req
    return plan_host_memory(
        held,
        req["window_mode"],
        bool(req["start_signal"]),
        req["host_weights"],
        read_meminfo(req["meminfo"]),
        req["server_weights_bytes"],
        req["host_memory_reserve_bytes"],
    )


def estimated_seconds(
    prep: Prepared, todo: Sequence[ShardPlan], write_bytes: int, prestarted: bool = False
) -> float:
    """A pessimistic duration of the run (preflight.estimate_seconds), for the window's guard."""
    weights = sum(w["size"] for w in prep.target.identity["weights"])
    itemsize = stored_itemsize(prep)
    samples = prep.records[:: max(1, len(prep.records) // max(prep.req["parity_samples"], 1))]
    parity_tokens = sum(r.num_tokens for r in samples[: prep.req["parity_samples"]])
    return preflight.estimate_seconds(
        prep.device.type,
        weights,
        itemsize,
        max(prep.layer_ids) + 1,
        prep.target.num_layers,
        sum(s.num_tokens for s in todo),
        sum(len(s.batches) for s in todo),
        parity_tokens,
        write_bytes,
        prestarted=prestarted,
    )


def run(request: dict[str, Any]) -> dict[str, Any]:
    prep = prepare(request)
    fp = fingerprint(prep.inputs)
    if is_up_to_date(prep.out_dir, fp):
        log(f"{prep.out_dir} is up to date: nothing to extract")
        return stage_result(load_manifest(prep.out_dir) or {}, prep.out_dir, changed=False)
    modeling = target_modeling(prep)
    force_torch = backend_plan(prep, modeling)
    # Started ahead of its window: the host is checked again now, and the weights held as it allows.
    memory = host_memory(prep) if prep.req["start_signal"] else None
    held = start_signal.hold(prep, load_model, memory)  # None unless started ahead of its window
    state = open_resume_state(prep, fp)
    progress_log = Path(prep.req["progress_log"] or prep.out_dir / "progress.log")
    devices = plan_for(prep)  # from the devices' free memory
    if devices.mode != "single":
        from specops.extract.parallel import run_on_devices

        return run_on_devices(prep, devices, state, progress_log, force_torch)
    return run_single(prep, devices, state, progress_log, force_torch, modeling, held)


def target_modeling(prep: Prepared) -> Any:
    """The transformers modeling module of the target, from its config alone."""
    from transformers import AutoConfig

    return modeling_module_for(AutoConfig.from_pretrained(str(prep.target.path)))


def open_resume_state(prep: Prepared, fp: str) -> ResumeState:
    """The output directory with the finished shards of these inputs kept; refuses a disk too small."""
    prep.out_dir.mkdir(parents=True, exist_ok=True)
    state = ResumeState.open(prep.out_dir, fp, [s.name for s in prep.shards])
    disk_check(prep, [s for s in prep.shards if s.name not in state.shards])
    return state


def run_single(
    prep: Prepared,
    devices: DevicePlan,
    state: ResumeState,
    progress_log: Path,
    force_torch: bool,
    modeling: Any,
    held: start_signal.Held | None = None,
) -> dict[str, Any]:
    """Load the model on the one device, probe, extract every unfinished shard, write the manifest."""
    prep.device = resolve_device_dtype(devices.devices[0], prep.dtype_name)[0]
    if held:
        # From go to the weights' copy: the resume state, the disk check and the device plan.
        held.figures["setup_s"] = round(time.time() - held.figures["go_seen_at"], 3)
    started = time.perf_counter()
    model = held.on_device(prep.device) if held else load_model(prep)
    load_s = time.perf_counter() - started
    log(
        f"loaded {prep.target.path} in {load_s:.1f}s on {prep.device} ({prep.dtype_name}); "
        f"capturing layers {prep.layer_ids}"
    )
    modeling = sys.modules.get(type(decoder_body(model)[1][0]).__module__, modeling)
    settings = prep.settings(prep.device, progress_log)
    with (
        BackendMonitor(modeling, force_torch=force_torch) as monitor,
        LayerCapture(model, prep.layer_ids) as cap,
    ):
        parity = checked_parity(cap, prep, prep.device, modeling, monitor)
        stats = extract_shards(cap, prep.shards, prep.out_dir, state, settings, monitor)
        used = monitor.summary()
    check_backend(prep.require, used)
    backend = {
        **used,
        "device": describe_device(prep.device),
        "dtype": prep.dtype_name,
        "required": prep.require,
        "forced_torch": force_torch,
    }
    manifest = write_extraction_manifest(
        prep,
        state,
        backend,
        parity,
        {**stats, "load_s": load_s, "loop_ended_at": time.time(), "prestart": held.figures if held else None},
        devices.describe(),
    )
    log(f"wrote {len(prep.shards)} shards to {prep.out_dir} ({stats['tokens_per_second']:.0f} tok/s)")
    if held:
        # The window's end: the server resumes while this process exits.
        del model, cap, monitor
        start_signal.say_finished(Path(prep.req["start_signal"]), held, prep.device)
    return stage_result(manifest, prep.out_dir, changed=True)


def main(argv: list[str] | None = None) -> int:
    return serve("extract", plan, run, argv)
