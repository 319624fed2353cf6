"""Where extraction runs: which devices, one model copy per device (data) or one model over them (split).

Planning only; nothing here loads weights. The choice is made from each device's free memory against
what one copy of the model needs up to the last captured layer plus a reserve for activations:
  single  one device (the only one, or `parallel: single`)
  data    the model fits on each device: one copy per device, the shards divided longest first
  split   it fits on none: its layers spread over the devices in proportion to their free memory
The devices never enter the inputs fingerprint, so a run resumes on another number of devices.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specops.devices import resolve_device
from specops.stage import StageError

MODES = ("auto", "single", "data", "split")
GIB = 2**30
# CUDA context, allocator slack and kernel workspaces on top of the activations.
FIXED_RESERVE_BYTES = GIB


def validate_request(req: dict[str, Any]) -> None:
    """Check the `devices` and `parallel` request keys (shapes only: nothing is probed here)."""
    if req["parallel"] not in MODES:
        raise StageError(f"parallel {req['parallel']!r} is not one of {', '.join(MODES)}")
    devices = req["devices"]
    if devices == "auto":
        return
    if not isinstance(devices, list) or not devices or not all(isinstance(d, str) and d for d in devices):
        raise StageError(
            f"devices must be auto or a non-empty list such as [cuda:0, cuda:1], got {devices!r}"
        )


def first_device(req: dict[str, Any]) -> str:
    """The device that fixes the dtype and backend defaults: the first listed, else `device`."""
    return req["devices"][0] if isinstance(req["devices"], list) else req["device"]


def resolve_device_dtype(device: str, dtype: str) -> tuple[Any, Any]:
    import torch

    resolved = resolve_device(device)
    if dtype == "auto":
        dtype = "bfloat16" if resolved.type == "cuda" else "float32"
    return resolved, getattr(torch, dtype)


def describe_device(device: Any) -> str:
    if device.type == "cuda":
        import torch

        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"


def resolve_devices(devices: str | list[str], device: str) -> list[Any]:
    """torch devices to choose from: every visible GPU for devices auto + device auto, else those named."""
    import torch

    if devices == "auto":
        if device == "auto" and torch.cuda.is_available():
            return [torch.device("cuda", index) for index in range(torch.cuda.device_count())]
        return [resolve_device_dtype(device, "float32")[0]]
    resolved = [resolve_device_dtype(name, "float32")[0] for name in devices]
    if len({d.type for d in resolved}) > 1:
        raise StageError(f"devices {devices} mix device types: list only GPUs (cuda:N) or only cpu")
    seen = [str(d) for d in resolved if d.type == "cuda"]
    twice = sorted({name for name in seen if seen.count(name) > 1})
    if twice:
        raise StageError(f"devices lists {', '.join(twice)} more than once: name each GPU once")
    return resolved


# ----------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class Footprint:
    """Bytes of the weights that run, in the run's dtype: the body before layer 0, each layer, the head."""

    embed_bytes: int
    layer_bytes: list[int]
    lm_head_bytes: int

    @property
    def body_bytes(self) -> int:
        return self.embed_bytes + sum(self.layer_bytes)


