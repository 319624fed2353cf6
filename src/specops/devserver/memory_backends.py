"""Where released memory goes: torch_memory_saver on CUDA, a host copy of the model otherwise.

torch_memory_saver (package torch-memory-saver 0.0.10, the library SGLang's --enable-memory-saver
uses) allocates the tensors made inside `region(tag=..., enable_cpu_backup=...)` from pausable
memory; `pause(tag)` unmaps it (copying to pinned host memory first when the region keeps a CPU
backup) and `resume(tag)` maps new memory (copying the backup back). A region without a backup
comes back with undefined content: SGLang then serves with garbage weights.

Without that library (a CPU device, or CUDA where it is not installed) the CPU path imitates it:
the released model waits on the host (pinned on CUDA, as torch_memory_saver's csrc/core.cpp at
106fe07d keeps it) and comes back without a disk read.
"""

from __future__ import annotations

import gc
import importlib.metadata
import logging
import os
from typing import Any

logger = logging.getLogger("specops.devserver")


def _tensors(model: Any) -> list[tuple[str, Any]]:
    """The module's parameters and buffers by name (a tied tensor once)."""
    return [*model.named_parameters(), *model.named_buffers()]


def scramble_weights(model: Any, seed: int = 0) -> None:
    """Weights whose content was thrown away: new values, so the model answers with garbage."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32) * 0.02
            param.copy_(noise.to(dtype=param.dtype, device=param.device))


class CpuBackend:
    """The released model held on the host; without a CPU backup its weights come back scrambled."""

    def __init__(self, device: str, cpu_backup: bool):
        self.device = device
        self.cpu_backup = cpu_backup
        self.name = "cpu" if not device.startswith("cuda") else "pinned host copy"
        self._backup: Any = None
        self._host: dict[str, Any] = {}  # name -> pinned host copy, kept across releases

    def place(self, model: Any, layout: Any = None) -> Any:
        return model.to(self.device)

    def release(self, engine: Any, tag: str) -> None:
        if tag != "weights":
            return
        # On a CPU device the module itself is its CPU copy.
        self._backup = engine.model
        if self.device.startswith("cuda"):
            _offload_to_pinned(engine.model, self._host, keep_content=self.cpu_backup)
        engine.model = None
        gc.collect()
        _empty_device_cache(self.device)

    def resume(self, engine: Any, tag: str) -> None:
        if tag != "weights":
            return
        if self.device.startswith("cuda"):
            _restore_from_pinned(self._backup, self._host, self.device)
        engine.model = self._backup
        self._backup = None
        if not self.cpu_backup:
            scramble_weights(engine.model)


class TorchMemorySaverBackend:
    """torch_memory_saver's regions, one per tag as SGLang makes them: the weights, a KV pool and the CUDA
    graphs' memory sized by the layout (memory_layout.py), each paused and resumed on its own."""

    def __init__(self, device: str, cpu_backup: bool):
        from torch_memory_saver import torch_memory_saver

        self.saver = torch_memory_saver
        # Without the preload library in LD_PRELOAD the allocator hook must be torch's (FACTS.md).
        if "torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""):
            self.saver.hook_mode = "torch"
        self.device = device
        self.cpu_backup = cpu_backup
        self.buffers: dict[str, Any] = {}
        self.name = f"torch_memory_saver {importlib.metadata.version('torch-memory-saver')}"
        self._paused: set[str] = set()

    def place(self, model: Any, layout: Any) -> Any:
        import torch

        with self.saver.region(tag="weights", enable_cpu_backup=self.cpu_backup):
            model = model.to(self.device)
        # The KV cache needs no backup: SGLang flushes it at the release (weight_updater.py:365-366).
        with self.saver.region(tag="kv_cache", enable_cpu_backup=False):
            self.buffers["kv_cache"] = torch.zeros(
                layout.kv_cache_bytes, dtype=torch.uint8, device=self.device
            )
        if layout.cuda_graph_bytes:
            # SGLang always backs CUDA graphs up; a version without the tag keeps them where they are.
            with self.saver.region(tag="cuda_graph", enable_cpu_backup=True):
                self.buffers["cuda_graph"] = torch.zeros(
                    layout.cuda_graph_bytes, dtype=torch.uint8, device=self.device
                )
        return model

    def release(self, engine: Any, tag: str) -> None:
        if tag in ("weights", *self.buffers) and tag not in self._paused:
            self.saver.pause(tag)
            self._paused.add(tag)

    def resume(self, engine: Any, tag: str) -> None:
        if tag not in self._paused:
            return
        self.saver.resume(tag)
        self._paused.discard(tag)
        if tag == "weights" and not self.cpu_backup:
            # The region kept no backup: what the memory holds now is not the weights.
            scramble_weights(engine.model)


def memory_backend(device: str, cpu_backup: bool) -> CpuBackend | TorchMemorySaverBackend:
    """torch_memory_saver on CUDA when it imports; the CPU path everywhere else."""
    if device.startswith("cuda"):
        try:
            return TorchMemorySaverBackend(device, cpu_backup)
        except ImportError:
            logger.warning("torch_memory_saver is not installed: releases copy the weights to the host")
    return CpuBackend(device, cpu_backup)


def _offload_to_pinned(model: Any, host: dict[str, Any], keep_content: bool = True) -> None:
    """Copy every tensor into its pinned host buffer (made once), then free its device storage."""
    import torch

    for name, tensor in _tensors(model):
        if keep_content:
            buffer = host.get(name)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            buffer.copy_(tensor.detach())
        else:
            # Only the shape survives: resume allocates and scrambles.
            host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _restore_from_pinned(model: Any, host: dict[str, Any], device: str) -> None:
    """New device storage for every tensor, filled from its pinned host buffer (the buffers stay)."""
    import torch

    for name, tensor in _tensors(model):
        source = host[name]
        if source.device.type == "meta":
            tensor.data = torch.zeros(source.shape, dtype=source.dtype, device=device)
        else:
            tensor.data = source.to(device, non_blocking=True)
    torch.cuda.synchronize(device)


def _empty_device_cache(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
