"""The host memory plan: pinned weights only where the host holds them beside what the window needs."""

from __future__ import annotations

from pathlib import Path

import pytest

from specops.extract.host_memory import GIB, Meminfo, plan_host_memory, read_meminfo
from specops.stage import StageError

QWEN36_27B = 54 * 10**9  # bf16 weights of the production target


def meminfo_file(tmp_path: Path, total_gib: float, available_gib: float) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(
        f"MemTotal:       {int(total_gib * 2**20)} kB\n"
        f"MemFree:        {int(available_gib * 2**20) // 2} kB\n"
        f"MemAvailable:   {int(available_gib * 2**20)} kB\n"
        "Cached:         1024 kB\n"
    )
    return path


def test_meminfo_is_read_in_bytes(tmp_path):
    found = read_meminfo(meminfo_file(tmp_path, 128, 100))
    assert (found.total, found.available) == (128 * GIB, 100 * GIB)


def test_an_unreadable_meminfo_is_named(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 1 kB\n")
    with pytest.raises(StageError, match="MemAvailable"):
        read_meminfo(tmp_path / "meminfo")


def test_a_host_too_small_for_both_copies_falls_back_to_pageable_weights_and_says_why(tmp_path):
    host = read_meminfo(meminfo_file(tmp_path, 128, 100))
    plan = plan_host_memory(QWEN36_27B, "memory_saver", True, "auto", host)
    assert plan["weights"] == "pageable"
    assert plan["server_cpu_backup_bytes"] == QWEN36_27B
    assert plan["pinned_needs_bytes"] == 2 * QWEN36_27B + plan["reserve_bytes"] > plan["available_bytes"]
    assert plan["pageable_needs_bytes"] <= plan["available_bytes"]
    assert "50.3 GiB pinned target weights + 50.3 GiB for the server's CPU backup" in plan["msg"]
    assert "100.0 GiB available): the weights stay pageable" in plan["msg"]


def test_required_pinning_on_a_host_too_small_is_refused_before_the_service_is_touched(tmp_path):
    host = read_meminfo(meminfo_file(tmp_path, 128, 100))
    with pytest.raises(StageError, match="host_weights is pinned, so the extraction is refused"):
        plan_host_memory(QWEN36_27B, "memory_saver", True, "pinned", host)


def test_a_host_without_room_for_the_servers_own_backup_is_refused(tmp_path):
    host = read_meminfo(meminfo_file(tmp_path, 64, 48))
    with pytest.raises(StageError, match="Use the stop window"):
        plan_host_memory(QWEN36_27B, "memory_saver", True, "auto", host)


def test_a_host_with_room_for_both_copies_pins(tmp_path):
    host = read_meminfo(meminfo_file(tmp_path, 256, 200))
    plan = plan_host_memory(QWEN36_27B, "memory_saver", True, "auto", host)
    assert plan["weights"] == "pinned"
    assert plan["reserve_bytes"] == int(0.05 * 256 * GIB)


def test_the_stop_window_keeps_page_cache_for_the_servers_restart():
    host = Meminfo(total=128 * GIB, available=100 * GIB, source="test")
    plan = plan_host_memory(QWEN36_27B, "stop", True, "auto", host)
    assert plan["server_cpu_backup_bytes"] == 0 and plan["restart_page_cache_bytes"] == QWEN36_27B
    assert plan["weights"] == "pageable" and "page cache for the server's restart" in plan["msg"]
    small = plan_host_memory(5 * 10**9, "stop", True, "auto", host)
    assert small["weights"] == "pinned"


def test_an_extraction_not_started_ahead_holds_nothing_before_the_window():
    host = Meminfo(total=256 * GIB, available=200 * GIB, source="test")
    plan = plan_host_memory(QWEN36_27B, "memory_saver", False, "auto", host)
    assert plan["weights"] == "pageable" and "not started ahead" in plan["reason"]


def test_the_served_model_may_differ_from_the_target():
    host = Meminfo(total=256 * GIB, available=200 * GIB, source="test")
    plan = plan_host_memory(5 * 10**9, "memory_saver", True, "auto", host, server_weights_bytes=QWEN36_27B)
    assert plan["server_cpu_backup_bytes"] == QWEN36_27B and plan["weights"] == "pinned"


def test_a_small_host_in_the_stop_window_is_not_refused():
    host = Meminfo(total=4 * GIB, available=2 * GIB, source="test")
    plan = plan_host_memory(10**9, "stop", True, "auto", host)
    assert plan["weights"] == "pageable"
