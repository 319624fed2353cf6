"""Release and resume of the model's memory, as SGLang does with --enable-memory-saver.

Strict (the default) imitates SGLang's failure semantics, read in sglang 0.5.23 and 0.5.4:
- 0.5.23 managers/scheduler_components/weight_updater.py:339 asserts `is_fully_idle(ignore_waiting=
  paused)` before a release: a forward pass, a running request, or a waiting one outside a retract
  pause fails it. 0.5.4 (scheduler_update_weights_mixin.py:101) has no assert and releases between
  two steps of the running requests, which continue after the resume.
- resume runs `offload_tags.remove(tag)` for every tag (weight_updater.py:390), so a tag that is
  not released raises KeyError. Either exception ends `run_scheduler_process` (managers/scheduler.py),
  which logs "Scheduler hit an exception" and SIGQUITs the launcher: the launcher SIGKILLs its children
  and itself (process_tree.py), so the server exits by signal 9.
- `[]` or no tags means GPU_MEMORY_ALL_TYPES (constants.py; see versions.py).
- Both endpoints return nothing on success: HTTP 200 with the body `null` (entrypoints/http_server.py:1577).
  Without --enable-memory-saver the no-op adapter frees nothing and the answer is the same.
- Weights released without --enable-weights-cpu-backup are thrown away by torch_memory_saver; the
  server serves garbage after the resume and its health check still passes.
Forgiving (`--forgiving`) keeps the older, lenient answers (400 instead of a crash or of garbage).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, NoReturn

from specops.devserver.engine import Engine
from specops.devserver.memory_backends import CpuBackend, TorchMemorySaverBackend, memory_backend
from specops.devserver.memory_layout import GIB, MemoryLayout, lay_out, memory_usage, model_bytes
from specops.devserver.process_tree import ProcessTree, kill_tree_and_exit
from specops.devserver.protocol import RequestError
from specops.devserver.versions import DEFAULT_VERSION, VERSIONS, SGLangVersion

logger = logging.getLogger("specops.devserver")

# Draft and target weights share `weights` (sglang 0.5.23 weight_updater.py:345-366): no tag of their own.
TAGS = ("kv_cache", "weights", "cuda_graph")
NEEDS_MEMORY_SAVER = "memory release/resume needs the server started with --enable-memory-saver"


def parse_tags(body: Any) -> set[str] | None:
    """`{"tags": [...]}`; None when missing, null or empty (every tag of the version, as in SGLang)."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise RequestError(400, 'the body must be a JSON object such as {"tags": ["weights"]}')
    tags = body.get("tags")
    if not tags:
        return None
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise RequestError(400, f"tags must be a list of strings, got {tags!r}")
    # An unknown tag is accepted and frees nothing: both versions add every tag to `offload_tags` and
    # act only on those they know (0.5.23 weight_updater.py:348-349; 0.5.4
    # scheduler_update_weights_mixin.py:109-110), and a resume removes it again.
    return set(tags)


def scheduler_crash(reason: str) -> NoReturn:
    """End the whole server at once, as SGLang's scheduler does on an exception."""
    logger.error("Scheduler hit an exception: %s", reason)
    sys.stderr.flush()
    kill_tree_and_exit()


