"""start_signal: an extraction started before its window waits for go, and leaves nothing on anything else."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from test_extract import completions, request, target  # noqa: F401  (shared module fixtures)

from specops import extract
from specops.extract import start_signal
from specops.extract.start_signal import NotStarted, read_signal, state_path, wait_for_go
from specops.manifest import load_manifest

pytestmark = pytest.mark.slow


class FakeClock:
    """time.time and time.sleep for the waiting loop; `at` runs a step when the clock passes it."""

    def __init__(self, steps=()):
        self.now = 1000.0
        self.steps = sorted(steps, key=lambda step: step[0])

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        while self.steps and self.steps[0][0] <= self.now:
            self.steps.pop(0)[1]()


def write(path: Path, **value) -> None:
    """As the play writes a signal: atomically (a reader never sees a half-written file, which it
    would take for one the play did not write, that is an abort)."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(value))
    os.replace(part, path)


def test_go_ends_the_wait_and_says_how_long_it_waited(tmp_path):
    signal = tmp_path / "go"
    write(signal, signal="wait", until=2000)
    clock = FakeClock([(1003.0, lambda: write(signal, signal="go"))])
    waited = wait_for_go(signal, clock=clock.time, sleep=clock.sleep, poll_s=0.5)
    assert waited == pytest.approx(3.0)


def test_abort_ends_the_wait_without_starting(tmp_path):
    signal = tmp_path / "go"
    write(signal, signal="wait", until=2000)
    clock = FakeClock([(1001.0, lambda: write(signal, signal="abort"))])
    with pytest.raises(NotStarted, match="says abort"):
        wait_for_go(signal, clock=clock.time, sleep=clock.sleep, poll_s=0.5)


def test_an_expired_lease_ends_the_wait_at_its_deadline(tmp_path):
    signal = tmp_path / "go"
    write(signal, signal="wait", until=1010)
    clock = FakeClock()
    with pytest.raises(NotStarted, match="lease"):
        wait_for_go(signal, clock=clock.time, sleep=clock.sleep, poll_s=0.5)
    assert clock.now == pytest.approx(1010.0)


def test_a_renewed_lease_keeps_it_waiting_past_the_first_deadline(tmp_path):
    signal = tmp_path / "go"
    write(signal, signal="wait", until=1010)
    clock = FakeClock(
        [
            (1005.0, lambda: write(signal, signal="wait", until=1100)),
            (1050.0, lambda: write(signal, signal="go")),
        ]
    )
    assert wait_for_go(signal, clock=clock.time, sleep=clock.sleep, poll_s=0.5) == pytest.approx(50.0)


def test_a_removed_signal_file_ends_the_wait(tmp_path):
    signal = tmp_path / "go"
    write(signal, signal="wait", until=2000)
    clock = FakeClock([(1002.0, signal.unlink)])
    with pytest.raises(NotStarted, match="gone"):
        wait_for_go(signal, clock=clock.time, sleep=clock.sleep, poll_s=0.5)


def test_a_signal_file_the_play_did_not_write_reads_as_abort(tmp_path):
    signal = tmp_path / "go"
    signal.write_text("go")
    assert read_signal(signal) == (start_signal.ABORT, None)


def run_in_thread(req):
    outcome: dict = {}

    def target_run():
        try:
            outcome["result"] = extract.run(req)
        except Exception as error:  # the test reads it
            outcome["error"] = error

    thread = threading.Thread(target=target_run)
    thread.start()
    return thread, outcome


def wait_for_state(signal: Path, state: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            current = json.loads(state_path(signal).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            current = {}
        if current.get("state") == state:
            return current
        time.sleep(0.05)
    raise AssertionError(f"the extraction never reached {state!r}")


def test_a_held_extraction_writes_nothing_until_go_then_the_same_shards(
    fixture_models,
    completions,  # noqa: F811
    tmp_path,
):
    plain = extract.run(request(fixture_models, completions, tmp_path / "plain"))
    signal, out_dir = tmp_path / "start", tmp_path / "held"
    write(signal, signal="wait", until=time.time() + 300)
    thread, outcome = run_in_thread(request(fixture_models, completions, out_dir, start_signal=str(signal)))
    waiting = wait_for_state(signal, "waiting")
    assert not out_dir.exists()
    assert waiting["host_load_s"] >= 0
    write(signal, signal="go")
    thread.join(120)
    assert "result" in outcome, outcome
    assert outcome["result"]["changed"] is True
    held, reference = load_manifest(out_dir), load_manifest(tmp_path / "plain")
    assert held["files"] == reference["files"] and plain["shards"] == outcome["result"]["shards"]
    assert set(held["progress"]["prestart"]) == {
        "before_load_s",
        "host_memory",
        "host_load_s",
        "waited_s",
        "to_device_s",
        # When it saw go, and its set-up from then to the weights' copy: the window record's accounting.
        "go_seen_at",
        "setup_s",
    }
    # Its end, said before the process exits: outputs written first, the device's memory given back.
    finished = json.loads(state_path(signal).read_text())
    assert finished["state"] == "finished" and finished["device_reserved_bytes"] == 0
    assert held["progress"]["loop_ended_at"] <= finished["finished_at"]


def test_finished_is_not_said_while_the_device_keeps_memory_of_the_extraction(tmp_path, monkeypatch):
    signal = tmp_path / "start"
    held = start_signal.Held(model=object(), figures={"go_seen_at": 1.0})
    monkeypatch.setattr(
        start_signal.devices, "release_device", lambda device: start_signal.MAX_RESERVED_WHEN_FINISHED + 1
    )
    assert start_signal.say_finished(signal, held, "cuda") is False
    assert not state_path(signal).exists() and held.model is None
    monkeypatch.setattr(start_signal.devices, "release_device", lambda device: 0)
    assert start_signal.say_finished(signal, held, "cuda") is True
    assert json.loads(state_path(signal).read_text())["state"] == "finished"


def test_an_aborted_extraction_leaves_no_output(fixture_models, completions, tmp_path):  # noqa: F811
    signal, out_dir = tmp_path / "start", tmp_path / "held"
    write(signal, signal="wait", until=time.time() + 300)
    thread, outcome = run_in_thread(request(fixture_models, completions, out_dir, start_signal=str(signal)))
    wait_for_state(signal, "waiting")
    write(signal, signal="abort")
    thread.join(60)
    assert isinstance(outcome["error"], NotStarted)
    assert not out_dir.exists()
    assert json.loads(state_path(signal).read_text())["state"] == "stopped"


def test_pinning_moves_every_weight_into_page_locked_memory_or_reports_that_it_could_not(monkeypatch):
    import torch

    model = torch.nn.Linear(4, 4)
    if torch.cuda.is_available():
        assert start_signal.pin_weights(model)
        assert all(p.is_pinned() for p in model.parameters())
        return

    def refuse(self):
        raise RuntimeError("cannot lock pages")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    assert start_signal.pin_weights(model) is False
    assert not model.weight.is_pinned()
