"""The extraction's plan carries the host memory figures and refuses a host too small, loading nothing."""

from __future__ import annotations

import json
import threading
import time

import pytest
from test_extract import completions, request, target  # noqa: F401  (shared module fixtures)
from test_host_memory import meminfo_file

from specops import extract
from specops.extract.host_memory import GIB
from specops.extract.start_signal import state_path
from specops.manifest import load_manifest
from specops.stage import StageError

pytestmark = pytest.mark.slow
HUGE_SERVER = 54 * 10**9


def test_the_plan_carries_host_memory(fixture_models, completions, tmp_path):  # noqa: F811
    fake = meminfo_file(tmp_path, 256, 200)
    planned = extract.plan(
        request(
            fixture_models, completions, tmp_path / "hs", meminfo=str(fake), start_signal=str(tmp_path / "s")
        )
    )
    memory = planned["host_memory"]
    assert memory["weights"] == "pinned" and memory["available_bytes"] == 200 * 2**30
    assert memory["extraction_weights_bytes"] > 0 and memory["meminfo"] == str(fake)


def test_the_plan_refuses_a_host_without_room_for_the_servers_backup(fixture_models, completions, tmp_path):  # noqa: F811
    fake = meminfo_file(tmp_path, 64, 40)
    req = request(
        fixture_models,
        completions,
        tmp_path / "hs",
        meminfo=str(fake),
        window_mode="memory_saver",
        server_weights_bytes=HUGE_SERVER,
    )
    with pytest.raises(StageError, match="CPU backup of 50.3 GiB .* 40.0 GiB available"):
        extract.plan(req)
    assert not (tmp_path / "hs").exists()


def test_a_host_too_small_for_both_copies_holds_no_weights_ahead_and_extracts_the_same(
    fixture_models,
    completions,  # noqa: F811
    tmp_path,
):
    signal, out_dir = tmp_path / "start", tmp_path / "held"
    signal.write_text(json.dumps({"signal": "wait", "until": time.time() + 120}))
    settings = {
        "window_mode": "memory_saver",
        "server_weights_bytes": 50 * GIB,
        "host_memory_reserve_bytes": GIB,
    }
    req = request(fixture_models, completions, out_dir, start_signal=str(signal), **settings)
    # Room for the server's backup and the reserve, and for half of the target's weights beside them.
    weights = extract.plan({**req, "meminfo": str(meminfo_file(tmp_path, 256, 200))})["host_memory"][
        "extraction_weights_bytes"
    ]
    req["meminfo"] = str(meminfo_file(tmp_path, 128, 51 + weights / 2 / GIB))
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=extract.run(req)), daemon=True)
    thread.start()
    for _ in range(1200):
        state = json.loads(state_path(signal).read_text()) if state_path(signal).is_file() else {}
        if state.get("state") == "waiting":
            break
        time.sleep(0.05)
    if state.get("host_memory", {}).get("weights") != "pageable":
        signal.write_text(json.dumps({"signal": "abort"}))
    assert state["host_memory"]["weights"] == "pageable" and "host_load_s" not in state
    signal.write_text(json.dumps({"signal": "go"}))
    thread.join(120)
    plain = extract.run(request(fixture_models, completions, tmp_path / "plain"))
    assert load_manifest(out_dir)["files"] == load_manifest(tmp_path / "plain")["files"]
    assert plain["shards"] == outcome["result"]["shards"]
