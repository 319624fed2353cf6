"""Extraction over several devices writes the single-device states: data-parallel workers and split layers.

CPU "devices" stand in for GPUs: the workers are real processes, the split model really runs layer by
layer through the placement's hooks. Workers compute with one thread each, so the reference does too
(float sums in another order differ in the last bit).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from specops import extract
from specops.extract import parallel as extract_parallel
from specops.hidden_states import open_hidden_states
from specops.stage import StageError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def completions(tmp_path_factory) -> Path:
    """Twelve records of different lengths; their tokens do not matter, only that the runs agree on them."""
    rng = random.Random(0)
    directory = tmp_path_factory.mktemp("completions")
    lines = [
        json.dumps(
            {
                "id": f"r{n}",
                "prompt_ids": [rng.randrange(1, 400) for _ in range(4 + n)],
                "output_ids": [rng.randrange(1, 400) for _ in range(3 + 2 * n)],
            }
        )
        for n in range(12)
    ]
    (directory / "completions.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def request(fixture_models, completions, out_dir, **overrides):
    return {
        "target": str(fixture_models.target),
        "completions": str(completions),
        "out_dir": str(out_dir),
        "drafter": str(fixture_models.drafter),
        "shard_tokens": 40,
        "device": "cpu",
        **overrides,
    }


def states(directory: Path) -> dict[str, torch.Tensor]:
    return {",".join(map(str, ids.tolist())): hidden for _, ids, hidden in open_hidden_states(directory)}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single(fixture_models, completions, tmp_path_factory) -> dict[str, torch.Tensor]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out_dir = tmp_path_factory.mktemp("single")
        result = extract.run(request(fixture_models, completions, out_dir))
    finally:
        torch.set_num_threads(threads)
    assert result["parallel"]["mode"] == "single"
    return states(out_dir)


def assert_same_states(directory: Path, reference: dict[str, torch.Tensor]) -> None:
    found = states(directory)
    assert sorted(found) == sorted(reference)
    for key, hidden in found.items():
        assert torch.equal(hidden, reference[key]), key


def test_two_workers_write_the_single_device_states(fixture_models, completions, single, tmp_path):
    result = extract.run(
        request(fixture_models, completions, tmp_path, devices=["cpu", "cpu"], parallel="data")
    )
    assert_same_states(tmp_path, single)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assignment = manifest["progress"]["assignment"]
    assert sorted(assignment) == ["cpu#0", "cpu#1"] and all(assignment.values())
    assert sorted(n for names in assignment.values() for n in names) == result["shards"]
    assert manifest["parallel"]["mode"] == "data" and manifest["parallel"]["devices"] == ["cpu", "cpu"]
    assert sorted(manifest["backend"]["per_device"]) == ["cpu#0", "cpu#1"]
    assert not (tmp_path / extract.STATE_NAME).exists()


def test_split_over_two_devices_writes_the_single_device_states(
    fixture_models, completions, single, tmp_path, one_thread
):
    result = extract.run(
        request(
            fixture_models, completions, tmp_path, devices=["cpu", "cpu"], parallel="split", parity_samples=1
        )
    )
    assert_same_states(tmp_path, single)
    # The drafter's layers are 1, 3, 5: layers 6 and 7 are not built, 0-5 are shared by the two devices.
    assert result["parallel"]["layers"] == [
        {"device": "cpu", "layers": [0, 1, 2]},
        {"device": "cpu", "layers": [3, 4, 5]},
    ]
    assert result["parity"]["passed"] is True


def test_the_plan_reports_the_choice_without_running(fixture_models, completions, tmp_path):
    planned = extract.plan(request(fixture_models, completions, tmp_path, devices=["cpu", "cpu"]))
    assert planned["changed"] is True and planned["parallel"]["mode"] == "data"
    assert not list(tmp_path.iterdir())


class DieAfterFirstShard:
    """Passes the worker's messages on and ends the process right after its first finished shard.

    The runs that use it write with one writer thread: with several, a smaller shard on another thread can
    finish before the largest, and two threads can report a shard each before the process ends.
    """

    def __init__(self, results):
        self.results = results

    def put(self, message):
        self.results.put(message)
        if message[0] == "shard":
            self.results.close()
            self.results.join_thread()  # the message is in the pipe before the process ends
            os._exit(3)


def dying_worker(task, results, start):
    extract_parallel.data_worker(task, DieAfterFirstShard(results), start)


def finished_shards(directory: Path) -> list[str]:
    saved = json.loads((directory / extract.STATE_NAME).read_text())
    return sorted(saved["shards"])


def test_a_dead_worker_fails_the_run_and_one_device_resumes_it(
    fixture_models, completions, single, tmp_path, monkeypatch, one_thread
):
    monkeypatch.setattr(extract_parallel, "WORKER", dying_worker)
    with pytest.raises(StageError, match=r"the worker on cpu died \(exit code 3\).* a rerun resumes"):
        extract.run(
            request(
                fixture_models,
                completions,
                tmp_path,
                devices=["cpu", "cpu"],
                parallel="data",
                writer_threads=1,
            )
        )
    kept = finished_shards(tmp_path)
    assert kept and not (tmp_path / "manifest.json").exists()
    monkeypatch.undo()

    result = extract.run(request(fixture_models, completions, tmp_path))
    assert result["progress"]["shards_resumed"] == len(kept)
    assert_same_states(tmp_path, single)


def test_a_run_on_one_device_resumes_on_two(fixture_models, completions, single, tmp_path, monkeypatch):
    monkeypatch.setattr(extract_parallel, "WORKER", dying_worker)
    req = request(fixture_models, completions, tmp_path, devices=["cpu"], parallel="data", writer_threads=1)
    # The exit code says the worker ended where the test ends it, not for a reason of its own.
    with pytest.raises(StageError, match=r"the worker on cpu died \(exit code 3\)"):
        extract.run(req)
    largest = min(extract.prepare(req).shards, key=lambda s: (-s.num_tokens, s.name))
    assert finished_shards(tmp_path) == [largest.name]  # the shard with the most tokens goes first
    monkeypatch.undo()

    result = extract.run(
        request(fixture_models, completions, tmp_path, devices=["cpu", "cpu"], parallel="data")
    )
    assert result["progress"]["shards_resumed"] == 1
    assert_same_states(tmp_path, single)