def truncated_config(target: Any, last_layer: int) -> Any:
    """The target's config with only layers 0..last_layer: later layers never run, so they are not built."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(target))
    text = config.get_text_config()
    text.num_hidden_layers = last_layer + 1
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[: last_layer + 1]
    return config


def footprint(config: Any, dtype: Any) -> Footprint:
    """Measure a weightless (meta) copy of the model built from `config`."""
    import torch
    from transformers import AutoModelForCausalLM

    from specops.extract.capture import decoder_body

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    body, layers = decoder_body(model)

    def size(module: Any) -> int:
        tensors = [*module.parameters(), *module.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    layer_bytes = [size(layer) for layer in layers]
    body_bytes = size(body)
    return Footprint(body_bytes - sum(layer_bytes), layer_bytes, size(model) - body_bytes)


def activation_reserve(config: Any, batch_tokens: int, captured_layers: int, itemsize: int) -> int:
    """Peak working memory of a forward beyond the weights: one layer's activations, the captured states."""
    text = config.get_text_config()
    hidden = int(text.hidden_size)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    per_token = 2 * intermediate + 8 * hidden + 2 * captured_layers * hidden
    return FIXED_RESERVE_BYTES + batch_tokens * per_token * itemsize


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory, from /proc/meminfo where it exists."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        return (int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def device_memory(devices: Sequence[Any], free: bool = True) -> list[int]:
    """Free bytes per device (or total bytes with free=False); cpu devices share the host's memory."""
    import torch

    found = []
    for device in devices:
        if device.type == "cuda" and not free:  # the properties need no CUDA context on the device
            available = total = torch.cuda.get_device_properties(device).total_memory
        elif device.type == "cuda":
            available, total = torch.cuda.mem_get_info(device)
        else:
            available, total = _host_memory()
        found.append(available if free else total)
    return found


# ----------------------------------------------------------------------------- planning


def assign_shards(sizes: Sequence[tuple[str, int]], workers: int) -> list[list[str]]:
    """Longest shard first, each to the least-loaded worker (lowest number on a tie), so all end together.

    Each worker's list keeps the order it was given its shards: longest first.
    """
    if workers < 1:
        raise ValueError("at least one worker is needed")
    loads = [0] * workers
    groups: list[list[str]] = [[] for _ in range(workers)]
    for name, tokens in sorted(sizes, key=lambda item: (-item[1], item[0])):
        worker = min(range(workers), key=lambda w: (loads[w], w))
        groups[worker].append(name)
        loads[worker] += tokens
    return groups


def place_layers(embed_bytes: int, layer_bytes: Sequence[int], budgets: Sequence[int]) -> list[int]:
    """Device index of each layer, in order, with the embeddings on device 0.

    Each device gets a share of the bytes in proportion to its budget (a layer goes where the middle of
    its bytes falls), so every device keeps room for activations; where rounding to whole layers would
    overfill a device, the layers fill the devices in order instead.
    """
    total = embed_bytes + sum(layer_bytes)
    capacity = sum(max(0, b) for b in budgets)
    if total > capacity:
        raise StageError(
            f"the model up to its last captured layer needs {total / GIB:.1f} GiB and the devices have "
            f"{capacity / GIB:.1f} GiB to spare ({', '.join(f'{max(0, b) / GIB:.1f}' for b in budgets)}): "
            "free more GPUs (stop what holds them), add devices, or lower batch_tokens"
        )
    bounds, running = [], 0.0
    for budget in budgets:
        running += total * max(0, budget) / capacity
        bounds.append(running)
    placed, start = [], float(embed_bytes)
    for size in layer_bytes:
        middle = start + size / 2
        placed.append(next((d for d, bound in enumerate(bounds) if middle <= bound), len(budgets) - 1))
        start += size
    if _fits(embed_bytes, layer_bytes, placed, budgets):
        return placed
    placed, device, used = [], 0, embed_bytes
    for size in layer_bytes:
        while used + size > budgets[device] and device < len(budgets) - 1:
            device, used = device + 1, 0
        placed.append(device)
        used += size
    if not _fits(embed_bytes, layer_bytes, placed, budgets):
        raise StageError(
            f"the layers ({max(layer_bytes) / GIB:.2f} GiB the largest) cannot be cut to fit the devices' "
            f"spare memory ({', '.join(f'{max(0, b) / GIB:.1f}' for b in budgets)} GiB): free more GPU "
            "memory or lower batch_tokens"
        )
    return placed


def _fits(
    embed_bytes: int, layer_bytes: Sequence[int], placed: Sequence[int], budgets: Sequence[int]
) -> bool:
    used = [0] * len(budgets)
    used[0] = embed_bytes
    for size, device in zip(layer_bytes, placed, strict=True):
        used[device] += size
    return all(u <= b for u, b in zip(used, budgets, strict=True))


