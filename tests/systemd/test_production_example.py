"""inventory/production.example, taken as a user takes it, adopts the team's own unit on a systemd host.

The user's unit `sglang-qwen` runs as its own user with its own flags and environment; the example is
copied and only what a user must change is changed (the host, the model and prompt paths, the ML
environment). playbooks/service.yml then stops and starts the unit through that inventory, after a
`--check --diff` run, and the unit must come out of it exactly as the user wrote it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from nspawn_host import (
    FIXTURES,
    MACHINE,
    ROOT,
    SETTINGS,
    container_pid,
    http_status,
    in_container,
    molecule_env,
    nspawn_unusable,
)

from specops.devserver.launch import free_port

pytestmark = [
    pytest.mark.systemd,
    pytest.mark.slow,
    pytest.mark.skipif(nspawn_unusable() is not None, reason=str(nspawn_unusable())),
]

EXAMPLE = ROOT / "inventory" / "production.example"
UNIT = "sglang-qwen"
UNIT_FILE = f"/etc/systemd/system/{UNIT}.service"
# Properties of the unit that the user decided and the role must leave as they are.
USER_PROPERTIES = [
    "FragmentPath",
    "DropInPaths",
    "User",
    "Group",
    "Environment",
    "WorkingDirectory",
    "Restart",
    "KillMode",
    "TimeoutStopUSec",
    "UnitFileState",
]
# Where the container finds the development server's Python (bound in at the same path as here).
SERVER_PYTHON = ROOT / ".venv-ml" / "bin" / "python"
# What a user must change in group_vars/gpu_hosts.yml: where the models, prompts and ML environment
# are on their host. Everything else (adopt mode, unit name, become, gpu_release_unit) stays as shipped.
USER_EDITS = {
    "specops_target_model": str(FIXTURES / "target"),
    "specops_drafter": str(FIXTURES / "drafter"),
    "specops_reference_drafter": str(FIXTURES / "drafter"),
    "specops_prompts": str(ROOT / "prompts" / "coding.jsonl"),
    "fla_env_venv": str(ROOT / ".venv-ml"),
}


def _user_unit(port: int) -> str:
    """The team's unit, as a team writes it: its own user, flags and environment."""
    return f"""\
# Owned by the inference team; deployed by their own tooling.
[Unit]
Description=Qwen3.6-27B behind SGLang (inference team)
After=network-online.target
Wants=network-online.target

[Service]
User=inference
Group=inference
WorkingDirectory=/tmp
Environment="PYTHONPATH={ROOT / "src"}" HF_HUB_OFFLINE=1
Environment=XDG_CACHE_HOME=/tmp/inference-cache TEAM_DEPLOY_ID=qwen-2026-11-30
ExecStart={SERVER_PYTHON} -m specops.devserver \\
    --model-path {FIXTURES / "target"} --served-model-name qwen3.6-27b \\
    --host 127.0.0.1 --port={port} --tp-size 2 --weight-version team-build-7 \\
    --speculative-algorithm DFLASH --speculative-draft-model-path {FIXTURES / "drafter"} \\
    --speculative-num-draft-tokens 8 --startup-delay 3 --log-level warning
Restart=on-failure
RestartSec=5
TimeoutStopSec=45

[Install]
WantedBy=multi-user.target
"""


def _unit_sha256() -> str:
    return in_container("sha256sum", UNIT_FILE).split()[0]


def _unit_properties() -> dict[str, str]:
    shown = in_container(
        "systemctl", "show", f"{UNIT}.service", *(f"--property={name}" for name in USER_PROPERTIES)
    )
    properties = dict(line.split("=", 1) for line in shown.splitlines())
    # ExecStart also carries the last run's pid and times: keep only the command line.
    exec_start = in_container("systemctl", "show", f"{UNIT}.service", "--property=ExecStart", "--value")
    properties["ExecStart argv"] = exec_start.split("argv[]=", 1)[1].split(" ;", 1)[0]
    return properties


