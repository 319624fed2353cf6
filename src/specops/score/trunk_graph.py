"""The drafter's trunk replayed from a CUDA graph while a group's batch keeps its shape.

Every forward of the frontier walk starts right after a host synchronization (the head's passes decide
on the host which blocks go on), so the GPU waits while the host launches the trunk's first, small
kernels one by one (block embeddings, RoPE angles, norms), and between kernels later. A graph launches
the whole trunk at once. It is captured on the group's second forward at a batch shape (the first runs
eager and builds every kernel and lazy state the capture must not meet), replayed with the anchors and
starts copied into its own inputs, and dropped when the batch changes shape or the context buffers are
replaced (the walk's ended sequences leave), after which the trunk runs eager: the shapes after that
last a few forwards each, too few to repay a capture. Its outputs are the
graph's own memory, overwritten by the next replay: the walk reads them before its next forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specops.score import kernels

# Device types whose groups replay the trunk from a graph. Measured beside eager in
# benchmarks/score_real_h200.py ("engine, trunk_eager").
GRAPH_DEVICES: tuple[str, ...] = ("cuda",)
# Why a capture failed here (a kernel that synchronizes, a driver without graphs), or None; after a
# failure every trunk runs eager for the rest of the process.
GRAPH_FAILED: str | None = None

Outputs = tuple[torch.Tensor, torch.Tensor]
Trunk = Callable[[torch.Tensor, torch.Tensor], Outputs]


def _graph_failed(error: Exception) -> None:
    global GRAPH_FAILED
    GRAPH_FAILED = kernels.failure(
        error, "the drafter's trunk could not be captured as a CUDA graph ({}); it runs eager"
    )


class TrunkGraph:
    """trunk(anchors, starts) -> (residual, mixed), from a graph where it applies (`__call__`)."""

    def __init__(self, trunk: Trunk):
        self.trunk = trunk
        self.key: tuple | None = None
        self.captures_left = 1
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.outputs: Outputs | None = None

    def __call__(
        self, anchors: torch.Tensor, starts: torch.Tensor, buffers: object
    ) -> tuple[torch.Tensor, ...]:
        """The trunk's outputs for these anchors and starts [B, m]; buffers: the context's buffers, whose
        identity the graph holds (replaced buffers drop it)."""
        if GRAPH_FAILED is not None or anchors.device.type not in GRAPH_DEVICES:
            return self.trunk(anchors, starts)
        # The buffers themselves are held, not their id: a freed list's id can come back.
        key = (tuple(anchors.shape), tuple(starts.shape), buffers)
        if self.key is None or key[:2] != self.key[:2] or key[2] is not self.key[2]:
            # The first shape: eager once, captured at the next call. A later one: eager from now on.
            if self.key is not None:
                self.captures_left = 0
            self.release()
            self.key = key
            return self.trunk(anchors, starts)
        if self.graph is None and not self.captures_left:
            return self.trunk(anchors, starts)
        if self.graph is None:
            captured = self._capture(anchors, starts)
            if captured is None:
                return self.trunk(anchors, starts)
        assert self.graph is not None and self.inputs is not None and self.outputs is not None
        self.inputs[0].copy_(anchors)
        self.inputs[1].copy_(starts)
        self.graph.replay()
        return self.outputs

    def _capture(self, anchors: torch.Tensor, starts: torch.Tensor) -> torch.cuda.CUDAGraph | None:
        inputs = (anchors.clone(), starts.clone())
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(anchors.device)
        side = torch.cuda.Stream(anchors.device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                graph.capture_begin()
                try:
                    outputs = self.trunk(*inputs)
                finally:
                    graph.capture_end()
        except Exception as error:  # noqa: BLE001 (any capture failure: eager from now on, said once)
            current.wait_stream(side)
            _graph_failed(error)
            return None
        current.wait_stream(side)
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.captures_left -= 1
        return graph

    def release(self) -> None:
        """Drop the graph and its memory (outputs still held by the caller stay valid)."""
        self.graph = self.inputs = self.outputs = None
