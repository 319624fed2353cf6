"""The collection as people adopt it: a galaxy tarball (built by tools/build_collection.py, what
`make collection` runs) that installs offline and whose modules run,
an execution environment that ansible-builder turns into a build context, and the AWX objects
(job template and weekly schedule) that run playbooks/eval.yml."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COLLECTION = ROOT / "collections" / "ansible_collections" / "specops" / "drafter"
BIN = Path(sys.executable).parent
GALAXY = yaml.safe_load((COLLECTION / "galaxy.yml").read_text())
TARBALL_NAME = f"{GALAXY['namespace']}-{GALAXY['name']}-{GALAXY['version']}.tar.gz"
MODULES = sorted(p.stem for p in (COLLECTION / "plugins" / "modules").glob("*.py") if p.stem != "__init__")


def run(cmd, env=None, cwd=None):
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )
    assert proc.returncode == 0, (
        f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The collection built as `make collection` builds it, into a fresh directory."""
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, ROOT / "tools" / "build_collection.py", "--output-path", dist])
    return dist / TARBALL_NAME


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory):
    """The tarball installed, offline, into a collections path of its own, with an ansible.cfg
    that points only there (the checkout's ansible.cfg would find the source tree instead)."""
    home = tmp_path_factory.mktemp("installed")
    collections = home / "collections"
    cfg = home / "ansible.cfg"
    cfg.write_text(f"[defaults]\ncollections_path = {collections}\nretry_files_enabled = false\n")
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(cfg),
        ANSIBLE_COLLECTIONS_PATH=str(collections),
        ANSIBLE_LOCAL_TEMP=str(home / "tmp"),
        ANSIBLE_HOME=str(home / "ansible-home"),
    )
    run(
        [BIN / "ansible-galaxy", "collection", "install", "--offline", built, "-p", collections],
        env=env,
        cwd=home,
    )
    return {"path": collections, "env": env, "cwd": home}


def test_build_names_the_tarball_after_galaxy_yml(built):
    assert built.is_file()


def test_the_tarball_holds_every_module_the_runtime_metadata_and_the_changelog(built):
    with tarfile.open(built) as tar:
        names = set(tar.getnames())
        manifest = json.load(tar.extractfile("MANIFEST.json"))
    for module in MODULES:
        assert f"plugins/modules/{module}.py" in names
    for path in (
        "meta/runtime.yml",
        "meta/execution-environment.yml",
        "changelogs/changelog.yaml",
        "plugins/module_utils/stages/stage_runner.py",
        "README.md",
    ):
        assert path in names, path
    assert manifest["collection_info"]["version"] == GALAXY["version"]


def test_the_tarball_leaves_out_test_output_and_caches(built):
    with tarfile.open(built) as tar:
        names = tar.getnames()
    assert not [n for n in names if n.startswith("tests/output") or "__pycache__" in n or n.endswith(".pyc")]


def test_the_installed_collection_is_the_one_ansible_finds(installed):
    proc = run(
        [BIN / "ansible-galaxy", "collection", "list", "specops.drafter", "--format", "json"],
        env=installed["env"],
        cwd=installed["cwd"],
    )
    found = json.loads(proc.stdout)
    assert list(found) == [str(installed["path"] / "ansible_collections")]
    assert (
        found[str(installed["path"] / "ansible_collections")]["specops.drafter"]["version"]
        == GALAXY["version"]
    )


@pytest.mark.parametrize("module", MODULES)
def test_ansible_doc_renders_every_installed_module(installed, module):
    proc = run(
        [BIN / "ansible-doc", "--json", "-t", "module", f"specops.drafter.{module}"],
        env=installed["env"],
        cwd=installed["cwd"],
    )
    doc = json.loads(proc.stdout)[f"specops.drafter.{module}"]
    assert doc["doc"]["filename"].startswith(str(installed["path"]))
    assert doc["doc"]["options"], "a module documents its options"
    assert doc["examples"].strip()
    assert doc["return"]
    assert doc["doc"]["attributes"]["check_mode"]["support"] in ("full", "partial")


def test_a_module_from_the_installed_copy_runs_in_check_mode(installed, tmp_path):
    env = dict(
        installed["env"], ANSIBLE_LOAD_CALLBACK_PLUGINS="1", ANSIBLE_STDOUT_CALLBACK="ansible.builtin.json"
    )
    args = {
        "patterns": ["specops-build-test-matches-nothing"],
        "device_pattern": str(tmp_path / "nvidia*"),
        "nvml": "false",
    }
    proc = run(
        [
            BIN / "ansible",
            "localhost",
            "-m",
            "specops.drafter.gpu_release",
            "-a",
            json.dumps(args),
            "--check",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
        ],
        env=env,
        cwd=installed["cwd"],
    )
    result = json.loads(proc.stdout)["plays"][0]["tasks"][0]["hosts"]["localhost"]
    assert result.get("failed") is not True, result
    assert result["changed"] is False
    assert result["targets"] == [] and result["killed"] == []


