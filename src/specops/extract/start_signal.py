"""Start an extraction before its GPU window and hold it until the window opens.

With `start_signal: <path>` in its request, the extraction does everything that needs no GPU memory
while the service still serves (process start, imports, inputs, plan, the target's weights in host
memory), writes the state "waiting" and waits for the play's signal. The play writes the signal file
atomically, one JSON object:

    {"signal": "wait", "until": <epoch s>}   keep waiting until then (a lease the play renews)
    {"signal": "go"}                         the GPUs are free: move the weights on and extract
    {"signal": "abort"}                      the window will not open: exit

The extraction exits without touching the GPU's memory and without writing any output on "abort",
when the lease runs out (a play lost before the window cannot leave it waiting) or when the signal
file is gone. Its state goes to `<signal>.state` (preparing, waiting, started, stopped, finished), with
its pid, so the play can tell when it waits and stop one that outlives an abort.

"finished" is the window's end on the host: the outputs are on disk and the device has its memory back,
so the guard resumes the server then, while this process exits (giving back tens of GiB of pinned host
memory takes seconds at exit, which the service no longer waits for).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specops import devices
from specops.manifest import atomic_write_json
from specops.stage import StageError, log

GO, WAIT, ABORT, GONE = "go", "wait", "abort", "gone"
STATE_SUFFIX = ".state"
FINISHED = "finished"
POLL_S = 0.05
# The most device memory still reserved when the extraction says finished (specops.devices).
MAX_RESERVED_WHEN_FINISHED = devices.MAX_RESERVED_WHEN_FINISHED


class NotStarted(StageError):
    """The window did not open for this extraction: it exits having written nothing."""


def state_path(signal: Path) -> Path:
    return signal.with_name(signal.name + STATE_SUFFIX)


def read_signal(path: Path) -> tuple[str, float | None]:
    """The play's signal and the lease's end (epoch seconds, for "wait")."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return GONE, None
    except (OSError, json.JSONDecodeError):
        # The play writes atomically: a file that does not parse was not written by it.
        return ABORT, None
    if not isinstance(value, dict) or value.get("signal") not in (GO, WAIT, ABORT):
        return ABORT, None
    until = value.get("until")
    return value["signal"], float(until) if isinstance(until, int | float) else None


def wait_for_go(
    path: Path,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = POLL_S,
) -> float:
    """Block until the signal says go; seconds waited. NotStarted on abort, an expired lease or no file."""
    started = clock()
    while True:
        signal, until = read_signal(path)
        if signal == GO:
            return clock() - started
        if signal == ABORT:
            raise NotStarted(
                f"not started: {path} says abort (the window will not open); nothing was written"
            )
        if signal == GONE:
            raise NotStarted(f"not started: the start signal {path} is gone; nothing was written")
        if until is None or clock() >= until:
            raise NotStarted(
                f"not started: the lease in {path} ran out without a go (the play that "
                "started this extraction is gone); nothing was written"
            )
        sleep(poll_s)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux), so the record covers imports too."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


def write_state(path: Path, state: str, **figures: Any) -> None:
    atomic_write_json(state_path(path), {"state": state, "pid": os.getpid(), "at": time.time(), **figures})


@dataclass
class Held:
    """The target on the host (or, where the host has no room for it, how to load it), and what
    holding it cost before the window."""

    model: Any
    figures: dict[str, Any]
    load_on: Callable[[Any], Any] | None = None  # device -> model, for weights not held ahead

    def on_device(self, device: Any) -> Any:
        """Move the weights host -> device: the only load left inside the window."""
        started = time.perf_counter()
        if self.model is None and self.load_on is not None:
            model = self.load_on(device)  # from the files, through the page cache
        else:
            # From pinned host memory the copy runs at the link's speed, several times pageable's.
            model = self.model.to(device, non_blocking=bool(self.figures.get("pinned")))
        if getattr(device, "type", "cpu") == "cuda":
            import torch

            torch.cuda.synchronize(device)
        self.figures["to_device_s"] = round(time.perf_counter() - started, 3)
        return model


