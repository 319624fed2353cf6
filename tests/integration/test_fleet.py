"""A rolling evaluation of two development servers behind a real sglang-router, with user traffic
sent through the router the whole time: no request fails and every host is back behind the router.

Two replicas show every rule of the rollout that three would (one at a time, a replica always serving,
a host found down, another lost inside a window) at two thirds of the servers, windows and stages. The
inventory's third replica serves behind the router outside the run and scores each host's share, out of
the router meanwhile. The last test has it join, and rolls new server options over all three."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fleet_site import HOSTS, REPO, LocalFleet, get_json  # noqa: E402

sys.path.insert(0, str(REPO / "collections"))
from ansible_collections.specops.drafter.plugins.module_utils.common import procfs  # noqa: E402

# The inventory's first two replicas: every play is limited to them.
FLEET = HOSTS[:2]
# The third serves outside the run and scores the rolling run's shares on its GPUs (here its CPU).
SCORING_REPLICA = HOSTS[2]

ML_PYTHON = REPO / ".venv-ml" / "bin" / "python"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    # The models the other integration tests build, shared: building them takes a while.
    models = Path(os.environ.get("SPECOPS_TEST_MODELS", REPO / ".work" / "test-models"))
    site = LocalFleet(work_dir=tmp_path_factory.mktemp("fleet"), models_dir=models, hosts=FLEET)
    site.build_models(ML_PYTHON)
    try:
        site.start()
        yield site
    finally:
        site.stop()


# User traffic through the whole rollout, paced. It lasts as long as the play, which a busy machine
# stretches: a 0.5 s pace sent 322 requests with this suite alone on 2 cores, about 1,500 beside the
# others. At 2 s, beside the others, 24 to 30 requests went out during each host's window.
PACED = 2.0


class ReplicaWatch(threading.Thread):
    """Every 0.25 s, whether the router lists a worker and whether its server accepts a connection."""

    def __init__(self, router_url: str, worker_url: str):
        super().__init__(daemon=True)
        self.router_url, self.worker_url = router_url, worker_url
        self.samples: list[tuple[float, bool, bool]] = []
        self.done = threading.Event()

    def run(self) -> None:
        port = int(self.worker_url.rsplit(":", 1)[1])
        while not self.done.is_set():
            try:
                listed = any(
                    w["url"] == self.worker_url for w in get_json(f"{self.router_url}/workers")["workers"]
                )
            except OSError:
                listed = True  # unknown: counted against the drain
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                up = True
            except OSError:
                up = False
            self.samples.append((time.time(), listed, up))
            self.done.wait(0.25)

    def down_periods(self) -> int:
        ups = [up for _, _, up in self.samples]
        return sum(1 for before, now in zip(ups, ups[1:], strict=False) if before and not now)


def scored_on_the_replica(fleet: LocalFleet, **overrides) -> dict:
    """The variables that score each host's share on the scoring replica (its CPU here)."""
    return {
        "specops_score_placement": "host",
        "specops_scoring_host": SCORING_REPLICA,
        "specops_scoring_device": "cpu",
        "specops_scoring_dir": str(fleet.work_dir / "scoring"),
        "specops_scoring_transit_dir": str(fleet.work_dir / "transit"),
        **overrides,
    }


