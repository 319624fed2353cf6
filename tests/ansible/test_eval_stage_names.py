"""The stage eval.yml's rescue names when the failed task is none of the stage modules: a role's argument
validation (Ansible's own task) names the stage that includes the role, and a task of eval.yml's own
(`Stage <name>: ...`) names its stage, not a tag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"


def run_eval(extra: dict, tags: str) -> tuple[int, str]:
    """eval.yml on the local default, limited to `tags`; (rc, the output as one line)."""
    done = subprocess.run(
        [str(PLAYBOOK), str(ROOT / "playbooks" / "eval.yml"), "-e", json.dumps(extra), "--tags", tags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
        timeout=600,
    )
    return done.returncode, " ".join(done.stdout.split()).replace("''", "'")


def test_an_invalid_role_variable_is_named_with_the_stage_that_includes_the_role(tmp_path):
    # --tags prefetch: the stages up to the prefetch; the `serve` stage's role refuses the port before it
    # runs any task, so nothing is started. Its tasks carry the tag `prefetch`, the old fallback's answer.
    rc, said = run_eval({"specops_work_dir": str(tmp_path), "sglang_service_port": "not-a-port"}, "prefetch")
    assert rc != 0
    assert "specops stage 'serve' failed: Validation of arguments failed:" in said, said[-3000:]
    assert "argument 'sglang_service_port' is of type str" in said
    assert "(the service was not taken down)" in said
    assert not (tmp_path / "sglang.pid").exists()


def test_a_failed_stage_task_of_the_playbook_is_named_with_its_stage_and_each_failed_item(tmp_path):
    # A run directory under a regular file: the directories task, the play's first, fails for that item.
    (tmp_path / "a-file").touch()
    run_dir = tmp_path / "a-file" / "run"
    rc, said = run_eval({"specops_work_dir": str(tmp_path), "specops_run_dir": str(run_dir)}, "never-a-stage")
    assert rc != 0
    assert f"specops stage 'directories' failed: One or more items failed: {run_dir}: install:" in said, said[
        -3000:
    ]
    assert "Not a directory (the service was not taken down)" in said


# -- the rescue's lookup, rendered for every key of its tables ----------------------------------------
# The rescue's own task, taken from eval.yml and run against failures described as Ansible describes them
# (ansible_failed_task, ansible_failed_result): one play for every case.

EVAL_PLAY = next(
    play for play in yaml.safe_load((ROOT / "playbooks" / "eval.yml").read_text()) if "serial" in play
)
EVAL_BLOCK = next(task for task in EVAL_PLAY["tasks"] if "rescue" in task)
RESCUE_NAMING = EVAL_BLOCK["rescue"][0]
STAGE_OF = EVAL_PLAY["vars"]["specops_stage_of"]
STAGE_OF_ROLE = EVAL_PLAY["vars"]["specops_stage_of_role"]
# A table's templated entries, as they read before the window opens (outside it nothing else is set; the
# scoring replica's calls, after the window, read `scoring-replica`).
MODULE_BEFORE_THE_WINDOW = {
    "sglang_service:started": "serve",
    "sglang_service:stopped": "stop-server",
    "sglang_service:released": "release-server",
    "sglang_service:resumed": "resume-server",
    # The window in one step, failed before its release answered.
    "sglang_service:window": "release-server",
    "gpu_release": "gpu-holders",
    "job_wait": "prestart-extraction",
    "uri": "router",
}
ROLE_BEFORE_THE_WINDOW = {
    "fla_env": "environment",
    "sglang_service": "serve",
    "sglang_router": "drain",
    "gpu_release": "release-gpus",
}
# Names of a dict's own methods: Jinja's table[name] finds these when the table has no such key.
DICT_METHODS = sorted(name for name in dir(dict) if not name.startswith("_"))


def module_case(key: str) -> dict:
    module, _, state = key.partition(":")
    return {
        "task": {
            "action": f"specops.drafter.{module}",
            "args": {"state": state} if state else {},
            "name": "x",
        },
        "result": {"msg": "it failed"},
    }


def role_case(key: str) -> dict:
    role, _, entry = key.partition(":")
    context = {"name": role, **({"argument_spec_name": entry} if entry else {})}
    return {
        "task": {"action": "validate_argument_spec", "args": {}},
        "result": {"validate_args_context": context},
    }


CASES = {
    **{
        f"module {key}": (module_case(key), MODULE_BEFORE_THE_WINDOW.get(key, STAGE_OF[key]))
        for key in STAGE_OF
    },
    **{
        f"role {key}": (role_case(key), ROLE_BEFORE_THE_WINDOW.get(key, STAGE_OF_ROLE[key]))
        for key in STAGE_OF_ROLE
    },
    # A module no table names, whose name is a dict method: the task's `Stage <name>:` names the stage
    # (eval.yml's prompts copy is ansible.builtin.copy), or else its tag.
    **{
        f"named task {name}": (
            {
                "task": {"action": f"ansible.builtin.{name}", "args": {}, "name": "Stage prompts: copy them"},
                "result": {},
            },
            "prompts",
        )
        for name in DICT_METHODS
    },
    **{
        f"tagged task {name}": (
            {
                "task": {"action": name, "args": {}, "name": "x", "tags": ["always", "environment"]},
                "result": {},
            },
            "environment",
        )
        for name in DICT_METHODS
    },
    **{f"role {name}": (role_case(name), "?") for name in DICT_METHODS},
}


@pytest.fixture(scope="module")
def named_stages(tmp_path_factory) -> dict[str, str]:
    """{case: the stage the rescue names}, from one play."""
    work = tmp_path_factory.mktemp("rescue")
    (work / "name_one.yml").write_text(
        yaml.safe_dump(
            [
                RESCUE_NAMING,
                {
                    "name": "Keep the answer",
                    "ansible.builtin.set_fact": {
                        "named": "{{ named | default({}) | combine({case: specops_failed_stage | trim}) }}"
                    },
                },
            ]
        )
    )
    play = [
        {
            "name": "Name the stage of each failure",
            "hosts": "localhost",
            "gather_facts": False,
            "vars": {
                "specops_stage_of": STAGE_OF,
                "specops_stage_of_role": STAGE_OF_ROLE,
                "cases": {name: case for name, (case, _) in CASES.items()},
            },
            "tasks": [
                {
                    "name": "Name one",
                    "ansible.builtin.include_tasks": str(work / "name_one.yml"),
                    "loop": "{{ cases | dict2items }}",
                    "vars": {
                        "case": "{{ item.key }}",
                        "ansible_failed_task": "{{ item.value.task }}",
                        "ansible_failed_result": "{{ item.value.result }}",
                    },
                },
                {
                    "name": "Keep them",
                    "ansible.builtin.copy": {
                        "content": "{{ named | to_json }}",
                        "dest": str(work / "named.json"),
                    },
                },
            ],
        }
    ]
    (work / "play.yml").write_text(yaml.safe_dump(play))
    done = subprocess.run(
        [
            str(PLAYBOOK),
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            str(work / "play.yml"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
        timeout=600,
    )
    failed = done.stdout[done.stdout.find("fatal:") :]
    assert done.returncode == 0, failed[:4000] + done.stderr[-2000:]
    return json.loads((work / "named.json").read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rescue_names_the_stage_of_every_key_and_never_a_dicts_method(named_stages, case):
    assert named_stages[case] == CASES[case][1]


def test_every_key_of_both_tables_and_the_prompts_copy_are_cases():
    assert {f"module {key}" for key in STAGE_OF} | {f"role {key}" for key in STAGE_OF_ROLE} <= set(CASES)
    assert "named task copy" in CASES
