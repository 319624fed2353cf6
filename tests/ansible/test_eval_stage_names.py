"""The stage eval.yml's rescue names when the failed task is none of the stage modules: a role's argument
validation (Ansible's own task) names the stage that includes the role, and a task of eval.yml's own
(`Stage <name>: ...`) names its stage, not a tag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
