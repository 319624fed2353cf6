"""playbooks/tasks/fleet_merge.yml on two hosts, as eval.yml's last play runs it: after a run in which
both hosts had a window, and after a rerun or a rescore in which neither had one (nothing to extract,
so no window figures). The rerun merges, changes nothing and does not fail."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
ML_PYTHON = ROOT / ".venv-ml" / "bin" / "python"
HOSTS = ("replica1", "replica2")
# A host's report.json as the score stage writes it, built by the package itself.
SHARD = """
import json, sys
from specops import report
sequences = [{"id": sys.argv[1], "accept_lengths": [2, 1, 3]}]
print(json.dumps(report.build_report({}, {"block_size": 4, "sequences": sequences}, None, {}, [], None)))
"""
# The facts the sglang_router role leaves when a host took its window; none when it had nothing to extract.
MERGE_PLAY = """
- name: Merge as eval.yml's last play does
  hosts: fleet
  gather_facts: false
  tasks:
    - name: Leave the window figures of a run that took its windows
      when: with_windows | bool
      ansible.builtin.set_fact:
        sglang_router_drain_started_at: "{{ 100 + specops_fleet_index * 10 }}"
        sglang_router_drained_at: "{{ 101 + specops_fleet_index * 10 }}"
        sglang_router_service_back_at: "{{ 105 + specops_fleet_index * 10 }}"
        sglang_router_returned_at: "{{ 106 + specops_fleet_index * 10 }}"
    - name: Merge
      ansible.builtin.include_tasks: MERGE_TASKS
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if not ML_PYTHON.exists():
        pytest.fail("no ML environment to run specops.fleet in: run `make ml-env` first")
    work = tmp_path_factory.mktemp("fleet-merge")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "ANSIBLE_NOCOLOR": "1"}
    hosts = {}
    for index, host in enumerate(HOSTS):
        run_dir = work / host / "run"
        (run_dir / "score").mkdir(parents=True)
        shard = subprocess.run(
            [ML_PYTHON, "-c", SHARD, f"p{index}"], env=env, capture_output=True, text=True, check=True
        )
        (run_dir / "score" / "report.json").write_text(shard.stdout)
        hosts[host] = {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "specops_run_dir": str(run_dir),
            "specops_fleet_index": index,
        }
    inventory = work / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "fleet": {
                    "hosts": hosts,
                    "vars": {"fla_env_venv": str(ROOT / ".venv-ml"), "specops_rollout_started_at": 90},
                }
            }
        )
    )
    play = work / "merge.yml"
    play.write_text(MERGE_PLAY.replace("MERGE_TASKS", str(ROOT / "playbooks" / "tasks" / "fleet_merge.yml")))
    return {"work": work, "inventory": inventory, "play": play, "env": env}


def merge(fleet, with_windows: bool) -> tuple[int, str, dict[str, dict[str, int]]]:
    done = subprocess.run(
        [PLAYBOOK, "-i", fleet["inventory"], fleet["play"], "-e", json.dumps({"with_windows": with_windows})],
        cwd=ROOT,
        env=fleet["env"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    recap = {
        host: {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", counts)}
        for host, counts in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", done.stdout, re.MULTILINE)
    }
    return done.returncode, done.stdout + done.stderr, recap


def test_a_rerun_without_windows_merges_again_and_changes_nothing(fleet):
    rc, output, _ = merge(fleet, with_windows=True)
    assert rc == 0, output[-4000:]
    report = json.loads((fleet["work"] / HOSTS[0] / "run" / "fleet" / "report.json").read_text())
    # The rollout's wall time runs from its start (90) to the last host's return (116).
    assert report["fleet"]["wall_s"] == 26.0
    rc, output, recap = merge(fleet, with_windows=False)
    assert rc == 0, output[-4000:]
    assert "returned_at" not in output
    assert set(recap) == set(HOSTS)
    assert all(counts["changed"] == 0 and counts["failed"] == 0 for counts in recap.values()), recap
    again = json.loads((fleet["work"] / HOSTS[0] / "run" / "fleet" / "report.json").read_text())
    assert again == report, "a rerun with nothing new must leave the fleet report as it was"
