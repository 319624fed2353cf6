"""playbooks/eval.yml run through ansible-runner, the engine AWX runs jobs with, on the local
default inventory (CPU, the development server, tiny models built from config); the test checks
the artifacts a job leaves as AWX would read them: status, rc, events, fact cache and the key
figures published with set_stats."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

ansible_runner = pytest.importorskip("ansible_runner")

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STATS_KEY = "specops_score"  # roles/score_drafter: score_drafter_stats_key
FIGURES = ("tau", "reference_tau", "ratio", "online_tau", "n_prompts", "warnings", "verdict", "report")

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ml_python() -> str:
    """The interpreter the ML environment was made with, as `make demo` passes it to fla_env."""
    if os.environ.get("PYTHON_ML"):
        return os.environ["PYTHON_ML"]
    cfg = ROOT / ".venv-ml" / "pyvenv.cfg"
    if not cfg.is_file():
        pytest.fail("no ML environment: run `make ml-env` first (or set PYTHON_ML)")
    settings = dict(line.split(" = ", 1) for line in cfg.read_text().splitlines() if " = " in line)
    return settings.get("executable") or str(Path(settings["home"]) / "python3")


def isolated_vars(work: Path, port: int) -> dict:
    """Everything the run writes or listens on, apart from a demo's and other tests'."""
    return {
        "specops_work_dir": str(work),
        "fla_env_python": ml_python(),
        "sglang_service_port": port,
        "sglang_service_run_dir": str(work / "service"),
        "sglang_service_pid_file": str(work / "service" / "sglang.pid"),
        "sglang_service_log_file": str(work / "service" / "sglang.log"),
    }


def runner(private_data_dir: Path, playbook: str, extravars: dict, ident: str):
    return ansible_runner.run(
        private_data_dir=str(private_data_dir),
        project_dir=str(ROOT),  # AWX runs from the project checkout: ansible.cfg, roles/ found there
        playbook=playbook,
        inventory=str(ROOT / "inventory" / "local"),
        extravars=extravars,
        # The control venv's ansible-playbook comes first on PATH, as the execution environment's would.
        envvars={
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        },
        ident=ident,
        quiet=True,
        timeout=1500,
    )


@pytest.fixture(scope="module")
def eval_job(tmp_path_factory):
    base = tmp_path_factory.mktemp("runner")
    (base / "private").mkdir()  # ansible-runner's private data dir must exist
    work = base / "work"
    extravars = isolated_vars(work, free_port())
    try:
        job = runner(base / "private", "playbooks/eval.yml", extravars, "eval")
        yield {"job": job, "artifacts": base / "private" / "artifacts" / "eval", "work": work}
    finally:
        # eval.yml leaves the service running, as production wants; stop this test's server.
        # No guard: nothing should bring it back.
        runner(
            base / "private",
            "playbooks/service.yml",
            dict(extravars, sglang_service_state="stopped", sglang_service_guard=False),
            "stop",
        )


def events(eval_job, kind=None):
    found = [json.loads(p.read_text()) for p in sorted((eval_job["artifacts"] / "job_events").glob("*.json"))]
    return [e for e in found if kind is None or e.get("event") == kind]


def custom_stats(eval_job):
    (stats,) = events(eval_job, "playbook_on_stats")
    return stats["event_data"]["artifact_data"]


def test_the_job_is_successful_with_rc_0(eval_job):
    job = eval_job["job"]
    tail = (
        (eval_job["artifacts"] / "stdout").read_text()[-4000:]
        if (eval_job["artifacts"] / "stdout").exists()
        else ""
    )
    assert job.status == "successful", tail
    assert job.rc == 0
    assert (eval_job["artifacts"] / "status").read_text().strip() == "successful"
    assert (eval_job["artifacts"] / "rc").read_text().strip() == "0"


def test_no_host_failed_or_was_unreachable(eval_job):
    stats = eval_job["job"].stats
    assert stats["failures"] == {} and stats["dark"] == {}
    assert stats["ok"].get("localhost", 0) > 0


def test_no_task_failed_unless_it_was_meant_to(eval_job):
    failed = [e for e in events(eval_job, "runner_on_failed") if not e["event_data"].get("ignore_errors")]
    assert failed == []


def test_the_job_events_cover_every_stage(eval_job):
    roles = {e["event_data"].get("role") for e in events(eval_job, "runner_on_ok")}
    for role in (
        "fla_env",
        "sglang_service",
        "sglang_completions",
        "gpu_release",
        "extract_hidden_states",
        "score_drafter",
    ):
        assert role in roles, f"no task of role {role} ran"


def test_gathered_facts_land_in_the_fact_cache(eval_job):
    # The jsonfile cache names each host's file with a prefix of its own (e.g. "s1_localhost").
    caches = sorted((eval_job["artifacts"] / "fact_cache").glob("*localhost"))
    assert caches, "no cached facts for localhost"
    facts = json.loads(caches[0].read_text())
    if isinstance(facts.get("__payload__"), str):  # ansible-core 2.19+ wraps the facts as a JSON string
        facts = json.loads(facts["__payload__"])
    assert "ansible_hostname" in facts


def test_the_key_figures_are_published_with_set_stats(eval_job):
    figures = custom_stats(eval_job)[STATS_KEY]
    for key in FIGURES:
        assert key in figures, key


def test_tau_counts_the_bonus_token_so_it_is_at_least_one(eval_job):
    figures = custom_stats(eval_job)[STATS_KEY]
    assert float(figures["tau"]) >= 1.0
    assert float(figures["reference_tau"]) >= 1.0


def test_the_ratio_is_tau_over_the_reference_tau(eval_job):
    figures = custom_stats(eval_job)[STATS_KEY]
    assert float(figures["ratio"]) == pytest.approx(
        float(figures["tau"]) / float(figures["reference_tau"]), rel=1e-3
    )


def test_the_published_figures_match_the_report_on_disk(eval_job):
    figures = custom_stats(eval_job)[STATS_KEY]
    report_md = Path(figures["report"])
    assert report_md.is_file()
    assert report_md.is_relative_to(eval_job["work"]), "the run must stay inside its own work directory"
    report = json.loads((report_md.parent / "report.json").read_text())
    assert report["overall"]["tau"] == pytest.approx(float(figures["tau"]))
    assert f"{float(figures['tau']):.2f}" in report_md.read_text()


def test_the_service_answers_again_after_the_gpu_window(eval_job):
    ok = events(eval_job, "runner_on_ok")
    # The module's start returns ready_at: when our server first answered /health_generate 200.
    ready = [
        e["counter"]
        for e in ok
        if e["event_data"].get("role") == "sglang_service"
        and (e["event_data"].get("res") or {}).get("ready_at")
    ]
    released = [e["counter"] for e in ok if e["event_data"].get("role") == "gpu_release"]
    assert released, "the GPU window never opened"
    assert ready and max(ready) > max(released), "the play ended without waiting for /health_generate"
