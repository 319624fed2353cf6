"""eval.yml run by a sudoer who is not root, through inventory/production.example as a user takes it.

On the systemd host, the user `deploy` may sudo without a password and runs the play there (the local
connection: the nsenter connection is always root), from the checkout that the container has read-only.
The play must create the run, environment, cache and history directories under /srv, /opt and /var/cache
with escalation for that task alone, owned by deploy, copy the prompts from the control node, and let the
stages up to the prefetch write there as deploy, the adopted unit left serving as it was.
"""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest
import yaml
from nspawn_host import FIXTURES, ROOT, SETTINGS, http_status, in_container, nspawn_unusable, run_in_container

pytestmark = [
    pytest.mark.systemd,
    pytest.mark.slow,
    pytest.mark.skipif(nspawn_unusable() is not None, reason=str(nspawn_unusable())),
]

EXAMPLE = ROOT / "inventory" / "production.example"
USER = "deploy"
HOME = f"/home/{USER}"
UNIT = "sglang-qwen"
PROMPTS = ROOT / "prompts" / "coding.jsonl"
# Where production.example puts the run, the ML environment's parent, the cache and the history.
RUN_DIR = "/srv/specops/run-latest"
CREATED = (RUN_DIR, "/opt/specops", "/var/cache/specops", "/srv/specops/history")


def _inventory() -> dict[str, str]:
    """inventory/production.example with what a user must change: the host, and where the models and
    prompts are (the scenario's fixtures; the checkout's prompts, on the control node)."""
    hosts = yaml.safe_load((EXAMPLE / "hosts.yml").read_text())
    gpu_hosts = hosts["all"]["children"]["gpu_hosts"]["hosts"]
    assert gpu_hosts["gpu-node-1"]["ansible_user"] == USER, "the example no longer connects as deploy"
    gpu_hosts["gpu-node-1"] = {
        "ansible_user": USER,
        "ansible_connection": "local",
        "ansible_python_interpreter": "/usr/bin/python3",
    }
    group_vars = yaml.safe_load((EXAMPLE / "group_vars" / "gpu_hosts.yml").read_text())
    group_vars.update(
        specops_target_model=str(FIXTURES / "target"),
        specops_drafter=str(FIXTURES / "drafter"),
        specops_reference_drafter=str(FIXTURES / "drafter"),
        specops_prompts=str(PROMPTS),
    )
    return {"hosts.yml": yaml.safe_dump(hosts), "group_vars/gpu_hosts.yml": yaml.safe_dump(group_vars)}


def _main_pid() -> str:
    return in_container("systemctl", "show", "--property=MainPID", "--value", f"{UNIT}.service")


@pytest.fixture(scope="module")
def sudoer_run(converged_host):
    root_home_mode = in_container("stat", "--format=%a", "/root")
    pid_before = _main_pid()
    in_container("useradd", "--create-home", "--shell=/bin/bash", USER)
    in_container("tee", f"/etc/sudoers.d/{USER}", stdin=f"{USER} ALL=(ALL) NOPASSWD: ALL\n")
    in_container("chmod", "0440", f"/etc/sudoers.d/{USER}")
    # The checkout's interpreters live under /root/.pyenv: deploy reaches them as it reaches its own.
    in_container("chmod", "0711", "/root")
    try:
        for name, text in _inventory().items():
            in_container("install", "-D", "-o", USER, "-m", "0644", "/dev/null", f"{HOME}/inventory/{name}")
            in_container("tee", f"{HOME}/inventory/{name}", stdin=text)
        # The ML environment is the checkout's: building one in /opt/specops/ml is the environment
        # stage's, which --tags prefetch leaves out. Short completions: the prefetch is what is shown.
        extra = {"specops_python": str(ROOT / ".venv-ml" / "bin" / "python"), "specops_max_new_tokens": 8}
        play = f"cd {ROOT} && exec .venv/bin/ansible-playbook -i {HOME}/inventory playbooks/eval.yml"
        done = run_in_container(
            "runuser",
            "-u",
            USER,
            "--",
            "env",
            "-i",
            f"HOME={HOME}",
            "PATH=/usr/bin:/bin",
            "LANG=C.UTF-8",
            f"ANSIBLE_CONFIG={ROOT / 'ansible.cfg'}",
            "ANSIBLE_NOCOLOR=1",
            "sh",
            "-c",
            f"{play} --tags prefetch -e '{json.dumps(extra)}'",
            timeout=900,
        )
        yield SimpleNamespace(
            rc=done.returncode,
            output=done.stdout + done.stderr,
            owners={path: in_container("stat", "--format=%U %a", path) for path in CREATED},
            # Everything the play left in the directories it created, not owned by deploy.
            not_deploys=in_container("find", *CREATED, "-not", "-user", USER),
            prompts_sha256=in_container("sha256sum", f"{RUN_DIR}/prompts.jsonl").split(" ")[0],
            completions=in_container("ls", f"{RUN_DIR}/completions").split(),
            pid_before=pid_before,
            pid_after=_main_pid(),
            health=http_status(f"http://127.0.0.1:{SETTINGS['sglang_service_port']}/health_generate"),
        )
    finally:
        in_container("rm", "-rf", "/srv/specops", "/opt/specops", "/var/cache/specops")
        in_container("userdel", "--remove", USER)
        in_container("rm", "-f", f"/etc/sudoers.d/{USER}")
        in_container("chmod", root_home_mode, "/root")


def test_a_sudoer_runs_eval_up_to_the_prefetch_in_directories_it_owns(sudoer_run):
    assert sudoer_run.rc == 0, sudoer_run.output[-6000:]
    # Created with escalation, owned by the connecting user; nothing inside them is root's.
    assert sudoer_run.owners == {path: f"{USER} 755" for path in CREATED}
    assert sudoer_run.not_deploys == ""
    # The prompts were copied from the control node, and the prefetch wrote there as deploy.
    assert sudoer_run.prompts_sha256 == hashlib.sha256(PROMPTS.read_bytes()).hexdigest()
    assert {"completions.jsonl", "manifest.json"} <= set(sudoer_run.completions)
    # The adopted unit served throughout: the same process, still answering.
    assert sudoer_run.pid_after == sudoer_run.pid_before and sudoer_run.health == 200
