"""Faults a test injects into /release_memory_occupation, each ending as it ends on SGLang.

`--release-fault-file PATH`: before each release the server reads PATH (absent or empty: no fault):
- `busy`: the release meets a scheduler that is not idle. sglang 0.5.23 asserts idleness
  (srt/managers/scheduler_components/weight_updater.py:339); the assertion ends the scheduler, which
  SIGQUITs the launcher (managers/scheduler.py:6370-6373), and the launcher kills the tree and itself
  (process_tree.py): the caller gets no answer and the server is gone.
- `unanswered`: the release happens, but its answer never reaches the caller (a client timeout, a
  proxy that drops the connection): the connection closes without a response.
- `lost`: the connection closes before the release reaches the scheduler: nothing is released.
Read at each release, so that a test changes the fault between calls without restarting the server.
"""

from __future__ import annotations

from pathlib import Path

FAULTS = ("busy", "unanswered", "lost")


def release_fault(path: str | None) -> str | None:
    """The fault to inject into this release, or None."""
    if not path:
        return None
    try:
        fault = Path(path).read_text().strip()
    except OSError:
        return None
    if fault and fault not in FAULTS:
        raise ValueError(f"{path} asks for release fault {fault!r}: use one of {', '.join(FAULTS)}")
    return fault or None