class MemorySaver:
    """Releases and resumes the model's memory by tag, through a backend (memory_backends.py)."""

    # The scheduler ranks of a --tp-size > 1 tree, which take their part in every release and resume.
    ranks: ProcessTree | None = None

    def __init__(
        self,
        engine: Engine,
        enabled: bool,
        cpu_backup: bool,
        strict: bool = True,
        version: SGLangVersion = VERSIONS[DEFAULT_VERSION],
        backend: CpuBackend | TorchMemorySaverBackend | None = None,
        mem_fraction_static: float = 0.88,
        simulated_device_gib: float = 0.0,
        weight_cache_mode: str = "off",
    ):
        self.engine = engine
        self.mem_fraction_static = mem_fraction_static
        self.simulated_device_gib = simulated_device_gib
        self.layout: MemoryLayout | None = None
        self.enabled = enabled
        self.cpu_backup = cpu_backup
        self.strict = strict
        self.version = version
        self.backend = backend or memory_backend(engine.device, cpu_backup)
        self.weight_cache_mode = weight_cache_mode

    @property
    def backend_name(self) -> str:
        return self.backend.name if self.enabled else "disabled"

    def place(self, model: Any) -> Any:
        """Put the loaded model on its device and lay out the KV cache and graphs after it, as SGLang does;
        inside the saver's regions when enabled."""
        self.layout = lay_out(self.device_bytes(), model_bytes(model), self.mem_fraction_static)
        logger.info(
            "memory: weights %.2f GiB, KV cache %.2f GiB, CUDA graphs %.2f GiB%s",
            self.layout.weights_bytes / GIB,
            self.layout.kv_cache_bytes / GIB,
            self.layout.cuda_graph_bytes / GIB,
            ""
            if self.layout.total_bytes is None
            else f" of a {self.layout.total_bytes / GIB:.1f} GiB device",
        )
        return self.backend.place(model, self.layout) if self.enabled else model.to(self.engine.device)

    def device_bytes(self) -> int | None:
        """The device's size: CUDA's own figure, the simulated one on the CPU, or None."""
        if self.engine.device.startswith("cuda"):
            import torch

            return int(torch.cuda.mem_get_info(torch.device(self.engine.device))[1])
        return int(self.simulated_device_gib * GIB) if self.simulated_device_gib else None

    def memory_usage(self) -> dict[str, Any] | None:
        """The scheduler's accounting in /server_info (None before the model is placed)."""
        return None if self.layout is None else memory_usage(self.layout, self.version)

    def all_tags(self, tags: set[str] | None) -> set[str]:
        return set(tags) if tags else set(self.version.all_tags)

    def release(self, tags: set[str] | None) -> None:
        engine = self.engine
        tags = self.all_tags(tags)
        if not self.enabled and not self.strict:
            raise RequestError(400, NEEDS_MEMORY_SAVER)
        if engine.unavailable_reason() and not engine.released_tags:
            raise RequestError(503, engine.unavailable_reason() or "")
        if "weights" in tags and not self.cpu_backup and self.enabled and not self.strict:
            raise RequestError(
                400,
                "releasing weights needs --enable-weights-cpu-backup, otherwise they could "
                "not be restored without reading from disk: restart with that flag or "
                "release only kv_cache/cuda_graph",
            )
        if self.strict and not self.version.release_asserts_idle:
            with engine.preempt():
                self._release(tags)
            return
        if not engine.lock.acquire(blocking=False):
            self._refuse_busy("a forward pass is running")
        try:
            if not engine.is_fully_idle(ignore_waiting=engine.scheduler_paused):
                self._refuse_busy(
                    f"{engine.count('running')} running, {engine.count('waiting')} waiting request(s)"
                )
            self._release(tags)
        finally:
            engine.lock.release()

    def _refuse_busy(self, what: str) -> NoReturn:
        if self.strict:
            scheduler_crash(
                "AssertionError: release_memory_occupation should be called only when server is "
                f"idle. ({what})"
            )
        raise RequestError(
            400,
            f"{what}: let them finish (POST /flush_cache answers 200 when idle), then release",
        )

    def _release(self, tags: set[str]) -> None:
        engine = self.engine
        if "weights" in tags and self.weight_cache_mode != "off":
            # 0.5.23 weight_updater.py:293-307, raised at :368-369 inside the scheduler.
            message = (
                "RuntimeError: [weight_cache] release_memory_occupation of model weights is not supported "
                f"while the weight cache is active (--weight-cache-mode {self.weight_cache_mode})"
            )
            if self.strict:
                scheduler_crash(message)
            raise RequestError(400, message)
        if not self.enabled:
            logger.warning("release without --enable-memory-saver: nothing is freed")
            return
        if self.ranks is not None:
            self.ranks.every_scheduler("release", sorted(tags - engine.released_tags))
        # Only the version's own tags free anything (0.5.4 has no cuda_graph tag: its graphs stay).
        for tag in sorted((tags - engine.released_tags) & set(self.version.all_tags)):
            self.backend.release(engine, tag)
        engine.released_tags |= tags
        logger.info("released memory: %s", ", ".join(sorted(tags)))

    def resume(self, tags: set[str] | None) -> None:
        engine = self.engine
        tags = self.all_tags(tags)
        if not self.enabled:
            if not self.strict:
                raise RequestError(400, NEEDS_MEMORY_SAVER)
            logger.warning("resume without --enable-memory-saver: nothing is restored")
            return
        with engine.lock:
            not_released = sorted(tags - engine.released_tags)
            if not_released and self.strict:
                scheduler_crash(f"KeyError: {not_released[0]!r} (resume of a memory tag not released)")
            if self.ranks is not None:
                self.ranks.every_scheduler("resume", sorted(tags & engine.released_tags))
            for tag in sorted(tags & engine.released_tags & set(self.version.all_tags)):
                self.backend.resume(engine, tag)
            engine.released_tags -= tags
        with engine.cond:
            engine.cond.notify_all()
        logger.info("resumed memory: %s", ", ".join(sorted(tags)))
