"""Which torch device a stage runs on: one rule for every stage that loads a model."""

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