def _user_inventory(into: Path) -> Path:
    """inventory/production.example copied and edited as its first comment tells a user to."""
    inventory = into / "production"
    shutil.copytree(EXAMPLE, inventory)
    hosts_file = inventory / "hosts.yml"
    hosts = yaml.safe_load(hosts_file.read_text())
    assert hosts["all"]["children"]["gpu_hosts"]["hosts"], "the example names no GPU host to replace"
    # The one host, reached the way the suite reaches the container (instead of ssh to gpu-node-1).
    hosts["all"]["children"]["gpu_hosts"]["hosts"] = {
        MACHINE: {
            "ansible_connection": "community.docker.nsenter",
            "ansible_nsenter_pid": container_pid(),
            "ansible_python_interpreter": "/usr/bin/python3",
        }
    }
    hosts_file.write_text(yaml.safe_dump(hosts))
    group_vars_file = inventory / "group_vars" / "gpu_hosts.yml"
    group_vars = yaml.safe_load(group_vars_file.read_text())
    missing = sorted(set(USER_EDITS) - set(group_vars))
    assert not missing, f"the example no longer has {missing}: a user would not know to set them"
    group_vars.update(USER_EDITS)
    group_vars_file.write_text(yaml.safe_dump(group_vars))
    return inventory


@dataclass
class ProductionRun:
    port: int
    shipped: dict
    sha256_before: str
    properties_before: dict[str, str]
    check: dict
    stopped: dict
    active_while_stopped: str
    started: dict
    health_after_start: int
    sha256_after: str
    properties_after: dict[str, str]
    drop_in_dirs: str


