"""The collection as a new user gets it: built with `make collection`'s script, installed from the
tarball into an empty collections path outside the checkout, its roles documented by ansible-doc,
and the evaluation run by its FQCN (`ansible-playbook specops.drafter.eval`) on the local default,
with nothing of the checkout on any path: the roles, playbooks and the specops package all come
from the installed collection (the package from the wheel it ships, installed by fla_env)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COLLECTION = ROOT / "collections" / "ansible_collections" / "specops" / "drafter"
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "meta" / "argument_specs.yml").is_file())
LOCAL_DEFAULT = ROOT / "inventory" / "local" / "group_vars" / "gpu_hosts.yml"
# The checkout's ML environment provides torch and transformers (seen through a .pth file, as a GPU
# image's venv would be); specops itself must come from the collection's wheel.
ML_BASE_PYTHON = ROOT / ".venv-ml" / "bin" / "python"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(cmd, env, cwd, timeout=300, check=True):
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
    if check:
        assert proc.returncode == 0, (
            f"{cmd} exited {proc.returncode}\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A user's directory outside the checkout: the collection built, then installed there alone."""
    home = tmp_path_factory.mktemp("user")
    assert ROOT not in home.parents
    dist = home / "dist"
    subprocess.run(
        [sys.executable, ROOT / "tools" / "build_collection.py", "--output-path", dist],
        check=True,
        timeout=300,
    )
    (tarball,) = dist.glob("specops-drafter-*.tar.gz")
    collections = home / "collections"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PYTHONPATH"))}
    env.update(
        ANSIBLE_CONFIG=str(home / "ansible.cfg"),
        ANSIBLE_COLLECTIONS_PATH=str(collections),
        ANSIBLE_ROLES_PATH=str(home / "roles"),
        ANSIBLE_HOME=str(home / "ansible-home"),
        ANSIBLE_LOCAL_TEMP=str(home / "tmp"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_RETRY_FILES_ENABLED="0",
    )
    (home / "ansible.cfg").write_text(f"[defaults]\ncollections_path = {collections}\n")
    run([BIN / "ansible-galaxy", "collection", "install", "--offline", tarball, "-p", collections], env, home)
    return {"home": home, "tarball": tarball, "env": env}


def test_the_tarball_ships_the_roles_playbooks_wheel_and_license_but_no_development_files(user):
    with tarfile.open(user["tarball"]) as tar:
        names = set(tar.getnames())
    for role in ROLES:
        assert f"roles/{role}/meta/argument_specs.yml" in names, role
        assert f"roles/{role}/README.md" in names, role
    assert {"playbooks/eval.yml", "playbooks/service.yml", "playbooks/ml_env.yml", "LICENSE"} <= names
    assert [n for n in names if n.startswith("wheels/specops-") and n.endswith(".whl")]
    assert not [n for n in names if n.startswith(("tests/", "changelogs/fragments/")) or "__pycache__" in n]


def test_ansible_doc_lists_every_role_of_the_installed_collection(user):
    proc = run(
        [BIN / "ansible-doc", "-t", "role", "-l", "specops.drafter", "--json"], user["env"], user["home"]
    )
    assert sorted(json.loads(proc.stdout)) == [f"specops.drafter.{role}" for role in ROLES]


@pytest.mark.parametrize("role", ROLES)
def test_ansible_doc_renders_each_role_from_the_installed_collection(user, role):
    proc = run(
        [BIN / "ansible-doc", "-t", "role", f"specops.drafter.{role}", "--json"], user["env"], user["home"]
    )
    doc = json.loads(proc.stdout)[f"specops.drafter.{role}"]
    assert doc["path"].startswith(str(user["home"] / "collections"))
    assert doc["entry_points"]["main"]["options"]


@pytest.fixture(scope="module")
def evaluated(user):
    """eval.yml by its FQCN on the local default's settings, paths moved into the user's directory."""
    if not ML_BASE_PYTHON.exists():
        pytest.fail("no ML environment to take torch from: run `make ml-env` first")
    home = user["home"]
    work = home / "work"
    settings = yaml.safe_load(LOCAL_DEFAULT.read_text())
    # The checkout's own package and paths: the installed collection must do without them.
    settings.pop("fla_env_specops_source", None)
    shutil.copy(ROOT / "prompts" / "coding.jsonl", home / "prompts.jsonl")
    models = Path(os.environ.get("SPECOPS_TEST_MODELS", ROOT / ".work" / "test-models"))
    settings.update(
        specops_root=str(home),
        specops_work_dir=str(work),
        specops_models_dir=str(models),
        specops_prompts=str(home / "prompts.jsonl"),
        fla_env_venv=str(home / "ml"),
        fla_env_python=str(ML_BASE_PYTHON),
        fla_env_system_site_packages=True,
        sglang_service_port=free_port(),
        sglang_service_ready_delay=1,
    )
    inventory = home / "inventory"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "group_vars" / "gpu_hosts.yml").write_text(yaml.safe_dump(settings))
    hosts = {
        "all": {
            "children": {
                "gpu_hosts": {
                    "hosts": {
                        "localhost": {
                            "ansible_connection": "local",
                            "ansible_python_interpreter": sys.executable,
                        }
                    }
                }
            }
        }
    }
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts))
    play = ["-i", inventory]
    proc = run(
        [BIN / "ansible-playbook", "specops.drafter.eval", *play],
        user["env"],
        home,
        timeout=1800,
        check=False,
    )
    yield {"proc": proc, "work": work, "port": settings["sglang_service_port"], "venv": home / "ml"}
    run(
        [
            BIN / "ansible-playbook",
            "specops.drafter.service",
            *play,
            "-e",
            "sglang_service_state=stopped",
            "-e",
            "sglang_service_guard=false",
        ],
        user["env"],
        home,
        check=False,
    )


def test_eval_by_fqcn_from_the_installed_collection_writes_the_report(evaluated):
    proc = evaluated["proc"]
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert (evaluated["work"] / "run" / "score" / "report.md").is_file()
    assert json.loads((evaluated["work"] / "run" / "score" / "report.json").read_text())


def test_the_service_is_back_and_ready_after_the_run(evaluated):
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{evaluated['port']}/health_generate", timeout=30
        ) as answer:
            status = answer.status
    except urllib.error.HTTPError as error:
        status = error.code
    assert status == 200


def test_the_ml_environment_runs_specops_from_the_collections_wheel(evaluated):
    python = evaluated["venv"] / "bin" / "python"
    probe = (
        "import json, specops; from importlib import metadata; d = metadata.distribution('specops'); "
        "print(json.dumps([specops.__file__, d.read_text('direct_url.json')]))"
    )
    where, direct_url = json.loads(
        subprocess.run(
            [python, "-c", probe],
            capture_output=True,
            text=True,
            check=True,
            env={"PATH": os.environ["PATH"]},
        ).stdout
    )
    assert where.startswith(str(evaluated["venv"])), where
    assert (
        json.loads(direct_url)["url"].endswith(".whl")
        and "/ansible_collections/specops/drafter/" in direct_url
    )
