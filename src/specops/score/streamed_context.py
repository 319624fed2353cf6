"""A group's context K/V, computed a chunk of positions at a time as the walk reaches them.

The walk's first step reads the context before the prompt's end only, and each step moves a block
forward at most: the context after that is needed later. At the real drafter's shape the features of
256 completions are about 15 GB, half a second over PCIe, while the walk that reads them takes
seconds. So on a GPU the chunks' copies run on a side stream, and a chunk's K/V are computed (on the
walk's stream, after its copy) only when the walk is about to read past the positions computed so far, or
on another side stream right after the copy where KV_AHEAD_DEVICES says so: the copies run under the
walk's arithmetic instead of before it. Queueing a chunk's copies takes the host one call per completion
(about 6 ms for 256), so only COPIES_AHEAD chunks are queued at the start and each later one when the walk
reaches a chunk. On the CPU the copies are plain ones (there is nothing to overlap), made as the chunks are
queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specops.score.block_attention import empty_slots, select_sequences
from specops.score.drafter import DFlashDrafter

# Positions per chunk: the walk's first step waits for the chunks that hold the prompts (and one block);
# smaller chunks start it sooner, larger ones make fewer, larger products.
CHUNK_POSITIONS = 128
# Chunks whose copies are queued ahead of the walk (None: all of them at the start).
COPIES_AHEAD: int | None = 2
# Device types where a chunk's K/V are computed on a side stream right after its copy, ahead of the walk,
# rather than on the walk's stream when the walk reaches the chunk: the walk waits for them only where it
# reads them, and the device may compute them while the walk's stream waits for the host. The walk then
# runs on a stream of higher priority (`walk_stream`), so the K/V take the device only where the walk
# leaves it. Measured on three H100s at the real shape, alternated three rounds with the K/V on the walk's
# stream: 0.6% faster, 0.4% slower, 2.2% faster (benchmarks/score_real_h100_2026-12-06_epilogue_sums.json,
# _kernels.json, _last.json), within the rounds' own spread (3% at the last): no gain shown, so none by
# default (no extra streams); benchmarks/score_real_h200.py measures it ("kv_ahead").
KV_AHEAD_DEVICES: tuple[str, ...] = ()


# One walk stream per device, kept: the allocator caches memory per stream, so a new stream for every run
# would hold its own copy of the group's memory.
_WALK_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def walk_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A stream of the highest priority for the walk where its K/V are computed ahead (KV_AHEAD_DEVICES)
    on a CUDA device; None where the walk keeps the current stream."""
    if device.type != "cuda" or device.type not in KV_AHEAD_DEVICES:
        return None
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device not in _WALK_STREAMS:
        highest, _ = torch.cuda.Stream.priority_range()
        _WALK_STREAMS[device] = torch.cuda.Stream(device, priority=highest)
    return _WALK_STREAMS[device]


@dataclass
class _Chunk:
    first: int
    last: int
    features: torch.Tensor | None  # [B, positions, n, hidden] on the device; None once its K/V are computed
    # A CUDA event recorded after the copy (features) or after the K/V (computed ahead); None where that
    # work was synchronous.
    done: Any