@pytest.fixture(scope="module")
def rolling_run(fleet):
    # Replica1's server crashed before the run (outside any window): the router has stopped sending
    # to it, and the run finds it down when it reaches it. The first host: the other stays healthy
    # behind the router until replica1's drain, which needs it.
    # Each host's share is scored on the third replica (specops_score_placement: host), which serves behind
    # the router outside the run: it leaves the router for each scoring and comes back. It leaves the
    # router after the run, so that the tests after this one see the two replicas they know.
    fleet.serve_outside(SCORING_REPLICA)
    scoring_url = fleet.replica_url(SCORING_REPLICA)
    scoring_pid = fleet.server_pid(SCORING_REPLICA)
    fleet.crashed = {"replica1": fleet.kill_server("replica1")}
    watch = ReplicaWatch(fleet.router_url, scoring_url)
    watch.start()
    fleet.start_load("rolling", interval=PACED)
    result = fleet.play("eval.yml", **scored_on_the_replica(fleet))
    load = fleet.stop_load("rolling")
    watch.done.set()
    watch.join()

    def seen() -> SimpleNamespace:
        return SimpleNamespace(
            pid=fleet.server_pid(SCORING_REPLICA),
            healthy=scoring_url in fleet.healthy_workers(),
            health=http_status(f"{scoring_url}/health_generate"),
        )

    after = seen()
    # A scoring that fails on the replica (replica1's share again, --tags score, forced, on a device it does
    # not have): the replica is brought back and returned all the same, the failed scoring on the record.
    failing = fleet.play(
        "eval.yml",
        args=("--tags", "score"),
        hosts=("replica1",),
        **scored_on_the_replica(fleet, specops_scoring_device="cuda", score_drafter_force=True),
    )
    scoring = SimpleNamespace(
        watch=watch, pid_before=scoring_pid, after=after, failing=failing, after_failing=seen()
    )
    fleet.leave(SCORING_REPLICA)
    return SimpleNamespace(result=result, load=load, scoring=scoring)


def test_rolling_evaluation_succeeds_on_every_host(rolling_run):
    result = rolling_run.result
    assert result.rc == 0, result.output[-6000:]
    assert set(result.recap) == set(FLEET)
    assert not any(counts["failed"] for counts in result.recap.values())


def test_no_request_sent_through_the_router_fails_during_the_rollout(rolling_run):
    load = rolling_run.load
    assert load["requests"] > 0
    assert load["failed"] == 0, load["failures"]


def test_every_host_returns_to_the_router_healthy(rolling_run, fleet):
    assert fleet.healthy_workers() == set(fleet.worker_urls)


def test_a_replica_found_down_is_started_again_and_named_in_the_output_the_report_and_the_stats(
    rolling_run, fleet
):
    result = rolling_run.result
    said = " ".join(result.output.split())
    warnings = re.findall(
        r"WARNING: (\S+) on (\S+) was not running \(it died, or was stopped outside this play\): "
        r"started it again, pid (\d+), answering /health_generate",
        said,
    )
    # The serve stage's start; replica1's window restarted it again after.
    assert len(warnings) == 1 and warnings[0][1] == "replica1", result.output[-6000:]
    unit, pid = warnings[0][0], int(warnings[0][2])
    assert pid != fleet.crashed["replica1"]
    report = json.loads((fleet.work_dir / "replica1" / "run" / "fleet" / "report.json").read_text())
    assert report["fleet"]["found_down"] == ["replica1"]
    assert [(row["host"], row["found_down"]) for row in report["per_host"] if row["found_down"]] == [
        ("replica1", {"stage": "serve", "pid": pid})
    ]
    warning = "replica1: its server was not running when the rollout reached it"
    assert any(w.startswith(warning) and f"(pid {pid})" in w for w in report["warnings"])
    assert warning in (fleet.work_dir / "replica1" / "run" / "fleet" / "report.md").read_text()
    # AWX's stats (printed at the play's end): the role's entry for the host.
    stats = said[said.rindex("CUSTOM STATS") :]
    entry = stats[stats.index("sglang_service_found_down:") :].split()[:6]
    assert entry == ["sglang_service_found_down:", "replica1:", "pid:", str(pid), "unit:", unit], stats[:3000]


def test_the_run_ends_by_checking_that_every_replica_serves(rolling_run):
    result = rolling_run.result
    assert (
        result.output.count(
            "TASK [Stage fleet-check: ask the server and the router whether this replica serves]"
        )
        == 1
    )
    assert "specops stage 'fleet-check' failed" not in result.output


def test_hosts_take_their_windows_one_at_a_time(rolling_run, fleet):
    report = json.loads((fleet.work_dir / "replica1" / "run" / "fleet" / "report.json").read_text())
    windows = sorted(
        (row["window"]["started_at"], row["window"]["returned_at"]) for row in report["per_host"]
    )
    assert len(windows) == len(FLEET)
    assert all(earlier[1] <= later[0] for earlier, later in zip(windows, windows[1:], strict=False))