# --- execution environment -------------------------------------------------------------------

EE_FILE = ROOT / "awx" / "execution-environment.yml"
EE = yaml.safe_load(EE_FILE.read_text())


def test_the_execution_environment_installs_the_collection_it_ships_in_with_the_lock_beside_it():
    assert EE["version"] == 3
    assert EE["dependencies"]["galaxy"]["collections"] == [
        {"name": "collections/specops/drafter", "type": "dir"}
    ]
    assert [(f["src"], f["dest"]) for f in EE["additional_build_files"]] == [
        ("..", "collections/specops/drafter"),
        ("control.lock", "locks"),
    ]


@pytest.fixture(scope="module")
def ee_build(built, tmp_path_factory):
    """`ansible-builder create` on the execution environment of the tarball alone, extracted into an
    empty directory: nothing of the checkout is there."""
    work = tmp_path_factory.mktemp("ee")
    collection = work / "ansible_collections" / "specops" / "drafter"
    collection.mkdir(parents=True)
    with tarfile.open(built) as tar:
        tar.extractall(collection, filter="data")
    context = work / "context"
    proc = run(
        [
            BIN / "ansible-builder",
            "create",
            "-f",
            collection / "awx" / "execution-environment.yml",
            "--context",
            context,
            "--output-filename",
            "Containerfile",
        ],
        cwd=work,
    )
    return {"context": context, "output": proc.stdout + proc.stderr}


@pytest.fixture(scope="module")
def ee_context(ee_build):
    return ee_build["context"]


def test_ansible_builder_finds_every_input_in_the_collection_alone(ee_build):
    # ansible-builder only warns about an input it cannot find, and says "Complete!" all the same.
    assert "No matches" not in ee_build["output"], ee_build["output"]


def test_ansible_builder_create_writes_a_containerfile_from_the_base_image(ee_context):
    containerfile = (ee_context / "Containerfile").read_text()
    assert f'ARG EE_BASE_IMAGE="{EE["images"]["base_image"]["name"]}"' in containerfile
    assert "ansible-galaxy collection install" in containerfile
    assert "ansible-core==2.21.5" in containerfile and "ansible-runner" in containerfile


def test_the_build_context_holds_the_collection_and_the_requirements(ee_context):
    build = ee_context / "_build"
    manifest = json.loads((build / "collections" / "specops" / "drafter" / "MANIFEST.json").read_text())
    assert manifest["collection_info"]["version"] == GALAXY["version"]
    galaxy = yaml.safe_load((build / "requirements.yml").read_text())
    assert galaxy["collections"] == [{"name": "collections/specops/drafter", "type": "dir"}]
    assert (build / "requirements.txt").read_text().split() == EE["dependencies"]["python"]
    assert "openssh-clients [platform:rpm]" in (build / "bindep.txt").read_text()
    assert (build / "locks" / "control.lock").read_text() == (
        ROOT / "requirements" / "control.lock"
    ).read_text()


def test_the_image_s_collection_step_installs_the_collection_from_the_build_context(ee_context, tmp_path):
    # What the Containerfile runs in _build: ansible-galaxy collection install -r requirements.yml.
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(tmp_path), ANSIBLE_HOME=str(tmp_path / "home"))
    run(
        [
            BIN / "ansible-galaxy",
            "collection",
            "install",
            "--offline",
            "-r",
            "requirements.yml",
            "-p",
            tmp_path,
        ],
        env=env,
        cwd=ee_context / "_build",
    )
    assert (tmp_path / "ansible_collections" / "specops" / "drafter" / "playbooks" / "eval.yml").is_file()


def test_introspection_finds_the_collections_own_python_and_system_dependencies(installed):
    proc = run([BIN / "ansible-builder", "introspect", "--sanitize", installed["path"]])
    deps = yaml.safe_load(proc.stdout)
    assert any(line.startswith("nvidia-ml-py") for line in deps["python"])
    assert any(line.startswith("procps") for line in deps["system"])


# --- AWX configuration as code ---------------------------------------------------------------

AWX = yaml.safe_load((ROOT / "awx" / "controller.yml").read_text())
TEMPLATE = next(t for t in AWX["controller_templates"] if t["playbook"] == "playbooks/eval.yml")


def names(kind):
    return {item["name"] for item in AWX[kind]}


def test_the_job_template_runs_eval_yml_from_the_project():
    assert (ROOT / TEMPLATE["playbook"]).is_file()
    # A project made of a copy of awx/project/ runs the collection's playbook by name.
    imported = yaml.safe_load((ROOT / "awx" / "project" / TEMPLATE["playbook"]).read_text())
    assert imported[0]["ansible.builtin.import_playbook"] == "specops.drafter.eval"
    assert TEMPLATE["project"] in names("controller_projects")
    assert TEMPLATE["execution_environment"] in names("controller_execution_environments")


