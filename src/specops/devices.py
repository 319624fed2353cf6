"""Which torch device a stage runs on (one rule for every stage that loads a model), and giving a device
its memory back at a window's end."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specops.stage import StageError

if TYPE_CHECKING:
    import torch


def resolve_device(device: str) -> torch.device:
    """auto: cuda:0 where torch sees a GPU, else cpu; cpu, cuda and cuda:N are checked against this host."""
    import torch

    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise StageError(f"device {device!r} is not a torch device: use auto, cpu, cuda or cuda:N") from error
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise StageError(
                f"device {device} asked for but CUDA is not available to torch "
                f"{torch.__version__}: "
                "install a CUDA build of torch (fla_env) or use device cpu"
            )
        index = 0 if resolved.index is None else resolved.index
        if index >= torch.cuda.device_count():
            raise StageError(
                f"device {device} does not exist: this host has {torch.cuda.device_count()} GPUs"
            )
        return torch.device("cuda", index)
    if resolved.type != "cpu":
        raise StageError(f"device {device!r} is not supported: use auto, cpu, cuda or cuda:N")
    return resolved


# Device memory the caching allocator may still reserve when a stage says its window work is finished: a
# server resumed beside more than this could fail to allocate its KV cache (sglang 0.5.23
# srt/managers/scheduler_components/weight_updater.py:383-406 kills the scheduler then).
MAX_RESERVED_WHEN_FINISHED = 256 << 20


def release_device(device: torch.device) -> int:
    """Give the caching allocator's free blocks back to the device; the bytes it still reserves."""
    if getattr(device, "type", "cpu") != "cuda":
        return 0
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved(device))
