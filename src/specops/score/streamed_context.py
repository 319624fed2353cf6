"""A group's context K/V, computed a chunk of positions at a time as the walk reaches them.

The walk's first step reads the context before the prompt's end only, and each step moves a block
forward at most: the context after that is needed later. At the real drafter's shape the features of
256 completions are about 15 GB, half a second over PCIe, while the walk that reads them takes
seconds. So on a GPU the chunks' copies run on a side stream, and a chunk's K/V are computed (on the
walk's stream, after its copy) only when the walk is about to read past the positions computed so far:
the copies run under the walk's arithmetic instead of before it. Queueing a chunk's copies takes the
host one call per completion (about 6 ms for 256), so only COPIES_AHEAD chunks are queued at the start
and each later one when a chunk is computed, while the device works on that chunk's K/V. On the CPU
the copies are plain ones (there is nothing to overlap), made as the chunks are queued.
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


@dataclass
class _Chunk:
    first: int
    features: torch.Tensor  # [B, positions, n, hidden] on the device
    copied: Any  # a CUDA event recorded after the copy, or None where the copy was synchronous


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
        self.chunks: list[_Chunk] = []
        self.queued = 0
        self._queue(len(range(0, length, CHUNK_POSITIONS)) if COPIES_AHEAD is None else COPIES_AHEAD)

    def _queue(self, chunks: int) -> None:
        """Allocate the next `chunks` chunks and queue their copies."""
        features, device = self.features, self.buffers[0][0].device
        dtype = self.buffers[0][0].dtype
        for first in range(
            self.queued, min(self.length, self.queued + chunks * CHUNK_POSITIONS), CHUNK_POSITIONS
        ):
            last = min(first + CHUNK_POSITIONS, self.length)
            # Zeros past a sequence's end (its context there is zero, which every kernel may read); the rest
            # is copied over, so only those rows are filled.
            chunk = torch.empty(
                len(features), last - first, *features[0].shape[1:], dtype=dtype, device=device
            )
            for b, sequence in enumerate(features):
                if sequence.shape[0] < last:
                    chunk[b, max(0, sequence.shape[0] - first) :].zero_()
            copied = None
            if self.side is not None:
                # The chunk is allocated and zeroed on the walk's stream: its copy starts after that.
                self.side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(self.side):
                    self._copy(chunk, features, first, last)
                    copied = torch.cuda.Event()
                    copied.record(self.side)
            else:
                self._copy(chunk, features, first, last)
            self.chunks.append(_Chunk(first, chunk, copied))
            self.queued = last

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
            if chunk.copied is not None:
                torch.cuda.current_stream(chunk.features.device).wait_event(chunk.copied)
            last = chunk.first + chunk.features.shape[1]
            computed = self.drafter.context_kv(chunk.features, first_position=chunk.first)
            for (k_buffer, v_buffer), (k, v) in zip(self.buffers, computed, strict=True):
                k_buffer[..., chunk.first : last, :] = k
                v_buffer[..., chunk.first : last, :] = v
            self.ready = last
            # The next chunk's copies, queued while the device computes this one's K/V.
            self._queue(1)

    def select(self, index: torch.Tensor) -> None:
        """Keep the sequences at index (the whole context computed first: few chunks are left by then)."""
        self.ensure(self.length)
        self.buffers = [(select_sequences(k, index), select_sequences(v, index)) for k, v in self.buffers]