class StreamedContext:
    """Per layer (k, v) [B, kv_heads, T', head_dim] with block slots (`block_attention.empty_slots`),
    filled up to `ready` positions; `ensure(n)` fills them up to n."""

    def __init__(
        self, drafter: DFlashDrafter, features: Sequence[torch.Tensor], length: int, device: torch.device
    ):
        self.drafter, self.length, self.ready = drafter, length, 0
        dtype = drafter.fc.weight.dtype
        attn = drafter.decoder_layers[0].self_attn
        shape = (len(features), attn.num_kv_heads, length, attn.head_dim)
        self.buffers = [
            (
                empty_slots(shape, drafter.block_size, device, dtype),
                empty_slots(shape, drafter.block_size, device, dtype),
            )
            for _ in drafter.decoder_layers
        ]
        self.features = features
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ahead = device.type in KV_AHEAD_DEVICES
        self.kv_side = torch.cuda.Stream(device) if self.side is not None and self.ahead else None
        self.chunks: list[_Chunk] = []
        self.queued = 0
        self._queue(len(range(0, length, CHUNK_POSITIONS)) if COPIES_AHEAD is None else COPIES_AHEAD)

    def _queue(self, chunks: int) -> None:
        """Allocate the next `chunks` chunks and queue their copies (and their K/V, where ahead)."""
        features, device = self.features, self.buffers[0][0].device
        dtype = self.buffers[0][0].dtype
        for first in range(
            self.queued, min(self.length, self.queued + chunks * CHUNK_POSITIONS), CHUNK_POSITIONS
        ):
            last = min(first + CHUNK_POSITIONS, self.length)
            if self.side is None:
                chunk = _Chunk(first, last, self._filled(first, last, dtype, device), None)
                if self.ahead:
                    self._compute(chunk)
            elif self.ahead:
                # Copied on the side stream, its K/V computed on a third one after the copy (the next copy
                # runs meanwhile); the buffers were allocated on the walk's stream, so both start after it.
                assert self.kv_side is not None
                self.side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(self.side):
                    chunk = _Chunk(first, last, self._filled(first, last, dtype, device), torch.cuda.Event())
                    chunk.done.record(self.side)
                self.kv_side.wait_event(chunk.done)
                with torch.cuda.stream(self.kv_side):
                    assert chunk.features is not None
                    chunk.features.record_stream(self.kv_side)
                    self._compute(chunk)
                    chunk.done = torch.cuda.Event()
                    chunk.done.record(self.kv_side)
            else:
                # Allocated and zeroed on the walk's stream, which computes its K/V: the copy starts after it.
                chunk = _Chunk(first, last, self._filled(first, last, dtype, device, copy=False), None)
                self.side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(self.side):
                    assert chunk.features is not None
                    self._copy(chunk.features, features, first, last)
                    chunk.done = torch.cuda.Event()
                    chunk.done.record(self.side)
            self.chunks.append(chunk)
            self.queued = last

    def _filled(
        self, first: int, last: int, dtype: torch.dtype, device: torch.device, copy: bool = True
    ) -> torch.Tensor:
        """The features at positions first..last-1 on the device: zeros past a sequence's end (its context
        there is zero, which every kernel may read), the rest copied over where copy (so only those rows are
        zeroed), on the current stream."""
        features = self.features
        chunk = torch.empty(len(features), last - first, *features[0].shape[1:], dtype=dtype, device=device)
        for b, sequence in enumerate(features):
            if sequence.shape[0] < last:
                chunk[b, max(0, sequence.shape[0] - first) :].zero_()
        if copy:
            self._copy(chunk, features, first, last)
        return chunk

    def _compute(self, chunk: _Chunk) -> None:
        """The chunk's K/V into the buffers, on the current stream; its features are dropped after."""
        assert chunk.features is not None
        computed = self.drafter.context_kv(chunk.features, first_position=chunk.first)
        for (k_buffer, v_buffer), (k, v) in zip(self.buffers, computed, strict=True):
            k_buffer[..., chunk.first : chunk.last, :] = k
            v_buffer[..., chunk.first : chunk.last, :] = v
        chunk.features = None

    @staticmethod
    def _copy(chunk: torch.Tensor, features: Sequence[torch.Tensor], first: int, last: int) -> None:
        for b, sequence in enumerate(features):
            part = sequence[first:last]
            if part.shape[0]:
                # Straight into the chunk: from pinned host memory asynchronous, from pageable memory a
                # plain copy.
                chunk[b, : part.shape[0]].copy_(part, non_blocking=True)

    def ensure(self, positions: int) -> None:
        """Compute the K/V of the context up to positions (all of it past the end)."""
        while self.chunks and self.ready < min(positions, self.length):
            chunk = self.chunks.pop(0)
            if chunk.done is not None:
                torch.cuda.current_stream(self.buffers[0][0].device).wait_event(chunk.done)
            if chunk.features is not None:
                self._compute(chunk)
            self.ready = chunk.last
            # The next chunk's copies (and K/V, where ahead), queued while the device works on this one.
            self._queue(1)

    def release(self) -> None:
        """Have the walk's stream wait for everything queued on the side stream (chunks computed ahead that
        the walk never waited for), before the buffers go back to the allocator."""
        for side in (self.side, self.kv_side):
            if side is not None:
                torch.cuda.current_stream(self.buffers[0][0].device).wait_stream(side)

    def select(self, index: torch.Tensor) -> None:
        """Keep the sequences at index (the whole context computed first: few chunks are left by then)."""
        self.ensure(self.length)
        self.buffers = [(select_sequences(k, index), select_sequences(v, index)) for k, v in self.buffers]
