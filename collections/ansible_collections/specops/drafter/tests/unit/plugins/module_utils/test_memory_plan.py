# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The memory plan: the weights stay on the GPU where the extraction fits beside them, else every tag with
the backup; a forced choice that cannot work is refused with its figures; each version's tags."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import pytest

from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError
from ansible_collections.specops.drafter.plugins.module_utils.window.memory_plan import (
    expected_used_after,
    plan_release,
    server_memory,
)

GIB = 1 << 30


def info_0_5_23(weight=29.4, kvcache=92.0, graph=1.4, available=16.0, backup=True):
    # sglang 0.5.23 srt/managers/scheduler_components/memory_usage.py:15-43: GB, graph per phase.
    return {"version": "0.5.23", "enable_weights_cpu_backup": backup,
            "internal_states": [{"memory_usage": {"weight": weight, "kvcache": kvcache, "startup_available": available,
                                                  "token_capacity": 1, "graph": {"decode": graph}}}]}


def info_0_5_4(weight=29.4, kvcache=92.0, graph=1.4, backup=True):
    # sglang 0.5.4 srt/managers/scheduler.py:2389-2399: graph is one number, no startup_available.
    return {"version": "0.5.4", "enable_weights_cpu_backup": backup,
            "internal_states": [{"memory_usage": {"weight": weight, "kvcache": kvcache, "token_capacity": 1,
                                                  "graph": graph}}]}


H200 = [{"index": "0", "total_mib": 143771, "used_mib": 126000}]
EXTRACTION_14B = {"copy_bytes": 30 * GIB, "body_bytes": 28 * GIB, "reserve_bytes": 6 * GIB}


def test_the_weights_stay_where_the_extraction_fits_beside_them():
    plan = plan_release(info_0_5_23(), H200, EXTRACTION_14B, "auto", 2048)
    assert plan["choice"] == "kv_cache"
    assert plan["tags"] == ["kv_cache", "cuda_graph"]
    assert plan["fits_beside_weights"] is True
    # 143771 - 126000 + (92.0 + 1.4) * 1024 - 2048
    assert plan["free_after_kv_release_mib"] == [111365]
    assert "weights stay on the GPU" in plan["reason"]


def test_version_0_5_4_releases_the_kv_cache_only_as_it_has_no_graph_tag():
    plan = plan_release(info_0_5_4(), H200, EXTRACTION_14B, "auto", 2048)
    assert plan["choice"] == "kv_cache" and plan["tags"] == ["kv_cache"]
    assert server_memory(info_0_5_4())["cuda_graph_mib"] == round(1.4 * 1024)


def test_a_gpu_too_small_for_weights_and_extraction_falls_back_to_the_backup_and_says_so():
    small = [{"index": "0", "total_mib": 81559, "used_mib": 75000}]
    plan = plan_release(info_0_5_23(kvcache=30.0), small, EXTRACTION_14B, "auto", 2048)
    assert plan["choice"] == "all" and plan["tags"] == []
    assert plan["fits_beside_weights"] is False
    assert "does not fit beside the weights" in plan["reason"] and "MiB free" in plan["reason"]


def test_a_forced_kv_cache_that_cannot_fit_is_refused_naming_the_figures():
    small = [{"index": "0", "total_mib": 81559, "used_mib": 75000}]
    with pytest.raises(ServiceError) as raised:
        plan_release(info_0_5_23(kvcache=30.0), small, EXTRACTION_14B, "kv_cache", 2048)
    assert "sglang_service_release=kv_cache cannot work" in raised.value.msg
    assert "the service was not touched" in raised.value.msg
    assert raised.value.fields["memory_plan"]["free_after_kv_release_mib"] == [36665]


def test_a_forced_full_release_needs_the_weights_backup():
    with pytest.raises(ServiceError) as raised:
        plan_release(info_0_5_23(backup=False), H200, EXTRACTION_14B, "all", 2048)
    assert "--enable-weights-cpu-backup" in raised.value.msg


def test_without_nvidia_smi_the_servers_own_free_figure_is_used():
    plan = plan_release(info_0_5_23(available=1.0, kvcache=40.0, graph=0.0), None, EXTRACTION_14B, "auto", 1024)
    assert plan["source"].startswith("the server's own accounting")
    assert plan["free_after_kv_release_mib"] == [1024 + 40960 - 1024]
    assert plan["choice"] == "kv_cache"


def test_unknown_needs_fall_back_to_the_backup_path():
    plan = plan_release(info_0_5_23(), H200, {}, "auto", 2048)
    assert plan["choice"] == "all"


def test_a_split_extraction_fits_over_two_gpus_when_no_single_one_has_room():
    two = [{"index": "0", "total_mib": 98304, "used_mib": 88000}, {"index": "1", "total_mib": 98304, "used_mib": 88000}]
    info = info_0_5_23(weight=27.0, kvcache=12.0, graph=0.0)
    need = {"copy_bytes": 40 * GIB, "body_bytes": 36 * GIB, "reserve_bytes": 2 * GIB}
    plan = plan_release(info, two, need, "auto", 512)
    assert plan["choice"] == "kv_cache" and "split over 2 GPUs" in plan["reason"]


def test_after_a_kv_release_the_check_expects_the_weights_to_stay():
    plan = plan_release(info_0_5_23(), H200, EXTRACTION_14B, "auto", 2048)
    bounds = expected_used_after(plan, H200)
    assert bounds == [{"index": "0", "max_used_mib": 126000 - (94208 + 1434) // 2}]
    full = plan_release(info_0_5_23(), H200, {}, "auto", 2048)
    assert expected_used_after(full, H200) is None
