"""Server settings under which a memory-saver release would lose the server or its requests, refused by
eval.yml before the pause, each named with its fix in one refusal; the server untouched.

- `--weight-cache-mode` other than off: a release of the weights raises inside SGLang's scheduler, which
  takes the server down (sglang 0.5.23 srt/managers/scheduler_components/weight_updater.py:293-307, 368-369);
- `SGLANG_REQ_WAITING_TIMEOUT` shorter than the window: requests retracted at the pause are aborted with
  503 while they wait (0.5.23 srt/managers/scheduler.py:2195-2203, 3605-3620);
- SGLang 0.5.4's pause aborts every request in flight, also one admitted after `/get_load` read 0
  (0.5.4 srt/managers/tokenizer_manager.py:1090-1093, scheduler.py:2363-2385): refused unless drained
  through the router or accepted by name.
"""

from __future__ import annotations

import re

import pytest
from conftest import API_KEY, MEMORY_SAVER, LocalDefault, free_port

KEYS = MEMORY_SAVER["sglang_service_extra_args"]


def said(result) -> str:
    return " ".join(result.output.split()).replace("''", "'")


@pytest.fixture(scope="module")
def site(tmp_path_factory, host_cache_dir, served):
    """A server of its own, 0.5.23 with the weight cache on and a waiting timeout of one second; the
    completions of the shared finished run, so each play goes straight to its window."""
    work_dir = tmp_path_factory.mktemp("refusals")
    settings = {
        **MEMORY_SAVER,
        "sglang_service_extra_args": [
            *MEMORY_SAVER["sglang_service_extra_args"],
            "--weight-cache-mode",
            "daemon",
        ],
        "sglang_service_environment": {"SGLANG_REQ_WAITING_TIMEOUT": "1"},
    }
    site = LocalDefault(work_dir=work_dir, port=free_port(), host_cache_dir=host_cache_dir, settings=settings)
    started = site.play("service.yml", sglang_service_state="started")
    assert started.rc == 0, started.output[-4000:]
    site.seed_run_dir(served.run_dir, work_dir / "run")
    yield site
    site.play("service.yml", sglang_service_state="stopped", sglang_service_guard=False, timeout=120)


def assert_untouched(site, result, pid):
    assert result.rc != 0
    assert "specops stage 'release-server' failed" in said(result), result.output[-4000:]
    assert site.server_pid() == pid
    assert site.health_generate_status() == 200
    assert not (site.work_dir / "sglang.pid.d" / "window.lock").exists()


def test_a_weight_cache_and_a_waiting_timeout_are_named_at_once_before_the_pause(site):
    pid = site.server_pid()
    result = site.play("eval.yml", specops_run_dir=str(site.work_dir / "run"), sglang_service_release="all")
    assert_untouched(site, result, pid)
    named = said(result)
    assert "2 problems, each to fix: (1) " in named, result.output[-4000:]
    assert re.search(r"\(1\) [^;]*SGLANG_REQ_WAITING_TIMEOUT=1: requests retracted at the pause", named)
    assert re.search(r"\(2\) [^;]*--weight-cache-mode daemon.*sglang_service_release: kv_cache", named)


def test_the_abort_only_pause_of_0_5_4_is_refused_unless_drained_or_accepted(site):
    # 0.5.4 has no admin key (its server refuses the option) and reads no waiting timeout.
    args = ["--api-key", API_KEY, "--sglang-version", "0.5.4"]
    # The serve stage starts the server again with these options; the window then refuses its release.
    result = site.play(
        "eval.yml",
        specops_run_dir=str(site.work_dir / "run"),
        sglang_service_extra_args=args,
        sglang_service_admin_api_key="",
        sglang_service_environment={},
    )
    assert_untouched(site, result, site.server_pid())
    named = said(result)
    assert re.search(r"runs SGLang 0\.5\.4, whose pause aborts every request in flight", named), (
        result.output[-4000:]
    )
    assert "sglang_service_accept_abort_pause: true" in named and "sglang_router_url" in named