def pin_weights(model: Any) -> bool:
    """Move the module's tensors into pinned host memory; False (left pageable) if the host refuses.

    Pinned memory is page-locked: the whole target stays resident until the extraction ends.
    """
    try:
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.pin_memory()
    except RuntimeError as refused:  # page-locking is limited (ulimit -l, cgroup memory)
        log(f"weights stay in pageable memory: pinning failed ({refused})")
        return False
    return True


def device_ready(device: Any) -> float:
    """Create the CUDA context and the allocator's first block before the window (seconds): a few hundred
    MiB that a serving server leaves free, and a second or more the window does not pay."""
    import torch

    started = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device=device)
    torch.cuda.synchronize(device)
    return round(time.perf_counter() - started, 3)


def hold(prep: Any, load: Callable[[Any], Any], host_memory: dict[str, Any] | None = None) -> Held | None:
    """With a start signal: the target in host memory, then wait for go (None without one).

    `prep` is the extraction's prepared request; `load(prep)` loads the target on prep.device.
    host_memory: the host memory plan; where it says pageable, the weights are not held ahead (the
    host has no room for them beside what the window needs) and load inside the window instead.
    """
    if not prep.req.get("start_signal"):
        return None
    import torch

    path = Path(prep.req["start_signal"])
    before_load = process_age_s()
    write_state(path, "preparing", before_load_s=before_load)
    figures: dict[str, Any] = {"before_load_s": None if before_load is None else round(before_load, 3)}
    if host_memory is not None:
        figures["host_memory"] = host_memory
    if host_memory is not None and host_memory.get("weights") == "pageable":
        log(host_memory["msg"])
        return _wait(path, figures, lambda device: load(dataclasses.replace(prep, device=device)))
    started = time.perf_counter()
    model = load(dataclasses.replace(prep, device=torch.device("cpu")))
    figures["host_load_s"] = host_load = round(time.perf_counter() - started, 3)
    if getattr(prep.device, "type", "cpu") == "cuda":
        started = time.perf_counter()
        figures["pinned"] = pin_weights(model)
        figures["pin_s"] = round(time.perf_counter() - started, 3)
        # In a memory-saver window the server keeps the GPU's context and leaves room beside it; a stop
        # window frees every holder but this process, which then must hold no GPU memory.
        if prep.req.get("window_mode") == "memory_saver":
            figures["device_ready_s"] = device_ready(prep.device)
    log(f"prepared in {before_load or 0:.1f}s + {host_load:.1f}s (weights in host memory)")
    return _wait(path, figures, model=model)


def _wait(
    path: Path, figures: dict[str, Any], load_on: Callable[[Any], Any] | None = None, model: Any = None
) -> Held:
    """Say "waiting", wait for go, say "started" (or "stopped", raising NotStarted)."""
    write_state(path, "waiting", **figures)
    log(f"waiting for go in {path}")
    try:
        figures["waited_s"] = round(wait_for_go(path), 3)
        figures["go_seen_at"] = time.time()
    except NotStarted as stopped:
        write_state(path, "stopped", reason=str(stopped), **figures)
        raise
    write_state(path, "started", **figures)
    return Held(model, figures, load_on)


def say_finished(path: Path, held: Held, device: Any) -> bool:
    """The outputs are durable: drop the target, give the device its memory back and say "finished".

    The caller holds no reference to the model any more. False (nothing said) where the device keeps
    more than MAX_RESERVED_WHEN_FINISHED: the window then ends with the process, as without a signal.
    """
    started = time.perf_counter()
    held.model = None
    held.load_on = None
    reserved = devices.release_device(device)
    figures = {**held.figures, "device_release_s": round(time.perf_counter() - started, 3)}
    if reserved > MAX_RESERVED_WHEN_FINISHED:
        log(f"the device still holds {reserved >> 20} MiB of this extraction: the window ends with its exit")
        return False
    write_state(path, FINISHED, finished_at=time.time(), device_reserved_bytes=reserved, **figures)
    return True
