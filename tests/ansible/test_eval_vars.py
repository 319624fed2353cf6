"""The eval playbook's own variables: one specification (roles/eval_vars/meta/argument_specs.yml, what
`ansible-doc -t role specops.drafter.eval_vars` shows), checked by the play's first task on every host
with every problem in one message, before any host is touched. The roles' variables with defaults are
not the play's to report."""

from __future__ import annotations

import ast
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
SPEC = yaml.safe_load((ROOT / "roles" / "eval_vars" / "meta" / "argument_specs.yml").read_text())
OPTIONS = SPEC["argument_specs"]["main"]["options"]
PLAYS = [ROOT / "playbooks" / "eval.yml", *sorted((ROOT / "playbooks" / "tasks").glob("*.yml"))]


def bare_run(tmp_path: Path, **extra) -> tuple[int, str]:
    """eval.yml on two hosts of an inventory that sets nothing; (rc, the output as one line)."""
    inventory = tmp_path / "hosts.yml"
    host = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory.write_text(yaml.safe_dump({"gpu_hosts": {"hosts": {"first": host, "second": host}}}))
    done = subprocess.run(
        [str(PLAYBOOK), "-i", str(inventory), str(ROOT / "playbooks" / "eval.yml"), "-e", json.dumps(extra)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
        timeout=600,
    )
    return done.returncode, " ".join(done.stdout.split()).replace("''", "'")


def test_a_bare_inventory_gets_every_problem_in_one_message_before_any_host_is_touched(tmp_path):
    rc, said = bare_run(
        tmp_path,
        specops_gpu_window_mode="unload",
        specops_max_new_tokens="many",
        specops_demo_models=True,
        specops_prestart_lease_s=600,
    )
    assert rc != 0
    missing = re.search(r"missing required arguments: ([a-z_, ]+);", said)
    assert missing, said[-3000:]
    assert sorted(missing.group(1).replace(" ", "").split(",")) == [
        "specops_drafter",
        "specops_models_dir",
        "specops_prompts",
        "specops_run_dir",
        "specops_target_model",
    ]
    assert "specops_max_new_tokens' is of type str" in said
    assert "specops_gpu_window_mode must be one of: stop, memory_saver, got: unload" in said
    assert "ansible-doc -t role specops.drafter.eval_vars" in said
    # A variable under its old name is named with its new one, not ignored.
    assert "specops_prestart_lease_s was renamed extract_hidden_states_prestart_lease" in said
    # Reported for each host, and the play went no further: no fleet placement, no directory, no lock.
    assert "fatal: [first]: FAILED! => changed: false msg: 'the evaluation's variables are not usable" in said
    assert (
        "fatal: [second]: FAILED! => changed: false msg: 'the evaluation's variables are not usable" in said
    )
    assert "Place this host in the fleet" not in said
    # The roles' own variables (fla_env_venv, sglang_service_*) have defaults: not the play's to report.
    assert "fla_env_venv" not in said and "sglang_service" not in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hosts.yml"]


def test_specops_drafters_stands_in_for_specops_drafter():
    # The check's one rule the spec cannot say alone: required unless the list is given.
    tasks = (ROOT / "roles" / "eval_vars" / "tasks" / "main.yml").read_text()
    assert "'specops_drafter': {'required': specops_drafters is not defined}" in tasks
    assert "specops_drafters" in OPTIONS and not OPTIONS["specops_drafter"].get("required")


def defaults_in_playbooks() -> dict[str, set]:
    """{variable: every literal `variable | default(X)` the playbooks apply}."""
    found: dict[str, set] = {}
    for path in PLAYS:
        for name, value in re.findall(r"\b(specops_\w+) \| default\(([^()]*)\)", path.read_text()):
            try:
                # Jinja's true and false are Python's True and False.
                literal = ast.literal_eval({"true": "True", "false": "False"}.get(value, value))
            except (ValueError, SyntaxError):
                continue  # a variable's default is another variable: nothing to compare
            found.setdefault(name, set()).add(json.dumps(literal))
    return found


@pytest.mark.parametrize("name", sorted(n for n, o in OPTIONS.items() if "default" in o))
def test_a_documented_default_is_the_one_the_playbook_applies(name):
    applied = defaults_in_playbooks().get(name)
    assert applied, f"{name} has a documented default the playbooks never apply"
    documented = OPTIONS[name]["default"]
    # The playbooks write numbers as Jinja literals; 0 and 0.0 are the same default.
    assert {
        json.dumps(documented),
        json.dumps(float(documented)) if isinstance(documented, int) else "",
    } & applied, f"{name}: documented {documented!r}, applied {applied}"


def defined_by_the_playbooks() -> set[str]:
    """Variables the playbooks set themselves (vars:, set_fact, register, loop variables)."""
    defined: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "vars" and isinstance(value, dict):
                    defined.update(value)
                elif key in ("ansible.builtin.set_fact", "set_fact") and isinstance(value, dict):
                    defined.update(value)
                elif key in ("ansible.builtin.set_stats", "set_stats"):
                    defined.update(value["data"])  # what AWX reads, not a variable the play reads
                elif key == "register":
                    defined.add(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for path in PLAYS:
        walk(yaml.safe_load(path.read_text()))
    text = "\n".join(p.read_text() for p in PLAYS)
    defined.update(re.findall(r"\{%-?\s*set (\w+)", text))
    return defined


def test_every_specops_variable_the_playbooks_read_and_never_set_is_documented():
    text = "\n".join(p.read_text() for p in PLAYS)
    read = set(re.findall(r"\b(specops_\w+)", text))
    inputs = read - defined_by_the_playbooks()
    assert sorted(inputs - set(OPTIONS)) == []
