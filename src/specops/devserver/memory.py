"""Release and resume of the model's memory, as SGLang does with --enable-memory-saver.

Strict (the default) imitates SGLang's failure semantics, read in sgl-project/sglang:
- managers/scheduler_update_weights_mixin.py (commit 018c9109): release asserts
  `_is_no_request()`; resume runs `offload_tags.remove(tag)` for every tag, so a tag that is not
  released raises KeyError. Either exception ends `run_scheduler_process` (managers/scheduler.py),
  which logs "Scheduler hit an exception" and SIGQUITs the launcher: the whole server dies.
- constants.py: GPU_MEMORY_ALL_TYPES = kv_cache, weights, weights_drafter, cuda_graph; an empty
  or missing list means all of them.
- Without --enable-memory-saver the scheduler's no-op adapter frees nothing and the endpoint
  still answers 200 (entrypoints/http_server.py at 0025436e returns nothing, i.e. 200 `null`).
Forgiving (`--forgiving`) keeps the older, lenient answers (400 instead of a crash).

The weights' CPU backup is as torch_memory_saver keeps it (fzyzcjy/torch_memory_saver,
csrc/core.cpp at 106fe07d, pause/resume): pinned host memory (cudaMallocHost) allocated at the first
release and kept for the next ones, one copy device -> host on release and host -> device on resume.
Pageable host memory would make both slower than the real server's.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from typing import Any

from specops.devserver.engine import Engine
from specops.devserver.protocol import RequestError

logger = logging.getLogger("specops.devserver")

TAGS = ("kv_cache", "weights", "weights_drafter", "cuda_graph")
# The launcher's exit status after the scheduler's SIGQUIT (128 + 3), as a supervisor sees it.
SCHEDULER_CRASH_EXIT = 131


def parse_tags(body: Any) -> set[str]:
    """`{"tags": [...]}`; missing, null or empty means every tag, as in SGLang."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise RequestError(400, 'the body must be a JSON object such as {"tags": ["weights"]}')
    tags = body.get("tags")
    if not tags:
        return set(TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise RequestError(400, f"tags must be a list of strings, got {tags!r}")
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise RequestError(400, f"unknown memory tag(s) {', '.join(unknown)}: use {', '.join(TAGS)}")
    return set(tags)


def scheduler_crash(reason: str) -> None:
    """End the whole server at once, as SGLang's scheduler does on an exception."""
    logger.error("Scheduler hit an exception: %s", reason)
    sys.stderr.flush()
    os._exit(SCHEDULER_CRASH_EXIT)


class MemorySaver:
    """Drops the live model on release and brings it back on resume, never reading from disk."""

    def __init__(self, engine: Engine, enabled: bool, cpu_backup: bool, strict: bool = True):
        self.engine = engine
        self.enabled = enabled
        self.cpu_backup = cpu_backup
        self.strict = strict
        self._backup: Any = None  # the released model (its tensors' storage freed on a GPU)
        self._host: dict[str, Any] = {}  # name -> pinned host copy, kept across releases

    def _noop(self, verb: str) -> dict[str, Any] | None:
        """Without the memory saver: strict answers 200 and frees nothing; forgiving refuses."""
        if self.enabled:
            return None
        if self.strict:
            logger.warning("%s without --enable-memory-saver: nothing is freed or restored", verb)
            return {"success": True, "message": f"{verb}: memory saver disabled, nothing done"}
        raise RequestError(400, "memory release/resume needs the server started with --enable-memory-saver")

    def release(self, tags: set[str]) -> dict[str, Any]:
        noop = self._noop("release")
        if noop is not None:
            return noop
        engine = self.engine
        if engine.unavailable_reason() and not engine.released_tags:
            raise RequestError(503, engine.unavailable_reason() or "")
        if "weights" in tags and not self.cpu_backup:
            raise RequestError(
                400,
                "releasing weights needs --enable-weights-cpu-backup, otherwise they could "
                "not be restored without reading from disk: restart with that flag or "
                "release only kv_cache/cuda_graph",
            )
        # The model lock makes release wait for a running forward pass; pending requests refuse it.
        with engine.lock:
            if engine.pending:
                if self.strict:
                    scheduler_crash(
                        "AssertionError: release_memory_occupation should be called only when no "
                        f"ongoing request ({engine.pending} pending)"
                    )
                raise RequestError(
                    400,
                    f"{engine.pending} request(s) pending: let them finish "
                    "(POST /flush_cache answers 200 when idle), then release",
                )
            if "weights" in tags and "weights" not in engine.released_tags:
                # On a CPU device the module itself is its CPU copy.
                self._backup = engine.model
                if engine.device.startswith("cuda"):
                    _offload_to_pinned(engine.model, self._host)
                engine.model = None
                gc.collect()
                _empty_device_cache(engine.device)
            engine.released_tags |= tags
        logger.info("released memory: %s", ", ".join(sorted(tags)))
        return {
            "success": True,
            "message": f"released {', '.join(sorted(tags))}",
            "released_tags": sorted(engine.released_tags),
        }

    def resume(self, tags: set[str]) -> dict[str, Any]:
        noop = self._noop("resume")
        if noop is not None:
            return noop
        engine = self.engine
        with engine.lock:
            not_released = sorted(tags - engine.released_tags)
            if not_released and self.strict:
                scheduler_crash(f"KeyError: {not_released[0]!r} (resume of a memory tag not released)")
            if "weights" in tags and "weights" in engine.released_tags:
                if engine.device.startswith("cuda"):
                    _restore_from_pinned(self._backup, self._host, engine.device)
                engine.model = self._backup
                self._backup = None
            engine.released_tags -= tags
        logger.info("resumed memory: %s", ", ".join(sorted(tags)))
        return {
            "success": True,
            "message": f"resumed {', '.join(sorted(tags))}",
            "released_tags": sorted(engine.released_tags),
        }


def _tensors(model: Any) -> list[tuple[str, Any]]:
    """The module's parameters and buffers by name (a tied tensor once)."""
    return [*model.named_parameters(), *model.named_buffers()]


def _offload_to_pinned(model: Any, host: dict[str, Any]) -> None:
    """Copy every tensor into its pinned host buffer (made once), then free its device storage."""
    import torch

    for name, tensor in _tensors(model):
        buffer = host.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        buffer.copy_(tensor.detach())
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _restore_from_pinned(model: Any, host: dict[str, Any], device: str) -> None:
    """New device storage for every tensor, filled from its pinned host buffer (the buffers stay)."""
    import torch

    for name, tensor in _tensors(model):
        tensor.data = host[name].to(device, non_blocking=True)
    torch.cuda.synchronize(device)


def _empty_device_cache(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
