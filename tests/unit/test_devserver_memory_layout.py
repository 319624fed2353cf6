"""The development server lays GPU memory out as SGLang does and reports it as each version does; the
client's table of what each SGLang release offers agrees with the server's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from specops.devserver.memory import parse_tags
from specops.devserver.memory_layout import GIB, UNSIZED_KV_CACHE_BYTES, lay_out, memory_usage
from specops.devserver.versions import VERSIONS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "collections"))
from ansible_collections.specops.drafter.plugins.module_utils.service.sglang_api import (  # noqa: E402
    RELEASES,
    has_pause_modes,
    release_facts,
)


def test_the_kv_pool_fills_the_static_fraction_after_the_weights():
    layout = lay_out(80 * GIB, 30 * GIB, 0.9)
    assert layout.kv_cache_bytes == int(80 * GIB * 0.9) - 30 * GIB
    assert 0 < layout.cuda_graph_bytes <= int(80 * GIB * 0.01)
    # Serving, the device is nearly full: what is left is the slack outside the static pool.
    assert layout.startup_available_bytes is not None and layout.startup_available_bytes < 8 * GIB


def test_weights_larger_than_the_static_fraction_are_refused_with_the_figures():
    with pytest.raises(ValueError, match="--mem-fraction-static 0.5 leaves no room for the KV cache"):
        lay_out(16 * GIB, 10 * GIB, 0.5)


def test_without_a_device_size_nothing_free_is_reported():
    layout = lay_out(None, 1 << 20, 0.88)
    assert layout.kv_cache_bytes == UNSIZED_KV_CACHE_BYTES and layout.startup_available_bytes is None
    assert "startup_available" not in memory_usage(layout, VERSIONS["0.5.23"])


def test_each_version_reports_memory_usage_in_its_own_shape():
    layout = lay_out(24 * GIB, 2 * GIB, 0.88)
    new = memory_usage(layout, VERSIONS["0.5.23"])
    old = memory_usage(layout, VERSIONS["0.5.4"])
    # 0.5.23 srt/managers/scheduler_components/memory_usage.py:15-43: graph per phase, startup_available.
    assert isinstance(new["graph"], dict) and "startup_available" in new
    # 0.5.4 srt/managers/scheduler.py:2389-2399: graph is one number, no startup_available.
    assert isinstance(old["graph"], float) and "startup_available" not in old
    assert new["weight"] == pytest.approx(2.0, abs=0.01) and new["kvcache"] == pytest.approx(
        24 * 0.88 - 2, abs=0.01
    )


def test_an_unknown_tag_is_accepted_as_sglang_accepts_it():
    # 0.5.23 weight_updater.py:348-349 and 0.5.4 scheduler_update_weights_mixin.py:109-110 add any tag.
    assert parse_tags({"tags": ["weights_drafter"]}) == {"weights_drafter"}
    assert parse_tags({"tags": []}) is None


@pytest.mark.parametrize("name", sorted(VERSIONS))
def test_the_clients_release_table_agrees_with_the_servers(name):
    server = VERSIONS[name]
    client = release_facts(name)
    assert tuple(client["all_tags"]) == server.all_tags
    assert client["pause_modes"] == ("retract" in server.pause_modes) == has_pause_modes(name)
    assert any(".".join(map(str, first)) == name for first, _ in RELEASES)
