"""Release and resume of the model's memory, as SGLang does with --enable-memory-saver."""

from __future__ import annotations

import gc
import logging
from typing import Any

from specops.devserver.engine import Engine
from specops.devserver.protocol import RequestError

logger = logging.getLogger("specops.devserver")

TAGS = ("kv_cache", "weights", "cuda_graph")


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


class MemorySaver:
    """Drops the live model on release and brings it back on resume, never reading from disk."""

    def __init__(self, engine: Engine, enabled: bool, cpu_backup: bool):
        self.engine = engine
        self.enabled = enabled
        self.cpu_backup = cpu_backup
        self._backup: Any = None

    def _check_allowed(self) -> None:
        if not self.enabled:
            raise RequestError(
                400, "memory release/resume needs the server started with --enable-memory-saver"
            )

    def release(self, tags: set[str]) -> dict[str, Any]:
        self._check_allowed()
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
                raise RequestError(
                    400,
                    f"{engine.pending} request(s) pending: let them finish "
                    "(POST /flush_cache answers 200 when idle), then release",
                )
            if "weights" in tags and "weights" not in engine.released_tags:
                # A CPU copy of the weights; on a CPU device that copy is the module itself.
                self._backup = engine.model.to("cpu")
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
        self._check_allowed()
        engine = self.engine
        with engine.lock:
            if "weights" in tags and "weights" in engine.released_tags:
                engine.model = self._backup.to(engine.device)
                self._backup = None
            engine.released_tags -= tags
        logger.info("resumed memory: %s", ", ".join(sorted(tags)))
        return {
            "success": True,
            "message": f"resumed {', '.join(sorted(tags))}",
            "released_tags": sorted(engine.released_tags),
        }


def _empty_device_cache(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
