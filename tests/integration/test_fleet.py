"""A rolling evaluation of three development servers behind a real sglang-router, with user traffic
sent through the router the whole time: no request fails and every host is back behind the router."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fleet_site import HOSTS, REPO, LocalFleet  # noqa: E402

ML_PYTHON = REPO / ".venv-ml" / "bin" / "python"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    # The models the other integration tests build, shared: building them takes a while.
    models = Path(os.environ.get("SPECOPS_TEST_MODELS", REPO / ".work" / "test-models"))
    site = LocalFleet(work_dir=tmp_path_factory.mktemp("fleet"), models_dir=models)
    site.build_models(ML_PYTHON)
    try:
        site.start()
        yield site
    finally:
        site.stop()


@pytest.fixture(scope="module")
def rolling_run(fleet):
    fleet.start_load("rolling")
    result = fleet.play("eval.yml")
    load = fleet.stop_load("rolling")
    return result, load


def test_rolling_evaluation_succeeds_on_every_host(rolling_run):
    result, _ = rolling_run
    assert result.rc == 0, result.output[-6000:]
    assert set(result.recap) >= {"replica1", "replica2", "replica3"}
    assert not any(counts["failed"] for counts in result.recap.values())


def test_no_request_sent_through_the_router_fails_during_the_rollout(rolling_run):
    _, load = rolling_run
    assert load["requests"] > 0
    assert load["failed"] == 0, load["failures"]


def test_every_host_returns_to_the_router_healthy(rolling_run, fleet):
    assert fleet.healthy_workers() == set(fleet.worker_urls)


def test_hosts_take_their_windows_one_at_a_time(rolling_run, fleet):
    report = json.loads((fleet.work_dir / "replica1" / "run" / "fleet" / "report.json").read_text())
    windows = sorted(
        (row["window"]["started_at"], row["window"]["returned_at"]) for row in report["per_host"]
    )
    assert len(windows) == 3
    assert all(earlier[1] <= later[0] for earlier, later in zip(windows, windows[1:], strict=False))


def test_one_report_merges_every_hosts_share_of_the_prompts(rolling_run, fleet):
    report = json.loads((fleet.work_dir / "replica1" / "run" / "fleet" / "report.json").read_text())
    prompts = [
        json.loads(line)["id"]
        for line in (REPO / "prompts" / "coding.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert sorted(row["id"] for row in report["per_prompt"]) == sorted(prompts)
    assert {row["host"] for row in report["per_prompt"]} == {"replica1", "replica2", "replica3"}
    assert report["fleet"]["sum_window_s"] > 0 and report["fleet"]["wall_s"] > 0
    assert all(row["window"]["downtime_s"] > 0 for row in report["per_host"])


def test_an_unreachable_router_fails_before_any_host_is_drained(rolling_run, fleet, tmp_path):
    pids = {host: (fleet.work_dir / host / "sglang.pid").read_text() for host in HOSTS}
    result = fleet.play(
        "eval.yml", sglang_router_url="http://127.0.0.1:9", specops_fleet_work_dir=str(fleet.work_dir)
    )
    assert result.rc != 0
    assert "cannot be reached" in result.output and "no host was drained" in result.output
    assert "Drain the host" not in result.output
    assert {host: (fleet.work_dir / host / "sglang.pid").read_text() for host in pids} == pids


def test_a_host_that_fails_its_window_is_put_back_and_the_rollout_stops(rolling_run, fleet, tmp_path):
    # Truncated weights pass the plan and fail only when the extraction loads them. Started ahead of
    # the window, the extraction fails while preparing, before the stop (test_refused_before_the_stop);
    # extracting inside the window, it fails there, on the first host. The hosts after it are never drained.
    good = fleet.models_dir / "target"
    broken = tmp_path / "truncated-target"
    shutil.copytree(good, broken)
    weights = broken / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    pids = {host: (fleet.work_dir / host / "sglang.pid").read_text() for host in HOSTS}
    fleet.start_load("failing")
    result = fleet.play(
        "eval.yml",
        specops_run_dir="{{ specops_work_dir }}/run-broken",
        specops_target_model=str(broken),
        sglang_service_model_path=str(good),
        specops_prestart_extraction=False,
    )
    load = fleet.stop_load("failing")
    assert result.rc != 0
    assert "specops stage 'extract' failed" in result.output, result.output[-4000:]
    assert (fleet.work_dir / "replica1" / "sglang.pid").read_text() != pids["replica1"]
    assert {h: (fleet.work_dir / h / "sglang.pid").read_text() for h in HOSTS[1:]} == {
        h: pids[h] for h in HOSTS[1:]
    }
    assert fleet.healthy_workers() == set(fleet.worker_urls)
    assert load["failed"] == 0, load["failures"]


def host_files(fleet, hosts) -> dict[str, tuple[int, int]]:
    """Every file under the hosts' work directories (size, mtime), the servers' own logs left out."""
    return {
        str(path.relative_to(fleet.work_dir)): (path.stat().st_size, path.stat().st_mtime_ns)
        for host in hosts
        for path in (fleet.work_dir / host).rglob("*")
        if path.is_file() and path.name != "sglang.log"
    }


def test_check_mode_on_a_fresh_two_host_fleet_passes_and_touches_nothing(fleet, tmp_path):
    # Fresh hosts behind the router: no run directory, no ML environment, no cache directory yet. The
    # servers run with a Python of their own, as SGLang does before specops ever came to the host.
    fresh = {
        "specops_run_dir": "{{ specops_work_dir }}/run-check",
        "fla_env_venv": str(tmp_path / "ml"),
        "specops_host_cache_dir": str(tmp_path / "cache"),
        "sglang_service_python": str(REPO / ".venv-ml" / "bin" / "python"),
    }
    hosts = ("replica1", "replica2")
    pids = {host: fleet.server_pid(host) for host in HOSTS}
    files = host_files(fleet, hosts)
    result = fleet.play("eval.yml", args=("--check", "--limit", ",".join(hosts)), **fresh)
    assert result.rc == 0, result.output[-6000:]
    assert set(result.recap) == set(hosts) and not any(c["failed"] for c in result.recap.values())
    # Each host's share of the prompts is planned without the ML environment; nothing after it can be.
    said = " ".join(result.output.split()).replace("''", "'")  # YAML doubles quotes in quotes
    assert said.count("check mode: the ML environment is not built yet, so nothing after") == len(hosts)
    assert "check mode: the hosts' reports are not merged" in said
    assert not any((fleet.work_dir / host / "run-check").exists() for host in hosts)
    assert not (tmp_path / "ml").exists() and not (tmp_path / "cache").exists()
    assert host_files(fleet, hosts) == files
    assert {host: fleet.server_pid(host) for host in HOSTS} == pids
    assert fleet.healthy_workers() == set(fleet.worker_urls)