def test_the_job_template_targets_the_gpu_hosts_group_of_its_inventory():
    assert TEMPLATE["inventory"] in names("controller_inventories")
    groups = {g["name"] for g in AWX["controller_groups"] if g["inventory"] == TEMPLATE["inventory"]}
    assert TEMPLATE["extra_vars"]["specops_hosts"] in groups


def test_the_job_template_passes_the_models_to_evaluate():
    group = next(g for g in AWX["controller_groups"] if g["name"] == TEMPLATE["extra_vars"]["specops_hosts"])
    for var in ("specops_target_model", "specops_reference_drafter"):
        assert group["variables"][var], var
    asked = {question["variable"]: question for question in TEMPLATE["survey_spec"]["spec"]}
    assert asked["specops_drafter_paths"]["required"] is True
    assert "specops_drafter_paths" in TEMPLATE["extra_vars"]["specops_drafters"]
    assert TEMPLATE["extra_vars"]["specops_demo_models"] is False


def test_the_job_template_never_runs_two_gpu_windows_at_once():
    assert TEMPLATE["allow_simultaneous"] is False


def test_privilege_is_escalated_only_where_the_roles_ask_for_it():
    group = next(g for g in AWX["controller_groups"] if g["name"] == TEMPLATE["extra_vars"]["specops_hosts"])
    assert all(t["become_enabled"] is False for t in AWX["controller_templates"]), "not every task needs root"
    # systemctl for the unit, and signalling the server's leftovers (other users' processes).
    assert group["variables"]["sglang_service_become"] is True
    assert group["variables"]["gpu_release_become"] is True


@pytest.mark.parametrize("template", AWX["controller_templates"], ids=lambda t: t["name"])
def test_a_weekly_schedule_launches_each_job_template(template):
    assert (ROOT / template["playbook"]).is_file()
    assert (ROOT / "awx" / "project" / template["playbook"]).is_file(), "a project of awx/project/ lacks it"
    schedules = [s for s in AWX["controller_schedules"] if s["unified_job_template"] == template["name"]]
    assert len(schedules) == 1
    rrule = schedules[0]["rrule"]
    assert re.match(r"^DTSTART(;TZID=[\w/]+)?:\d{8}T\d{6}Z? RRULE:", rrule), rrule
    fields = dict(part.split("=", 1) for part in rrule.split("RRULE:", 1)[1].split(";"))
    assert fields["FREQ"] == "WEEKLY"
    assert schedules[0]["enabled"] is True


def test_configure_yml_applies_every_field_of_controller_yml():
    """Each awx.awx task passes on exactly the keys its loop's items have, so nothing in
    controller.yml is silently dropped and nothing the playbook reads is missing."""
    play = yaml.safe_load((ROOT / "awx" / "configure.yml").read_text())[0]
    assert play["vars_files"] == ["controller.yml"]
    used = {}
    for task in play["tasks"]:
        module = next(k for k in task if k.startswith("awx.awx."))
        kind = re.search(r"\{\{\s*(\w+)\s*\}\}", task["loop"]).group(1)
        used[module] = kind
        read = set(re.findall(r"item\.(\w+)", json.dumps(task[module])))
        for item in AWX[kind]:
            assert read == set(item), f"{module}: reads {sorted(read)}, {kind} has {sorted(item)}"
    assert used["awx.awx.job_template"] == "controller_templates"
    assert used["awx.awx.schedule"] == "controller_schedules"


# --- what `make collection` needs ------------------------------------------------------------


def locked(lock: Path) -> dict[str, str]:
    return dict(re.findall(r"^([a-z0-9_.-]+)==(\S+)", lock.read_text(), re.MULTILINE))


def test_make_collection_builds_in_an_environment_of_the_build_lock_alone():
    done = run(["make", "-n", "-B", "collection", "BUILD_VENV=/nonexistent/build-env"], cwd=ROOT)
    commands = done.stdout
    assert "-r requirements/build.lock" in commands
    assert "/nonexistent/build-env/bin/python tools/build_collection.py" in commands
    # Neither the test environment nor its lock, nor the collections taken from the `ansible` wheel.
    for needless in ("test.lock", ".venv/", "install_collections.py", "collection-sources.lock", "ml.lock"):
        assert needless not in commands, needless


def test_the_build_lock_holds_ansible_core_and_the_build_backend_at_the_control_nodes_versions():
    build = locked(ROOT / "requirements" / "build.lock")
    control = locked(ROOT / "requirements" / "control.lock")
    assert {"ansible-core", "setuptools"} <= set(build) and "ansible" not in build
    assert len(build) <= 12, sorted(build)
    assert {name: version for name, version in build.items() if name in control} == {
        name: control[name] for name in build if name in control
    }
