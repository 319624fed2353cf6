"""The trunk's CUDA graph protocol, on the CPU with a stand-in graph (benchmarks/score_real_h200.py runs
the real one against eager on a GPU, accept lengths compared):

- the first call at a batch shape runs eager, the second captures and replays, later ones replay with
  the new anchors and starts copied in;
- a new shape or new context buffers drop the graph and start over;
- a capture that fails leaves every trunk eager and says so once.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import specops.score.trunk_graph as trunk_graph  # noqa: E402


class StandInGraph:
    """Records what the trunk registers while capturing and runs it on replay, as a graph's kernels."""

    capturing: StandInGraph | None = None

    def __init__(self):
        self.kernels: list = []
        self.replays = 0

    def capture_begin(self):
        StandInGraph.capturing = self

    def capture_end(self):
        StandInGraph.capturing = None

    def replay(self):
        self.replays += 1
        for kernel in self.kernels:
            kernel()


class Trunk:
    """(anchors * 2, starts + 1), computed into its outputs again on every replay; counts eager calls."""

    def __init__(self, fail_capture: bool = False):
        self.eager, self.fail_capture = 0, fail_capture

    def __call__(self, anchors, starts):
        graph = StandInGraph.capturing
        if graph is None:
            self.eager += 1
            return anchors * 2, starts + 1
        if self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        outputs = (torch.empty_like(anchors), torch.empty_like(starts))
        graph.kernels.append(lambda: (outputs[0].copy_(anchors * 2), outputs[1].copy_(starts + 1)))
        return outputs


@pytest.fixture
def graphs_on_the_cpu(monkeypatch):
    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(trunk_graph, "GRAPH_DEVICES", ("cpu",))
    monkeypatch.setattr(trunk_graph, "GRAPH_FAILED", None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())


def batch(seed: int, size: int = 4):
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.randint(0, 100, (size, 1), generator=generator)
    return anchors, torch.randint(0, 50, (size, 1), generator=generator)


def test_the_second_call_at_a_shape_captures_and_later_ones_replay_with_their_inputs(graphs_on_the_cpu):
    trunk = Trunk()
    graphed = trunk_graph.TrunkGraph(trunk)
    buffers = [object()]
    found = []
    for seed in range(4):
        anchors, starts = batch(seed)
        residual, mixed = graphed(anchors, starts, buffers)
        assert torch.equal(residual, anchors * 2) and torch.equal(mixed, starts + 1)
        found.append(residual)
    assert trunk.eager == 1
    assert graphed.graph is not None and graphed.graph.replays == 3
    # The replays hand out the graph's own outputs, overwritten by each replay.
    assert found[1] is found[2] is found[3]


def test_a_new_shape_or_new_buffers_drop_the_graph_and_the_trunk_stays_eager(graphs_on_the_cpu):
    trunk = Trunk()
    graphed = trunk_graph.TrunkGraph(trunk)
    buffers = [object()]
    for seed in range(3):
        graphed(*batch(seed), buffers)
    assert trunk.eager == 1
    # The walk's ended sequences left: a smaller batch, eager from now on (its shapes last a few forwards).
    for seed in range(5, 8):
        anchors, starts = batch(seed, size=3)
        assert torch.equal(graphed(anchors, starts, buffers)[0], anchors * 2)
    assert graphed.graph is None and trunk.eager == 4
    # Equal shapes but new buffers: no graph either.
    anchors, starts = batch(9, size=3)
    assert torch.equal(graphed(anchors, starts, [object()])[1], starts + 1)
    assert graphed.graph is None and trunk.eager == 5


def test_a_capture_that_fails_leaves_the_trunk_eager_and_says_so(graphs_on_the_cpu):
    trunk = Trunk(fail_capture=True)
    graphed = trunk_graph.TrunkGraph(trunk)
    buffers = [object()]
    graphed(*batch(0), buffers)
    anchors, starts = batch(1)
    with pytest.warns(RuntimeWarning, match="not permitted when stream is capturing"):
        residual, _ = graphed(anchors, starts, buffers)
    assert torch.equal(residual, anchors * 2)
    assert "not permitted" in trunk_graph.GRAPH_FAILED
    other = trunk_graph.TrunkGraph(trunk)
    for seed in range(3):
        other(*batch(seed), buffers)
    assert trunk.eager == 2 + 3 and other.graph is None


def test_the_cpu_runs_the_trunk_eager():
    trunk = Trunk()
    graphed = trunk_graph.TrunkGraph(trunk)
    for seed in range(3):
        graphed(*batch(seed), [])
    assert trunk.eager == 3 and graphed.graph is None
