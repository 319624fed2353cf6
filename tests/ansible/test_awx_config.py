"""The AWX configuration only sets variables the roles and eval.yml know: a misspelt role variable
(sglang_service_unit for sglang_service_unit_name) would be ignored and the weekly job would fail."""

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
CONTROLLER = yaml.safe_load((ROOT / "awx" / "controller.yml").read_text())
ROLES = {p.name: p for p in (ROOT / "roles").iterdir() if (p / "meta" / "argument_specs.yml").is_file()}


def awx_variables() -> dict[str, object]:
    found: dict[str, object] = {}
    for group in CONTROLLER.get("controller_groups", []):
        found.update(group.get("variables") or {})
    for template in CONTROLLER.get("controller_templates", []):
        found.update(template.get("extra_vars") or {})
    return found


def role_options(role: str) -> set[str]:
    specs = yaml.safe_load((ROLES[role] / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    return {name for entry in specs.values() for name in (entry.get("options") or {})}


def owner(name: str) -> str | None:
    """The role whose prefix the variable carries (the longest prefix wins)."""
    matches = [role for role in ROLES if name.startswith(role + "_")]
    return max(matches, key=len) if matches else None


@pytest.mark.parametrize("name", sorted(n for n in awx_variables() if owner(n)))
def test_every_role_variable_in_the_awx_config_is_an_option_of_its_role(name):
    role = owner(name)
    assert name in role_options(role), f"awx/controller.yml sets {name}, which roles/{role} does not know"


@pytest.mark.parametrize("name", sorted(n for n in awx_variables() if n.startswith("specops_")))
def test_every_specops_variable_in_the_awx_config_is_read_by_the_playbooks(name):
    used = "".join(p.read_text() for p in (ROOT / "playbooks").glob("*.yml"))
    used += (ROOT / "inventory" / "production.example" / "group_vars" / "gpu_hosts.yml").read_text()
    assert re.search(rf"\b{name}\b", used), f"awx/controller.yml sets {name}, which no playbook reads"


def test_the_awx_job_adopts_the_unit_so_it_needs_no_model_path():
    variables = awx_variables()
    assert variables.get("sglang_service_backend") == "systemd"
    assert variables.get("sglang_service_manage_unit") is False and variables.get("sglang_service_unit_name")


def test_the_production_example_adopts_a_unit_with_privilege_escalation():
    example = yaml.safe_load((ROOT / "inventory/production.example/group_vars/gpu_hosts.yml").read_text())
    assert example["sglang_service_manage_unit"] is False and example["sglang_service_become"] is True
    assert not {"sglang_service_model_path", "sglang_service_port"} & set(example)
    for name in example:
        if owner(name):
            assert name in role_options(owner(name)), f"production example sets unknown {name}"


def survey_variables() -> set[str]:
    return {
        question["variable"]
        for template in CONTROLLER.get("controller_templates", [])
        for question in (template.get("survey_spec") or {}).get("spec", [])
    }


def test_the_awx_hosts_get_every_setting_of_the_production_example():
    example = yaml.safe_load((ROOT / "inventory/production.example/group_vars/gpu_hosts.yml").read_text())
    # specops_drafter: the survey asks for the drafters (specops_drafters); the rest is set for the group.
    given = set(awx_variables()) | survey_variables()
    missing = sorted(name for name in example if name not in given and name != "specops_drafter")
    assert not missing, f"awx/controller.yml leaves out what inventory/production.example sets: {missing}"


@pytest.mark.parametrize("name", sorted(survey_variables()))
def test_every_survey_answer_is_read_by_a_playbook_or_the_job_templates_variables(name):
    used = "".join(p.read_text() for p in (ROOT / "playbooks").glob("*.yml"))
    used += "".join(p.read_text() for p in (ROOT / "roles").glob("*/defaults/main.yml"))
    used += json.dumps([t.get("extra_vars") for t in CONTROLLER["controller_templates"]])
    assert re.search(rf"\b{name}\b", used), f"the survey asks for {name}, which nothing reads"


def test_the_surveys_drafters_one_per_line_become_the_list_eval_yml_takes():
    template = next(t for t in CONTROLLER["controller_templates"] if t["playbook"] == "playbooks/eval.yml")
    answer = "/models/drafters/step-2000\n  /models/drafters/step-4000 \n\n"
    extra = {**template["extra_vars"], "specops_drafter_paths": answer}
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible"),
            "localhost",
            "-m",
            "ansible.builtin.debug",
            "-a",
            "var=specops_drafters",
            "-e",
            json.dumps(extra),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "ANSIBLE_LOCALHOST_WARNING": "false",
            "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json",
            "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1",
        },
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)["plays"][0]["tasks"][0]["hosts"]["localhost"]
    assert result["specops_drafters"] == ["/models/drafters/step-2000", "/models/drafters/step-4000"]
