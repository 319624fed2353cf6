"""The plan play resolves specops_serial as Ansible does and refuses every value that takes all
replicas down at once, before any host is touched (it runs only the plan: nothing is served here).
One rule (playbooks/tasks/serial_rule.yml) for eval.yml's windows and service.yml's rolling restarts."""

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
    tmp_path: Path, hosts: int, serial, router: str = "", playbook: str = "eval.yml"
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
