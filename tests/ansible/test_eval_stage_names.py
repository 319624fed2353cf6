"""A role variable that its meta/argument_specs.yml refuses fails in Ansible's validation task, which is
none of the play's stages: eval.yml's rescue names the stage that includes the role, not a tag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"


def test_an_invalid_role_variable_is_named_with_the_stage_that_includes_the_role(tmp_path):
    # --tags prefetch: the stages up to the prefetch; the `serve` stage's role refuses the port before it
    # runs any task, so nothing is started. Its tasks carry the tag `prefetch`, the old fallback's answer.
    extra = {"specops_work_dir": str(tmp_path), "sglang_service_port": "not-a-port"}
    done = subprocess.run(
        [str(PLAYBOOK), str(ROOT / "playbooks" / "eval.yml"), "-e", json.dumps(extra), "--tags", "prefetch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
        timeout=600,
    )
    said = " ".join(done.stdout.split())
    assert done.returncode != 0
    assert "specops stage 'serve' failed: Validation of arguments failed:" in said, done.stdout[-3000:]
    assert "argument 'sglang_service_port' is of type str" in said
    assert "(the service was not taken down)" in said
    assert not (tmp_path / "sglang.pid").exists()
