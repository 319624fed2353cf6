"""Where the scoring time goes: time per named part (drafter layers, head, inputs, the walk's steps).

On a GPU the parts are timed with CUDA events recorded around them, so timing adds no host sync; the
events are read once, at the end. On the CPU the wall clock is exact enough.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch


class StepTimer:
    """Seconds per named part; parts may nest (e.g. 'drafter' inside 'steps')."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._events: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        self._seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        self.counts[name] += 1
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[name].append((start, end))
        else:
            started = time.perf_counter()
            yield
            self._seconds[name] += time.perf_counter() - started

    def seconds(self) -> dict[str, float]:
        """Seconds per part (waits for the device once)."""
        if self.cuda:
            torch.cuda.synchronize()
            for name, pairs in self._events.items():
                self._seconds[name] += sum(s.elapsed_time(e) for s, e in pairs) / 1e3
            self._events.clear()
        return dict(self._seconds)


class NoTimer:
    """The default: records nothing and costs next to nothing (one shared context that does nothing, not a
    generator a span: the walk opens spans right after its host synchronizations)."""

    _NOTHING = nullcontext()

    def span(self, name: str) -> AbstractContextManager[None]:
        return self._NOTHING