def _service_play(inventory: Path, state: str, *options: str) -> dict:
    """playbooks/service.yml through the user's inventory; the json callback's result."""
    env = molecule_env()
    env["ANSIBLE_STDOUT_CALLBACK"] = "ansible.builtin.json"
    done = subprocess.run(
        [
            str(ROOT / ".venv" / "bin" / "ansible-playbook"),
            "-i",
            str(inventory),
            str(ROOT / "playbooks" / "service.yml"),
            "-e",
            f"sglang_service_state={state}",
            *options,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (
        f"service.yml {state} {' '.join(options)} failed:\n{done.stdout[-8000:]}{done.stderr[-3000:]}"
    )
    return json.loads(done.stdout)


def _results(play: dict) -> list[tuple[str, dict]]:
    """(task name without its role's prefix, result on the host) for every task the playbook ran, in
    every play (service.yml looks in check mode first, then acts in the play that fits the change)."""
    return [
        (task["task"]["name"].split(" : ", 1)[-1], task["hosts"][MACHINE])
        for each in play["plays"]
        for task in each["tasks"]
        if MACHINE in task["hosts"]
    ]


def _wait_for_health(url: str, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while (status := http_status(url)) != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    return status


@pytest.fixture(scope="module")
def production_run(converged_host, tmp_path_factory) -> ProductionRun:
    """Install the team's unit in place of the scenario's, run the plays, put the scenario's unit back."""
    in_container("cp", "--preserve=all", UNIT_FILE, "/root/scenario-unit.service")
    root_home_mode = in_container("stat", "--format=%a", "/root")
    port = free_port()
    in_container("systemctl", "stop", f"{UNIT}.service")
    try:
        in_container("useradd", "--system", "--no-create-home", "--shell=/usr/sbin/nologin", "inference")
        # The bound-in interpreter lives under /root/.pyenv, and safetensors writes the fixture
        # weights private: the team's user must reach both, as it reaches its models on its host.
        in_container("chmod", "0711", "/root")
        for weights in FIXTURES.glob("*/model.safetensors"):
            weights.chmod(0o644)
        in_container("tee", UNIT_FILE, stdin=_user_unit(port))
        in_container("systemctl", "daemon-reload")
        in_container("systemctl", "enable", "--now", f"{UNIT}.service")
        url = f"http://127.0.0.1:{port}/health_generate"
        assert _wait_for_health(url, 90) == 200, in_container("journalctl", "--no-pager", "-n40", "-u", UNIT)
        sha256_before, properties_before = _unit_sha256(), _unit_properties()
        inventory = _user_inventory(tmp_path_factory.mktemp("inventory"))

        check = _service_play(inventory, "started", "--check", "--diff")
        stopped = _service_play(inventory, "stopped")
        active_while_stopped = in_container("systemctl", "is-active", f"{UNIT}.service")
        started = _service_play(inventory, "started")
        yield ProductionRun(
            port=port,
            shipped=yaml.safe_load((EXAMPLE / "group_vars" / "gpu_hosts.yml").read_text()),
            sha256_before=sha256_before,
            properties_before=properties_before,
            check=check,
            stopped=stopped,
            active_while_stopped=active_while_stopped,
            started=started,
            health_after_start=http_status(url),
            sha256_after=_unit_sha256(),
            properties_after=_unit_properties(),
            drop_in_dirs=in_container(
                "sh",
                "-c",
                f"ls -d /etc/systemd/system/{UNIT}.service.d "
                f"/run/systemd/system/{UNIT}.service.d 2>/dev/null; true",
            ),
        )
    finally:
        in_container("systemctl", "disable", "--now", f"{UNIT}.service")
        in_container("mv", "/root/scenario-unit.service", UNIT_FILE)
        in_container("chmod", root_home_mode, "/root")
        in_container("systemctl", "daemon-reload")
        in_container("systemctl", "start", f"{UNIT}.service")
        # The other tests of the session find the scenario's server as converge left it: ready.
        _wait_for_health(f"http://127.0.0.1:{SETTINGS['sglang_service_port']}/health_generate", 180)


def test_the_example_ships_adopt_mode_with_become_for_the_unit_sglang_qwen(production_run):
    shipped = production_run.shipped
    assert shipped["sglang_service_unit_name"] == UNIT
    assert shipped["sglang_service_manage_unit"] is False
    assert shipped["sglang_service_become"] is True and shipped["gpu_release_become"] is True
    assert shipped["gpu_release_unit"] == UNIT
    # The port is the unit's business: the role must read it, not be told it.
    assert shipped.get("sglang_service_port", 30000) != production_run.port


def test_check_mode_reports_no_change_to_the_unit(production_run):
    changed = [name for name, result in _results(production_run.check) if result.get("changed")]
    touching = [
        name
        for name, result in _results(production_run.check)
        if UNIT_FILE in json.dumps(result.get("diff", {}))
        or (name.startswith("Bring the server to") and result.get("changed"))
    ]
    assert not touching, f"check mode would change the unit: {touching}"
    assert production_run.check["stats"][MACHINE]["failures"] == 0
    # Check mode writes nothing on the host: the module only reads the unit and the server.
    assert not changed, changed


def test_stopped_stops_the_adopted_unit(production_run):
    assert production_run.active_while_stopped == "inactive"
    assert production_run.stopped["stats"][MACHINE]["failures"] == 0


def test_the_unit_file_is_byte_identical_after_stop_and_start(production_run):
    assert production_run.sha256_after == production_run.sha256_before


def test_no_drop_in_is_written_and_the_users_settings_stay(production_run):
    assert production_run.drop_in_dirs == ""
    assert production_run.properties_after == production_run.properties_before
    assert production_run.properties_after["DropInPaths"] == ""
    assert production_run.properties_after["User"] == "inference"
    assert "TEAM_DEPLOY_ID=qwen-2026-11-30" in production_run.properties_after["Environment"]


def test_the_server_answers_health_generate_after_start(production_run):
    assert production_run.health_after_start == 200


def test_the_role_learned_the_port_from_the_unit(production_run):
    # The module read the adopted unit's --port and --host from its ExecStart.
    urls = [
        result.get("url", "")
        for name, result in _results(production_run.started)
        if name.startswith("Bring the server to")
    ]
    assert urls, "the start play did not call the sglang_service module"
    assert urls[0] == f"http://127.0.0.1:{production_run.port}", urls