@dataclass
class DevicePlan:
    mode: str  # single | data | split
    devices: list[str]
    reason: str
    copy_bytes: int = 0  # one data-parallel copy: the body up to the last layer plus the head
    reserve_bytes: int = 0
    free_bytes: dict[str, int] = field(default_factory=dict)
    layer_devices: list[int] | None = None  # split: the index in `devices` of each layer 0..last

    def describe(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "mode": self.mode,
            "devices": self.devices,
            "reason": self.reason,
            "copy_gib": round(self.copy_bytes / GIB, 3),
            "reserve_gib": round(self.reserve_bytes / GIB, 3),
            "free_gib": {name: round(free / GIB, 3) for name, free in self.free_bytes.items()},
        }
        if self.layer_devices is not None:
            found["layers"] = [
                {"device": name, "layers": [k for k, d in enumerate(self.layer_devices) if d == i]}
                for i, name in enumerate(self.devices)
            ]
        return found


def plan_for(prep: Any, free: bool = True) -> DevicePlan:
    """The plan for a prepared request, from the devices' free memory (or total memory, with free=False)."""
    devices = resolve_devices(prep.req["devices"], prep.req["device"])
    names = [str(d) for d in devices]
    mode = prep.req["parallel"]
    if mode == "single" or (mode == "auto" and len(devices) == 1):
        return DevicePlan("single", names[:1], "asked for" if mode == "single" else "one device")
    config = truncated_config(prep.target.path, max(prep.layer_ids))
    measured = footprint(config, prep.dtype)
    reserve = activation_reserve(config, prep.req["batch_tokens"], len(prep.layer_ids), prep.dtype.itemsize)
    return choose(mode, names, device_memory(devices, free), measured, reserve)


def choose(mode: str, devices: Sequence[str], free: Sequence[int], fp: Footprint, reserve: int) -> DevicePlan:
    """Pick single, data or split from each device's free bytes; `mode` other than auto forces it."""
    free_by_name: dict[str, int] = {}
    for name, value in zip(devices, free, strict=True):
        free_by_name[name] = value if name not in free_by_name else min(value, free_by_name[name])
    copy = fp.body_bytes + fp.lm_head_bytes

    def decided(chosen: str, names: list[str], why: str, layers: list[int] | None = None) -> DevicePlan:
        return DevicePlan(chosen, names, why, copy, reserve, free_by_name, layers)

    if mode == "single" or (mode == "auto" and len(devices) == 1):
        why = "asked for" if mode == "single" else "one device"
        return decided("single", [devices[0]], why)
    fits = [d for d, f in zip(devices, free, strict=True) if f - reserve >= copy]
    if mode == "data":
        short = [d for d in devices if d not in fits]
        if short:
            raise StageError(
                f"parallel data needs {(copy + reserve) / GIB:.1f} GiB on each device but "
                f"{', '.join(f'{d} has {free_by_name[d] / GIB:.1f} GiB free' for d in short)}: free those "
                "devices, leave them out of devices, lower batch_tokens, or use parallel split/auto"
            )
        return decided("data", list(devices), "asked for")
    if mode == "auto" and fits:
        if len(fits) == 1:
            return decided("single", fits, f"the model fits only on {fits[0]}")
        why = (
            "the model fits on every device"
            if len(fits) == len(devices)
            else f"the model fits on {len(fits)} of {len(devices)} devices"
        )
        return decided("data", fits, why)
    budgets = [f - reserve for f in free]
    used = [d for d, b in zip(devices, budgets, strict=True) if b > 0] or list(devices)
    placed = place_layers(fp.embed_bytes, fp.layer_bytes, [max(0, b) for b in budgets if b > 0] or budgets)
    why = "asked for" if mode == "split" else "the model fits on no single device"
    return decided("split", used, why, placed)
