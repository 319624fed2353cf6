"""Release and resume of the model's memory, as SGLang does with --enable-memory-saver.

Strict (the default) imitates SGLang's failure semantics, read in sglang 0.5.23 and 0.5.4:
- 0.5.23 managers/scheduler_components/weight_updater.py:339 asserts `is_fully_idle(ignore_waiting=
  paused)` before a release: a forward pass, a running request, or a waiting one outside a retract
  pause fails it. 0.5.4 (scheduler_update_weights_mixin.py:101) has no assert and releases between
  two steps of the running requests, which continue after the resume.
- resume runs `offload_tags.remove(tag)` for every tag (weight_updater.py:390), so a tag that is
  not released raises KeyError. Either exception ends `run_scheduler_process` (managers/scheduler.py),
  which logs "Scheduler hit an exception" and SIGQUITs the launcher: the whole server dies.
- `[]` or no tags means GPU_MEMORY_ALL_TYPES (constants.py; see versions.py).
- Both endpoints return nothing on success: HTTP 200 with the body `null` (entrypoints/http_server.py:1577).
  Without --enable-memory-saver the no-op adapter frees nothing and the answer is the same.
- Weights released without --enable-weights-cpu-backup are thrown away by torch_memory_saver; the
  server serves garbage after the resume and its health check still passes.
Forgiving (`--forgiving`) keeps the older, lenient answers (400 instead of a crash or of garbage).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, NoReturn

from specops.devserver.engine import Engine
from specops.devserver.memory_backends import CpuBackend, TorchMemorySaverBackend, memory_backend
from specops.devserver.protocol import RequestError
from specops.devserver.versions import DEFAULT_VERSION, VERSIONS, SGLangVersion

logger = logging.getLogger("specops.devserver")

TAGS = ("kv_cache", "weights", "weights_drafter", "cuda_graph")
NEEDS_MEMORY_SAVER = "memory release/resume needs the server started with --enable-memory-saver"
# The launcher's exit status after the scheduler's SIGQUIT (128 + 3), as a supervisor sees it.
SCHEDULER_CRASH_EXIT = 131


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
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise RequestError(400, f"unknown memory tag(s) {', '.join(unknown)}: use {', '.join(TAGS)}")
    return set(tags)


def scheduler_crash(reason: str) -> NoReturn:
    """End the whole server at once, as SGLang's scheduler does on an exception."""
    logger.error("Scheduler hit an exception: %s", reason)
    sys.stderr.flush()
    os._exit(SCHEDULER_CRASH_EXIT)


class MemorySaver:
    """Releases and resumes the model's memory by tag, through a backend (memory_backends.py)."""

    def __init__(
        self,
        engine: Engine,
        enabled: bool,
        cpu_backup: bool,
        strict: bool = True,
        version: SGLangVersion = VERSIONS[DEFAULT_VERSION],
        backend: CpuBackend | TorchMemorySaverBackend | None = None,
        weight_cache_mode: str = "off",
    ):
        self.engine = engine
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
        """Put the loaded model on its device, inside the saver's regions when enabled."""
        return self.backend.place(model) if self.enabled else model.to(self.engine.device)

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
        for tag in sorted(tags - engine.released_tags):
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
            for tag in sorted(tags & engine.released_tags):
                self.backend.resume(engine, tag)
            engine.released_tags -= tags
        with engine.cond:
            engine.cond.notify_all()
        logger.info("resumed memory: %s", ", ".join(sorted(tags)))
