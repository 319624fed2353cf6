"""The I/O pipeline beside the forward: device -> pinned host copies, shard writer threads, device
timing and the progress log.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specops.extract.shards import ShardPlan
from specops.extract.target import Record
from specops.hidden_states import ShardFile
from specops.stage import log


class Progress:
    """tokens done / total and tokens per second, to a log file and stderr, at most every `interval` s."""

    def __init__(
        self,
        path: Path | None,
        total: int,
        done: int = 0,
        interval: float = 2.0,
        echo: Callable[[str], None] | None = log,
    ):
        self.path, self.total, self.done, self.resumed = path, total, done, done
        self.interval, self.echo = interval, echo
        self.start = time.monotonic()
        self._last = 0.0
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{_now()} start: {total} tokens to extract, {done} already done\n")

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self.start
        return (self.done - self.resumed) / elapsed if elapsed > 0 else 0.0

    def advance(self, tokens: int, force: bool = False) -> None:
        self.done += tokens
        now = time.monotonic()
        if force or now - self._last >= self.interval or self.done >= self.total:
            self._last = now
            self.write(self.line())

    def line(self) -> str:
        rate = self.rate
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        percent = 100.0 * self.done / self.total if self.total else 100.0
        return (
            f"tokens {self.done}/{self.total} ({percent:.1f}%) {rate:.0f} tok/s "
            f"elapsed {time.monotonic() - self.start:.1f}s eta {eta:.0f}s"
        )

    def write(self, message: str) -> None:
        if self.path:
            with open(self.path, "a") as handle:
                handle.write(f"{_now()} {message}\n")
        if self.echo:
            self.echo(message)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


@dataclass
class BatchResult:
    records: list[Record]
    ids: Any  # int64 [B, T] on the host
    states: Any  # [B, T, n_layers, hidden] on the host (pinned on CUDA)
    ready: Any  # a CUDA event the writer waits on, or None
    release: Callable[[], None] = lambda: None  # gives the pinned buffer back once written


class ShardWriter:
    """Writes batches into their shards on writer threads while the device computes the next ones.

    Each shard belongs to one lane (a single thread), so its pieces land in order; lanes run in
    parallel. At most `pending` batches wait in host memory: the device only waits for the disk
    when the disk is slower than the device.
    """

    def __init__(
        self,
        out_dir: Path,
        threads: int,
        on_written: Callable[[str, dict], None],
        metadata: dict[str, str],
        layout: Callable[[ShardPlan], list],
        fsync: bool = True,
        pending: int | None = None,
    ):
        self.out_dir, self.on_written, self.metadata, self.layout = out_dir, on_written, metadata, layout
        self.fsync = fsync
        self.lanes = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shard-writer-{n}") for n in range(threads)
        ]
        self.hashers = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shard-hasher-{n}") for n in range(threads)
        ]
        self.slots = threading.BoundedSemaphore(pending or 2 * threads + 2)
        self.futures: list[Future] = []
        self.files: dict[str, ShardFile] = {}
        self.times = {"blocked_s": 0.0, "event_wait_s": 0.0, "write_s": 0.0, "finish_s": 0.0}
        self._lock = threading.Lock()

    def submit(self, shard: ShardPlan, part: BatchResult, last: bool) -> None:
        self.raise_failures()
        started = time.perf_counter()
        self.slots.acquire()
        self.times["blocked_s"] += time.perf_counter() - started
        lane = shard.number % len(self.lanes)
        future = self.lanes[lane].submit(self._append, shard, part, last, self.hashers[lane])
        future.add_done_callback(lambda _: self.slots.release())
        self.futures.append(future)

    def _append(self, shard: ShardPlan, part: BatchResult, last: bool, hasher: ThreadPoolExecutor) -> None:
        started = time.perf_counter()
        if part.ready is not None:
            part.ready.synchronize()
        waited = time.perf_counter()
        try:
            if shard.name not in self.files:
                self.files[shard.name] = ShardFile(
                    self.out_dir / shard.name, self.layout(shard), self.metadata, self.fsync
                )
            handle = self.files[shard.name]
            items = []
            for row, record in enumerate(part.records):
                items.append((f"{record.index}.input_ids", part.ids[row, : record.num_tokens]))
                items.append((f"{record.index}.hidden_states", part.states[row, : record.num_tokens]))
            handle.write_many(items, hasher)
            if not last:
                handle.flush()
            written = time.perf_counter()
            if last:
                digest = self.files.pop(shard.name).finish()
                self.on_written(shard.name, digest)
        except BaseException:
            broken = self.files.pop(shard.name, None)
            if broken is not None:
                broken.abort()
            raise
        finally:
            part.release()
        done = time.perf_counter()
        with self._lock:
            self.times["event_wait_s"] += waited - started
            self.times["write_s"] += written - waited
            self.times["finish_s"] += done - written

    def raise_failures(self) -> None:
        """Raise the first failed write; forget the finished ones, so a long run does not rescan them."""
        pending = []
        for future in self.futures:
            if not future.done():
                pending.append(future)
            elif future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        self.futures = pending

    def finish(self) -> None:
        for future in self.futures:
            future.result()

    def close(self) -> None:
        for lane in self.lanes:
            lane.shutdown(wait=True, cancel_futures=True)
        for hasher in self.hashers:
            hasher.shutdown(wait=True)
        for handle in self.files.values():  # shards a failure left half written
            handle.abort()
        self.files.clear()


class HostCopier:
    """Device -> pinned host copies on a side stream, so they overlap with the next batch's compute.

    Pinned buffers come from a pool of `buffers`, allocated once: allocating pinned memory
    synchronises the device, and a batch waits here when every buffer is still being written.
    """

    def __init__(self, device: Any, buffers: int, batch_bytes: int = 0):
        import torch

        self.device, self.limit, self.batch_bytes = device, buffers, batch_bytes
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.free: queue.Queue = queue.Queue()
        self.allocated = 0
        self.waited_s = 0.0

    def __call__(self, states: Any) -> tuple[Any, Any, Callable[[], None]]:
        import torch

        if self.stream is None:
            return states, None, lambda: None
        nbytes = states.numel() * states.element_size()
        buffer = self._take(nbytes)
        host = buffer[:nbytes].view(states.dtype).view(states.shape)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(states, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        states.record_stream(self.stream)  # keep the device buffer alive until the copy has run
        return host, ready, lambda: self.free.put(buffer)

    def _take(self, nbytes: int) -> Any:
        import torch

        while True:
            try:
                buffer = self.free.get_nowait()
            except queue.Empty:
                if self.allocated < self.limit:
                    self.allocated += 1
                    return torch.empty(max(nbytes, self.batch_bytes), dtype=torch.uint8, pin_memory=True)
                started = time.perf_counter()
                buffer = self.free.get()
                self.waited_s += time.perf_counter() - started
            if buffer.numel() >= nbytes:
                return buffer
            self.allocated -= 1  # too small for this batch: let it go and allocate a larger one


class DeviceTimer:
    """CUDA events around each batch's forward: device busy time against the span, i.e. the bubbles.

    Recording events costs microseconds and never waits; finished pairs are read as the run goes (a
    non-blocking query), so a long run keeps only the events still in flight.
    """

    def __init__(self, device: Any):
        self.device = device if device.type == "cuda" else None
        self.pending: deque[tuple[Any, Any]] = deque()
        self.first: Any = None
        self.last: Any = None
        self.busy_ms = 0.0

    def _record(self) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def begin(self) -> None:
        if self.device is not None:
            self.pending.append((self._record(), None))
            if self.first is None:
                self.first = self.pending[-1][0]

    def end(self) -> None:
        if self.device is None:
            return
        self.last = self._record()
        self.pending[-1] = (self.pending[-1][0], self.last)
        while self.pending and self.pending[0][1] is not None and self.pending[0][1].query():
            self._count(self.pending.popleft())

    def _count(self, pair: tuple[Any, Any]) -> None:
        self.busy_ms += pair[0].elapsed_time(pair[1])

    def synchronize(self) -> None:
        if self.device is not None:
            import torch

            torch.cuda.synchronize(self.device)

    def summary(self) -> dict[str, float]:
        """device_busy_s (sum of the forwards) and device_span_s (first start to last end); {} on CPU."""
        if self.first is None or self.last is None:
            return {}
        self.synchronize()
        while self.pending:
            self._count(self.pending.popleft())
        span_ms = self.first.elapsed_time(self.last)
        return {"device_busy_s": self.busy_ms / 1e3, "device_span_s": span_ms / 1e3}
