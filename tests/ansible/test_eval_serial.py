"""The plan play resolves specops_serial as Ansible does and refuses every value that takes all
replicas down at once, before any host is touched (it runs only the plan: nothing is served here).
One rule (playbooks/tasks/serial_rule.yml) for eval.yml's windows and service.yml's rolling restarts.
With the batches known, it refuses a scoring replica that could not leave the router for a scoring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"


def plan(
    tmp_path: Path,
    hosts: int,
    serial,
    router: str = "",
    playbook: str = "eval.yml",
    args: tuple[str, ...] = (),
    **variables,
) -> subprocess.CompletedProcess:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        json.dumps(
            {
                "gpu_hosts": {
                    "hosts": {f"gpu{i}": {"ansible_connection": "local"} for i in range(hosts)},
                    "vars": {"ansible_python_interpreter": sys.executable},
                }
            }
        )
    )
    # The variables the play checks first (roles/eval_vars): never read, the plan runs alone.
    extra = {
        "specops_serial": serial,
        "sglang_router_url": router,
        **{
            f"specops_{name}": str(tmp_path / "none")
            for name in ("run_dir", "prompts", "target_model", "drafter")
        },
        **variables,
    }
    return subprocess.run(
        [
            str(PLAYBOOK),
            "-i",
            str(inventory),
            str(ROOT / "playbooks" / playbook),
            "-e",
            json.dumps(extra),
            "--tags",
            "never-a-stage",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
        timeout=600,
    )


@pytest.mark.parametrize("playbook", ["eval.yml", "service.yml"])
@pytest.mark.parametrize("serial", ["100%", 0, [1, 2]])
def test_a_batch_size_that_takes_every_replica_down_is_refused(tmp_path, serial, playbook):
    result = plan(tmp_path, hosts=2, serial=serial, playbook=playbook)
    assert result.returncode != 0
    assert "replicas down at once, i.e. all of them" in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize("serial", ["50%", [1, 1]])
def test_a_batch_size_that_leaves_a_replica_serving_passes_the_plan(tmp_path, serial):
    result = plan(tmp_path, hosts=2, serial=serial)
    assert "replicas down at once" not in result.stdout, result.stdout[-3000:]
    # The plan let the rollout begin (what it does next needs a real site, not this inventory).
    assert "PLAY [Evaluate a speculative-decoding drafter" in result.stdout, result.stdout[-3000:]


def test_service_yml_passes_a_batch_size_that_leaves_a_replica_serving(tmp_path):
    result = plan(tmp_path, hosts=3, serial=2, playbook="service.yml")
    assert result.returncode == 0 and "replicas down at once" not in result.stdout, result.stdout[-3000:]


def test_several_hosts_without_a_router_are_warned_about(tmp_path):
    result = plan(tmp_path, hosts=3, serial=1)
    assert "3 hosts roll without a router" in result.stdout, result.stdout[-3000:]


# A router that answers nothing: the plan's refusals come before its check, which would fail on it.
NO_ROUTER_THERE = "http://127.0.0.1:9"


def test_a_scoring_replica_without_a_router_is_refused_before_any_host_is_touched(tmp_path):
    result = plan(
        tmp_path,
        hosts=3,
        serial=1,
        args=("--limit", "gpu0,gpu1"),
        specops_score_placement="host",
        specops_scoring_host="gpu2",
    )
    said = " ".join(result.stdout.split())
    assert result.returncode != 0
    assert (
        "specops_scoring_host gpu2 is a replica of the fleet (a host of gpu_hosts) "
        "and no router is configured (sglang_router_url is empty)" in said
    ), result.stdout[-3000:]
    assert "no host was touched" in said and "PLAY [Evaluate a speculative-decoding drafter" not in said


def test_a_scoring_replica_evaluated_in_the_batch_it_would_score_for_is_refused(tmp_path):
    result = plan(
        tmp_path,
        hosts=2,
        serial=1,
        router=NO_ROUTER_THERE,
        specops_scoring_host="gpu1",
    )
    said = " ".join(result.stdout.split())
    assert result.returncode != 0
    # auto may place the scoring there: the replica itself would score its own batch after its window.
    assert (
        "specops_scoring_host gpu1 is itself evaluated in batch 2 of 2 (gpu1), whose scoring it would serve"
        in said
    )
    assert "cannot be reached" not in said, result.stdout[-3000:]


def test_two_hosts_of_one_batch_scoring_on_one_replica_at_once_are_refused(tmp_path):
    result = plan(
        tmp_path,
        hosts=4,
        serial=[2, 1],
        router=NO_ROUTER_THERE,
        args=("--limit", "gpu0,gpu1,gpu2"),
        specops_score_placement="host",
        specops_scoring_host="gpu3",
    )
    said = " ".join(result.stdout.split())
    assert result.returncode != 0
    assert "specops_scoring_host gpu3 would serve 2 scorings at once (batch 1: gpu0, gpu1)" in said, said[
        -3000:
    ]
    # gpu2 rolls alone in batch 2: it is not refused.
    assert "batch 2" not in said


def test_a_scoring_replica_outside_the_run_passes_to_the_routers_check(tmp_path):
    result = plan(
        tmp_path,
        hosts=3,
        serial=1,
        router=NO_ROUTER_THERE,
        args=("--limit", "gpu0,gpu1"),
        specops_score_placement="host",
        specops_scoring_host="gpu2",
    )
    said = " ".join(result.stdout.split())
    assert "no host was touched" not in said
    assert "the SGLang router at http://127.0.0.1:9 cannot be reached" in said, said[-3000:]