def test_one_report_merges_every_hosts_share_of_the_prompts(rolling_run, fleet):
    report = json.loads((fleet.work_dir / "replica1" / "run" / "fleet" / "report.json").read_text())
    prompts = [
        json.loads(line)["id"]
        for line in (REPO / "prompts" / "coding.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert sorted(row["id"] for row in report["per_prompt"]) == sorted(prompts)
    assert {row["host"] for row in report["per_prompt"]} == set(FLEET)
    assert report["fleet"]["sum_window_s"] > 0 and report["fleet"]["wall_s"] > 0
    # Two downtimes, named apart: the play's, on the control node (drained to answering), and the
    # service's own, on the host's clock (server stop to ready), which lies inside the play's.
    for row in report["per_host"]:
        window = row["window"]
        assert "downtime_s" not in window
        assert 0 < window["service_downtime_s"] <= window["play_downtime_s"] < window["window_s"], window
    assert report["fleet"]["sum_service_downtime_s"] <= report["fleet"]["sum_play_downtime_s"]


def test_the_scoring_replica_is_out_of_the_router_whenever_its_server_is_down_for_a_scoring(rolling_run):
    watch = rolling_run.scoring.watch
    # Its server went down once per host's scoring (stop mode: stopped, scored on, started again)...
    assert watch.down_periods() == len(FLEET), watch.samples
    # ...and the router never listed it meanwhile: no request was routed to it while it scored.
    assert not any(listed for _, listed, up in watch.samples if not up), watch.samples
    assert rolling_run.load["failed"] == 0, rolling_run.load["failures"]


def test_the_scoring_replica_is_back_behind_the_router_healthy_after_the_run(rolling_run):
    scoring = rolling_run.scoring
    assert scoring.after.healthy and scoring.after.health == 200
    assert scoring.after.pid not in (None, scoring.pid_before)


def test_a_scoring_that_fails_on_the_replica_still_brings_it_back_and_puts_its_time_out_on_the_record(
    rolling_run, fleet
):
    scoring = rolling_run.scoring
    said = " ".join(scoring.failing.output.split()).replace("''", "'")
    assert scoring.failing.rc != 0
    assert "specops stage 'score' failed" in said, scoring.failing.output[-6000:]
    assert f"the scoring replica {SCORING_REPLICA} was brought back and returned to the router" in said
    assert scoring.after_failing.healthy and scoring.after_failing.health == 200
    assert scoring.after_failing.pid not in (None, scoring.after.pid)
    outages = json.loads((fleet.work_dir / "replica1" / "run" / "hidden_states" / "outages.json").read_text())
    [failed] = [o for o in outages if o["kind"] == "scoring_replica" and o["failed"]]
    assert "to score replica1's share" in failed["cause"] and failed["msg"] and failed["downtime_s"] > 0


def test_each_report_says_where_it_was_scored_and_puts_the_scoring_replicas_time_out_on_the_record(
    rolling_run, fleet
):
    watch = rolling_run.scoring.watch
    for host in FLEET:
        score = fleet.work_dir / host / "run" / "score"
        report = json.loads((score / "report.json").read_text())
        assert report["placement"]["where"] == "host" and report["placement"]["host"] == SCORING_REPLICA
        [out] = [o for o in report["outages"] if o["kind"] == "scoring_replica"]
        assert out["server"] == SCORING_REPLICA and f"to score {host}'s share" in out["cause"], out
        assert not out["failed"] and out["downtime_s"] > 0
        # The record's span holds the time the replica's server was seen down for this host's scoring.
        span = [datetime.fromisoformat(out[k]).timestamp() for k in ("down_at", "ready_at")]
        assert any(span[0] <= at <= span[1] for at, _, up in watch.samples if not up), (out, watch.samples)
        said = (score / "report.md").read_text()
        assert f"scored on **{SCORING_REPLICA}** (cpu)" in said
        assert "## Scoring replica out of the router" in said
        assert f"- {SCORING_REPLICA} was out of the router" in said


def test_an_unreachable_router_fails_before_any_host_is_drained(rolling_run, fleet, tmp_path):
    pids = {host: (fleet.work_dir / host / "sglang.pid").read_text() for host in FLEET}
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
    pids = {host: (fleet.work_dir / host / "sglang.pid").read_text() for host in FLEET}
    fleet.start_load("failing", interval=PACED)
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
    assert {h: (fleet.work_dir / h / "sglang.pid").read_text() for h in FLEET[1:]} == {
        h: pids[h] for h in FLEET[1:]
    }
    assert fleet.healthy_workers() == set(fleet.worker_urls)
    assert load["failed"] == 0, load["failures"]


def test_a_replica_down_at_the_end_of_a_rollout_is_started_again_and_the_run_fails_naming_it(fleet):
    # Replica1 dies after its turn. The run's stages are left out (--tags): the plan, then the end's check.
    killed = fleet.kill_server("replica1")
    result = fleet.play("eval.yml", args=("--tags", "never-a-stage"))
    said = " ".join(result.output.split()).replace("''", "'")  # YAML doubles quotes in quotes
    assert result.rc != 0
    assert (
        "specops stage 'fleet-check' failed: replica1 was not serving at the end of the rollout "
        "(its server answers /health_generate nothing, the router reports it unhealthy): "
        "it was started again and is back behind the router" in said
    ), result.output[-6000:]
    assert "replica2 was not serving" not in said
    assert "on replica1 was not running (it died, or was stopped outside this play): started it again" in said
    assert fleet.server_pid("replica1") not in (None, killed)
    assert fleet.healthy_workers() == set(fleet.worker_urls)


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
    hosts = FLEET
    pids = {host: fleet.server_pid(host) for host in FLEET}
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
    assert {host: fleet.server_pid(host) for host in FLEET} == pids
    assert fleet.healthy_workers() == set(fleet.worker_urls)


class DrainWatch(threading.Thread):
    """Looks every 0.1 s whether the router lists a worker and how many requests that worker holds."""

    def __init__(self, router_url: str, worker_url: str):
        super().__init__(daemon=True)
        self.router_url, self.worker_url = router_url, worker_url
        self.samples: list[tuple[bool, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                listed = any(
                    w["url"] == self.worker_url for w in get_json(f"{self.router_url}/workers")["workers"]
                )
                loads = get_json(f"{self.worker_url}/v1/loads")["loads"]
            except OSError:
                listed, loads = True, []  # the server is down: nothing held
            held = sum(load["num_running_reqs"] + load["num_waiting_reqs"] for load in loads)
            self.samples.append((listed, held))
            self.done.wait(0.1)

    def held_after_removal(self) -> int:
        """The most requests the worker held while the router no longer listed it."""
        return max((held for listed, held in self.samples if not listed), default=0)


def window_work(token: str, stage: str | None = None) -> list[int]:
    """The window's work as the guard finds it (the processes carrying the token and the stages a stage
    host forked for them), or those of it that run `stage` (its command line, or a forked stage's name)."""
    found = procfs.window_processes(token)
    if stage is None:
        return found
    return [pid for pid in found if stage in procfs.cmdline(pid).split() or procfs.comm(pid) == stage[:15]]


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=60) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return -1


def sigterm_pending_or_gone(pid: int) -> bool:
    try:
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
        )
    except OSError:
        return True
    pending = int(status["ShdPnd"], 16) | int(status["SigPnd"], 16)
    return status["State"].strip().startswith("Z") or bool(pending & (1 << (signal.SIGTERM - 1)))


@pytest.fixture(scope="module")
def router_loss_run(rolling_run, fleet):
    """eval.yml again on replica1's share (a run directory with its completions, so the window is the new
    part), min_healthy_others=1. Streams go through the router from just before replica1's drain until
    its server stops; inside replica1's window the other replica, replica2, is killed (SIGKILL).

    The extraction is held stopped (SIGSTOP) from the drain on, so the window lasts until the router has
    noticed, however fast the extraction would be here; once the window's stop has signalled it, it is
    let go and ends as a running one would."""
    token = f"router-loss-{os.getpid()}"
    run_dir = fleet.work_dir / "replica1" / "run-router-loss"
    shutil.copytree(fleet.work_dir / "replica1" / "run" / "completions", run_dir / "completions")
    pids = {host: fleet.server_pid(host) for host in FLEET}
    watch = DrainWatch(fleet.router_url, fleet.worker_urls[0])
    play = subprocess.Popen(
        fleet.command(
            "eval.yml",
            specops_run_dir="{{ specops_work_dir }}/run-router-loss",
            specops_window_token=token,
            sglang_router_min_healthy_others=1,
        ),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=fleet.environment(),
    )
    output, stalled, load, killed = "", [], None, False
    try:
        for line in play.stdout:
            output += line
            if "TASK [Stage window: take the service off the GPUs" in line and not watch.is_alive():
                # From just before the drain. Long streams, more of them than replicas, taken in turn:
                # replica1 holds some when the router lets it go.
                fleet.start_load(
                    "streams", concurrency=6, kinds="stream", long_max_new_tokens=96, timeout=900
                )
                watch.start()
            elif "TASK [Stage drain:" in line and not stalled:
                stalled = window_work(token, "specops.extract")
                assert stalled, "no extraction waits for replica1's window:\n" + output[-4000:]
                for pid in stalled:
                    os.kill(pid, signal.SIGSTOP)
            elif "TASK [Stage stop-server: take the service off the GPUs" in line and load is None:
                load = fleet.stop_load("streams")
                watch.done.set()
            elif "TASK [Stage extract: extract the target's hidden states" in line:
                os.kill(pids["replica2"], signal.SIGKILL)
                killed = True
                break
        deadline = time.monotonic() + 600
        while not all(sigterm_pending_or_gone(pid) for pid in stalled) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in stalled:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        output += play.communicate(timeout=900)[0]
        run = SimpleNamespace(
            rc=play.returncode,
            output=output,
            said=" ".join(output.split()).replace("''", "'"),
            load=load,
            watch=watch,
            killed=killed,
            pids_before=pids,
            pids_after={host: fleet.server_pid(host) for host in FLEET},
            healthy_after=fleet.healthy_workers(),
            replica1_health=http_status(f"{fleet.worker_urls[0]}/health_generate"),
            extracted=(run_dir / "hidden_states" / "manifest.json").exists(),
            window_work_left=window_work(token),
        )
    finally:
        if play.poll() is None:
            play.kill()
            play.wait()
        if fleet.load is not None:
            fleet.stop_load("streams")
        watch.done.set()
        for pid in window_work(token, "specops.extract"):
            os.kill(pid, signal.SIGKILL)
        if killed:
            # Replica2 back, for the tests that follow: started again, and healthy behind the router.
            restored = fleet.play("service.yml", sglang_service_state="started", timeout=600)
            assert restored.rc == 0, restored.output[-4000:]
            fleet.wait_for_workers(set(fleet.worker_urls), timeout=300)
    return run


def test_streams_in_flight_through_the_router_finish_when_their_host_is_drained(router_loss_run):
    load = router_loss_run.load
    assert load is not None and load["requests"] > 0
    # Streams were on replica1 after the router had stopped listing it: the drain waited for them.
    assert router_loss_run.watch.held_after_removal() > 0, router_loss_run.watch.samples[-50:]
    assert load["failed"] == 0 and load["incomplete"] == 0, load


def test_losing_another_replica_inside_a_window_ends_it_early_and_the_host_comes_back(router_loss_run, fleet):
    run = router_loss_run
    assert run.killed, run.output[-4000:]
    assert run.rc != 0
    assert "specops stage 'extract' failed: the window was ended early: the router at" in run.said, (
        run.output[-4000:]
    )
    assert (
        "reports 0 healthy replica(s) besides this batch, fewer than sglang_router_min_healthy_others=1"
        in run.said
    )
    assert "(the service was brought back and answers /health_generate)" in run.said
    # The extraction was stopped, nothing of the window is left, and the rollout went no further.
    assert not run.extracted and run.window_work_left == []
    assert run.pids_after["replica1"] not in (None, run.pids_before["replica1"])
    assert run.replica1_health == 200
    # Replica2's batch never began: one drain in the whole play, replica1's.
    assert run.output.count("TASK [Stage drain: take the host out of the router") == 1, run.output[-4000:]
    # Replica1 is back behind the router, alone (replica2 is the one that died).
    assert run.healthy_after == {fleet.worker_urls[0]}


class WorkersWatch(threading.Thread):
    """Every 0.25 s, which replicas the router lists healthy: how many at once, and which were ever out (a
    replica is out of the router for seconds: its drain, its restart, its return)."""

    def __init__(self, fleet: LocalFleet):
        super().__init__(daemon=True)
        self.fleet = fleet
        self.counts: list[int] = []
        self.absent: set[str] = set()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            healthy = self.fleet.healthy_workers() & set(self.fleet.worker_urls)
            self.counts.append(len(healthy))
            self.absent |= set(self.fleet.worker_urls) - healthy
            self.done.wait(0.25)


def test_new_server_options_roll_over_the_fleet_one_replica_at_a_time_and_lose_no_request(fleet):
    # Last in this module: the replicas keep the memory saver until the fleet is stopped. The inventory's
    # third replica joins first: the options roll over all three, never more than one out of the router.
    fleet.join(HOSTS[2])
    assert fleet.hosts == HOSTS
    pids = {host: fleet.server_pid(host) for host in HOSTS}
    watch = WorkersWatch(fleet)
    # Two users, each a request a second: requests during every replica's drain and restart, without
    # keeping the replicas busy generating for the whole roll.
    fleet.start_load("options", concurrency=2, interval=1.0)
    watch.start()
    result = fleet.play("service.yml", sglang_service_state="started", sglang_service_memory_saver=True)
    watch.done.set()
    watch.join()
    load = fleet.stop_load("options")
    assert result.rc == 0, result.output[-6000:]
    assert load["requests"] > 0 and load["failed"] == 0 and load["incomplete"] == 0, load
    # Every replica was replaced with the new options, each out of the router in its turn, never two at once.
    assert all(fleet.server_pid(h) not in (None, pids[h]) for h in HOSTS)
    for host in HOSTS:
        argv = Path(f"/proc/{fleet.server_pid(host)}/cmdline").read_bytes().split(b"\0")
        assert b"--enable-memory-saver" in argv
    assert watch.absent == set(fleet.worker_urls) and min(watch.counts) == len(HOSTS) - 1, watch.counts
    assert result.output.count("TASK [Stage drain: take the host out of the router") == len(HOSTS)
    assert fleet.healthy_workers() == set(fleet.worker_urls)


def test_a_scoring_replica_with_the_memory_saver_is_released_and_resumed_not_restarted(fleet):
    # After the roll above every replica has the memory saver. Replica1's share, scored again (--tags score,
    # forced) on replica3, which the run leaves out: released for the scoring (the KV cache), resumed after.
    url = fleet.replica_url(SCORING_REPLICA)
    pid = fleet.server_pid(SCORING_REPLICA)
    watch = ReplicaWatch(fleet.router_url, url)
    watch.start()
    result = fleet.play(
        "eval.yml",
        args=("--tags", "score"),
        hosts=("replica1",),
        **scored_on_the_replica(fleet, specops_gpu_window_mode="memory_saver", score_drafter_force=True),
    )
    watch.done.set()
    watch.join()
    assert result.rc == 0, result.output[-6000:]
    said = " ".join(result.output.split())
    # The KV cache alone: the scoring's weights fit beside the server's.
    assert "memory plan: kv_cache (tags" in said, result.output[-6000:]
    # The same process throughout, out of the router for a while, and back in it, healthy.
    assert fleet.server_pid(SCORING_REPLICA) == pid and all(up for _, _, up in watch.samples)
    assert any(not listed for _, listed, _ in watch.samples) and watch.samples[-1][1]
    assert fleet.healthy_workers() == set(fleet.worker_urls)
    report = json.loads((fleet.work_dir / "replica1" / "run" / "score" / "report.json").read_text())
    out = [o for o in report["outages"] if o["kind"] == "scoring_replica"][-1]
    assert out["cause"].endswith("replica1's share (its server released and resumed for it)"), out
