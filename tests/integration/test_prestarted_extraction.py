"""eval.yml starts the extraction before the stop, lets it go inside the window, and aborts it when the
window fails before go: no extraction is left waiting."""

from __future__ import annotations

import json
import shutil
import threading
import time
from datetime import datetime
from pathlib import Path


def read_state(signal: Path) -> dict:
    try:
        return json.loads(signal.with_name(signal.name + ".state").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def watch_waiting(site, signal: Path, stop: threading.Event, seen: dict) -> None:
    """The first time the extraction says waiting, ask the server whether it still answers."""
    while not stop.is_set():
        state = read_state(signal)
        if state.get("state") == "waiting" and "health" not in seen:
            seen.update(state=state, health=site.health_generate_status())
        time.sleep(0.05)


def is_extraction(pid: int) -> bool:
    """pid runs the extraction: started anew (its command line) or forked by a stage host (its name)."""
    try:
        return b"specops.extract" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") or (
            Path(f"/proc/{pid}/comm").read_text().strip() == "specops.extract"
        )
    except OSError:
        return False


def test_extraction_waits_before_the_stop_goes_in_the_window_and_is_aborted_by_a_failure(
    local_default, tmp_path
):
    site = local_default
    run_dir = tmp_path / "run"
    signal, seen, stop = run_dir / "extract.start", {}, threading.Event()
    watcher = threading.Thread(target=watch_waiting, args=(site, signal, stop, seen), daemon=True)
    watcher.start()
    try:
        result = site.play("eval.yml", timeout=1800, specops_run_dir=str(run_dir))
    finally:
        stop.set()
        watcher.join()
    assert result.rc == 0, result.output[-6000:]

    # It waited while the service still answered, before the window opened.
    assert seen.get("health") == 200, seen
    report = json.loads((run_dir / "score" / "report.json").read_text())
    window = report["window"]
    assert seen["state"]["at"] < datetime.fromisoformat(window["down_at"].replace("Z", "+00:00")).timestamp()
    # The record splits the extraction: before the window, and after go inside it.
    prestart = window["extraction"]["prestart"]
    assert set(prestart) == {
        "before_load_s",
        "host_load_s",
        "waited_s",
        "to_device_s",
        "host_memory",
        # When it saw go, and its set-up from then to the weights' copy: the window record's accounting.
        "go_seen_at",
        "setup_s",
    }
    assert prestart["waited_s"] > 0
    assert "started before the window and waited for it" in (run_dir / "score" / "report.md").read_text()

    # A window that fails before go (here: the GPU release) aborts the waiting extraction.
    failed_dir = tmp_path / "failed"
    shutil.copytree(run_dir / "completions", failed_dir / "completions")  # up to date: no second prefetch
    failed = site.play("eval.yml", specops_run_dir=str(failed_dir), gpu_release_grace=-1)
    assert failed.rc != 0
    assert "specops stage 'release-gpus' failed" in failed.output, failed.output[-4000:]
    state = read_state(failed_dir / "extract.start")
    assert state["state"] == "stopped" and "abort" in state["reason"]
    assert not is_extraction(state["pid"])
    assert not (failed_dir / "hidden_states").exists()
    assert site.health_generate_status() == 200
