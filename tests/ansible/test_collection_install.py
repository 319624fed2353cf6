"""The collection as a new user gets it, and the evaluation as an AWX job runs it.

The collection is built with `make collection`'s script and installed from the tarball into an empty
collections path outside the checkout; ansible-doc documents its roles. The evaluation then runs once,
by its FQCN (`specops.drafter.eval`), through ansible-runner (the engine AWX runs jobs with) from the
user's project directory (ansible.cfg, inventory) on the local default's settings: CPU, the
development server, tiny models built from config by the play. Nothing of the checkout is on any
path: the roles, playbooks and the specops package all come from the installed collection (the
package from the wheel it ships, installed by fla_env).

That one run is read as AWX reads a job (status, rc, events, fact cache, the key figures published
with set_stats) and as the user sees it (the report on disk, the service back, the ML environment).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "meta" / "argument_specs.yml").is_file())
LOCAL_DEFAULT = ROOT / "inventory" / "local" / "group_vars" / "gpu_hosts.yml"
GALAXY_VERSION = yaml.safe_load(
    (ROOT / "collections" / "ansible_collections" / "specops" / "drafter" / "galaxy.yml").read_text()
)["version"]
# The checkout's ML environment provides torch and transformers (seen through a .pth file, as a GPU
# image's venv would be); specops itself must come from the collection's wheel.
ML_BASE_PYTHON = ROOT / ".venv-ml" / "bin" / "python"
# Modules run on the distribution's newest Python where there is one, as inventory/local picks it (built
# with PGO and LTO, it runs a module in about half the CPU of a from-source build); else on the user's venv's.
DISTRIBUTION_PYTHONS = [Path(f"/usr/bin/python3.{minor}") for minor in range(14, 8, -1)]
STATS_KEY = "specops_score"  # roles/score_drafter: score_drafter_stats_key
# Prompts the job evaluates: two for each host's share.
PROMPTS = 4
FIGURES = ("tau", "reference_tau", "ratio", "online_tau", "n_prompts", "warnings", "verdict", "report")
# Bounds, not expectations: an evaluation from scratch takes minutes, many more on a busy machine.
EVAL_DEADLINE_S = 3600
COMMAND_DEADLINE_S = 900
PORT_CLOSED_DEADLINE_S = 600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def run(cmd, env, cwd, timeout=COMMAND_DEADLINE_S, check=True):
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
    if check:
        assert proc.returncode == 0, (
            f"{cmd} exited {proc.returncode}\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def fresh_control_venv(path: Path) -> Path:
    """A virtual environment of requirements/control.lock alone, as a user makes one; its bin/."""
    run([sys.executable, "-m", "venv", path], os.environ, path.parent)
    uv = ROOT / ".work" / "uv" / "bin" / "uv"  # make's installer, where the checkout has one; else pip
    lock = ROOT / "requirements" / "control.lock"
    install = (
        [
            uv,
            "pip",
            "install",
            "--quiet",
            "--require-hashes",
            "--no-deps",
            "--python",
            path / "bin" / "python",
        ]
        if uv.is_file()
        else [path / "bin" / "pip", "install", "--quiet", "--require-hashes", "--no-deps"]
    )
    run([*install, "-r", lock], os.environ, path.parent)
    return path / "bin"


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A user's directory outside the checkout: a fresh control environment from control.lock, and the
    collection built, then installed there alone with that environment's ansible-galaxy."""
    home = tmp_path_factory.mktemp("user")
    assert ROOT not in home.parents
    dist = home / "dist"
    subprocess.run(
        [sys.executable, ROOT / "tools" / "build_collection.py", "--output-path", dist],
        check=True,
        timeout=COMMAND_DEADLINE_S,
    )
    (tarball,) = dist.glob("specops-drafter-*.tar.gz")
    bin_dir = fresh_control_venv(home / "venv")
    collections = home / "collections"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PYTHONPATH", "VIRTUAL_ENV"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        ANSIBLE_CONFIG=str(home / "ansible.cfg"),
        ANSIBLE_COLLECTIONS_PATH=str(collections),
        ANSIBLE_ROLES_PATH=str(home / "roles"),
        ANSIBLE_HOME=str(home / "ansible-home"),
        ANSIBLE_LOCAL_TEMP=str(home / "tmp"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_RETRY_FILES_ENABLED="0",
    )
    (home / "ansible.cfg").write_text(f"[defaults]\ncollections_path = {collections}\n")
    run(
        [bin_dir / "ansible-galaxy", "collection", "install", "--offline", tarball, "-p", collections],
        env,
        home,
    )
    return {"home": home, "tarball": tarball, "env": env, "bin": bin_dir}


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
        [user["bin"] / "ansible-doc", "-t", "role", "-l", "specops.drafter", "--json"],
        user["env"],
        user["home"],
    )
    assert sorted(json.loads(proc.stdout)) == [f"specops.drafter.{role}" for role in ROLES]


@pytest.fixture(scope="module")
def role_docs(user) -> dict:
    """ansible-doc's JSON for every role of the installed collection, from one call."""
    names = [f"specops.drafter.{role}" for role in ROLES]
    proc = run([user["bin"] / "ansible-doc", "-t", "role", *names, "--json"], user["env"], user["home"])
    return json.loads(proc.stdout)


@pytest.mark.parametrize("role", ROLES)
def test_ansible_doc_renders_each_role_from_the_installed_collection(user, role_docs, role):
    doc = role_docs[f"specops.drafter.{role}"]
    assert doc["path"].startswith(str(user["home"] / "collections"))
    assert doc["entry_points"]["main"]["options"]


# -- the evaluation by its FQCN through ansible-runner, on the README's two development servers ----------
# The collection's README says how to try the evaluation on one machine: two stand-ins, one taking its
# window by stopping its server, the other by releasing and resuming its memory. Its inventory is used
# as written, with this test's directory and free ports; then, as the README lists them, --check, the run
# (both window modes), a rerun that changes nothing (the fleet merge included) and a forced rescore.


def user_inventory(home: Path, shipped: Path, ports: list[int]) -> tuple[Path, Path]:
    """The README's inventory in the user's directory, with what this machine needs beside it
    (group_vars: the ML environment's torch, a quick demo); (inventory, work directory)."""
    work = home / "try"
    work.mkdir()
    text = readme_inventory(shipped, home).read_text().replace("/tmp/specops-try", str(work))
    for written, port in zip(("31001", "31002"), ports, strict=True):
        text = text.replace(written, str(port))
    inventory = home / "inventory"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "hosts.yml").write_text(text)
    (inventory / "group_vars" / "gpu_hosts.yml").write_text(
        yaml.safe_dump(
            {
                "ansible_python_interpreter": str(
                    next((p for p in DISTRIBUTION_PYTHONS if p.is_file()), home / "venv" / "bin" / "python")
                ),
                "fla_env_python": str(ML_BASE_PYTHON),
                "fla_env_system_site_packages": True,
                "fla_env_torch": yaml.safe_load(LOCAL_DEFAULT.read_text())["fla_env_torch"],
                # What this job checks needs no trained reference drafter.
                "specops_demo_models_train_reference": False,
                # The development server is ready within seconds: look every second.
                "sglang_service_ready_delay": 1,
                # What this job checks is the sequence, not the figures: a short run (both hosts generate,
                # extract and score on this machine's CPU, four times over).
                "specops_max_new_tokens": 32,
            }
        )
    )
    prompts = (ROOT / "prompts" / "coding.jsonl").read_text().splitlines(keepends=True)
    (work / "prompts.jsonl").write_text("".join(prompts[:PROMPTS]))
    return inventory, work


@contextmanager
def only_the_users_environment(env: dict):
    """ansible-runner starts from this process's environment: leave out what the user's lacks (the
    checkout's ANSIBLE_CONFIG and PYTHONPATH), so nothing of the checkout reaches the job."""
    with pytest.MonkeyPatch.context() as patch:
        for key in list(os.environ):
            if key not in env:
                patch.delenv(key)
        yield


def run_job(ansible_runner, user, inventory: Path, playbook: str, ident: str, cmdline: str = "", **extravars):
    """A job as AWX runs one: the user's project directory, its inventory, a private data directory of
    its own (ansible-runner keeps a job's command line there for the next), ansible-playbook from the
    user's fresh environment (first on PATH, as the execution environment's)."""
    private = user["home"] / "jobs" / ident
    private.mkdir(parents=True)  # ansible-runner's private data dir must exist
    with only_the_users_environment(user["env"]):
        return ansible_runner.run(
            private_data_dir=str(private),
            project_dir=str(user["home"]),
            playbook=playbook,
            inventory=str(inventory),
            extravars=extravars,
            envvars=user["env"],
            ident=ident,
            cmdline=cmdline or None,
            quiet=True,
            timeout=EVAL_DEADLINE_S,
        )


def job_artifacts(home: Path, ident: str) -> Path:
    return home / "jobs" / ident / "artifacts" / ident


def paths_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def eval_jobs(user, shipped):
    """--check, the run, the rerun and the forced rescore, in that order, each read as AWX reads a job."""
    if not ML_BASE_PYTHON.exists():
        pytest.fail("no ML environment to take torch from: run `make ml-env` first")
    ansible_runner = pytest.importorskip("ansible_runner")
    home = user["home"]
    ports = [free_port(), free_port()]
    inventory, work = user_inventory(home, shipped, ports)
    jobs = {}
    try:
        before = paths_under(work)
        jobs["check"] = run_job(ansible_runner, user, inventory, "specops.drafter.eval", "check", "--check")
        jobs["check_left"] = paths_under(work) - before
        jobs["eval"] = run_job(ansible_runner, user, inventory, "specops.drafter.eval", "eval")
        jobs["rerun"] = run_job(ansible_runner, user, inventory, "specops.drafter.eval", "rerun")
        jobs["rescore"] = run_job(
            ansible_runner,
            user,
            inventory,
            "specops.drafter.eval",
            "rescore",
            "--tags score",
            score_drafter_force=True,
        )
        yield {
            **jobs,
            "job": jobs["eval"],
            "artifacts": job_artifacts(home, "eval"),
            "work": work,
            "ports": ports,
            "venv": work / "ml",
        }
    finally:
        # eval.yml leaves the service running, as production wants; stop this test's servers as the
        # README says. No guard: nothing should bring them back.
        stop = run_job(
            ansible_runner,
            user,
            inventory,
            "specops.drafter.service",
            "stop",
            sglang_service_state="stopped",
            sglang_service_guard=False,
        )
        deadline = time.monotonic() + PORT_CLOSED_DEADLINE_S
        while any(port_is_open(port) for port in ports) and time.monotonic() < deadline:
            time.sleep(2)
        assert not any(port_is_open(port) for port in ports), (
            f"ports {ports} still open after the stop job ({stop.status})"
        )


@pytest.fixture(scope="module")
def eval_job(eval_jobs):
    return eval_jobs


def events(eval_job, kind=None):
    found = [json.loads(p.read_text()) for p in sorted((eval_job["artifacts"] / "job_events").glob("*.json"))]
    return [e for e in found if kind is None or e.get("event") == kind]


def stdout_tail(eval_job) -> str:
    stdout = eval_job["artifacts"] / "stdout"
    return stdout.read_text()[-8000:] if stdout.exists() else ""


def custom_stats(eval_job):
    (stats,) = events(eval_job, "playbook_on_stats")
    return stats["event_data"]["artifact_data"]


# What AWX reads of the job.


@pytest.mark.slow
def test_the_job_is_successful_with_rc_0(eval_job):
    job = eval_job["job"]
    assert job.status == "successful", stdout_tail(eval_job)
    assert job.rc == 0
    assert (eval_job["artifacts"] / "status").read_text().strip() == "successful"
    assert (eval_job["artifacts"] / "rc").read_text().strip() == "0"


@pytest.mark.slow
def test_no_host_failed_or_was_unreachable(eval_job):
    stats = eval_job["job"].stats
    assert stats["failures"] == {} and stats["dark"] == {}
    assert stats["ok"].get("standin1", 0) > 0 and stats["ok"].get("standin2", 0) > 0


@pytest.mark.slow
def test_no_task_failed_unless_it_was_meant_to(eval_job):
    failed = [e for e in events(eval_job, "runner_on_failed") if not e["event_data"].get("ignore_errors")]
    assert failed == []


@pytest.mark.slow
def test_the_job_events_cover_every_stage(eval_job):
    roles = {e["event_data"].get("role") for e in events(eval_job, "runner_on_ok")}
    for role in (
        "fla_env",
        "sglang_service",
        "sglang_completions",
        "gpu_release",
        "extract_hidden_states",
        "score_drafter",
    ):
        assert role in roles, f"no task of role {role} ran"


@pytest.mark.slow
def test_gathered_facts_land_in_the_fact_cache(eval_job):
    # The jsonfile cache names each host's file with a prefix of its own (e.g. "s1_localhost").
    caches = sorted((eval_job["artifacts"] / "fact_cache").glob("*standin1"))
    assert caches, "no cached facts for standin1"
    facts = json.loads(caches[0].read_text())
    if isinstance(facts.get("__payload__"), str):  # ansible-core 2.19+ wraps the facts as a JSON string
        facts = json.loads(facts["__payload__"])
    assert "ansible_hostname" in facts


@pytest.mark.slow
def test_the_key_figures_are_published_with_set_stats(eval_job):
    figures = custom_stats(eval_job)[STATS_KEY]
    for key in FIGURES:
        assert key in figures, key


@pytest.mark.slow
def test_tau_counts_the_bonus_token_so_it_is_at_least_one(eval_job):
    figures = custom_stats(eval_job)[STATS_KEY]
    assert float(figures["tau"]) >= 1.0
    assert float(figures["reference_tau"]) >= 1.0


@pytest.mark.slow
def test_the_ratio_is_tau_over_the_reference_tau(eval_job):
    figures = custom_stats(eval_job)[STATS_KEY]
    assert float(figures["ratio"]) == pytest.approx(
        float(figures["tau"]) / float(figures["reference_tau"]), rel=1e-3
    )


@pytest.mark.slow
def test_the_published_figures_match_the_report_on_disk(eval_job):
    figures = custom_stats(eval_job)[STATS_KEY]
    report_md = Path(figures["report"])
    assert report_md.is_file()
    assert report_md.is_relative_to(eval_job["work"]), "the run must stay inside its own work directory"
    report = json.loads((report_md.parent / "report.json").read_text())
    assert report["overall"]["tau"] == pytest.approx(float(figures["tau"]))
    assert f"{float(figures['tau']):.2f}" in report_md.read_text()


@pytest.mark.slow
def test_the_service_answers_again_after_the_gpu_window(eval_job):
    ok = events(eval_job, "runner_on_ok")
    # The module's start returns ready_at: when our server first answered /health_generate 200.
    ready = [
        e["counter"]
        for e in ok
        if e["event_data"].get("role") == "sglang_service"
        and (e["event_data"].get("res") or {}).get("ready_at")
    ]
    released = [e["counter"] for e in ok if e["event_data"].get("role") == "gpu_release"]
    assert released, "the GPU window never opened"
    assert ready and max(ready) > max(released), "the play ended without waiting for /health_generate"


# What the user finds after the run.


@pytest.mark.slow
def test_eval_by_fqcn_from_the_installed_collection_writes_the_report(eval_job):
    assert eval_job["job"].rc == 0, stdout_tail(eval_job)
    for host in ("standin1", "standin2"):
        assert (eval_job["work"] / host / "run" / "score" / "report.md").is_file(), host
        assert json.loads((eval_job["work"] / host / "run" / "score" / "report.json").read_text())
    # One report merges both hosts' shares, on the first host.
    fleet = json.loads((eval_job["work"] / "standin1" / "run" / "fleet" / "report.json").read_text())
    assert sorted(row["host"] for row in fleet["per_host"]) == ["standin1", "standin2"]


@pytest.mark.slow
def test_the_service_is_back_and_ready_after_the_run(eval_job):
    for port in eval_job["ports"]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=300) as answer:
                status = answer.status
        except urllib.error.HTTPError as error:
            status = error.code
        assert status == 200, port


@pytest.mark.slow
def test_the_ml_environment_runs_specops_from_the_collections_wheel(eval_job):
    python = eval_job["venv"] / "bin" / "python"
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
            timeout=COMMAND_DEADLINE_S,
        ).stdout
    )
    assert where.startswith(str(eval_job["venv"])), where
    assert (
        json.loads(direct_url)["url"].endswith(".whl")
        and "/ansible_collections/specops/drafter/" in direct_url
    )


# The README's sequence around the run: --check before it, a rerun and a forced rescore after it.


def job_output(eval_jobs, ident: str) -> str:
    stdout = job_artifacts(eval_jobs["work"].parent, ident) / "stdout"
    return stdout.read_text()[-8000:] if stdout.exists() else ""


def changed_counts(job) -> dict[str, int]:
    return {host: job.stats.get("changed", {}).get(host, 0) for host in ("standin1", "standin2")}


@pytest.mark.slow
def test_check_mode_on_the_fresh_stand_ins_succeeds_and_writes_no_report(eval_jobs):
    check = eval_jobs["check"]
    assert check.status == "successful" and check.rc == 0, job_output(eval_jobs, "check")
    assert "the ML environment is not built yet" in job_output(eval_jobs, "check")
    assert not [p for p in eval_jobs["check_left"] if p.endswith("report.md")], eval_jobs["check_left"]


@pytest.mark.slow
def test_each_stand_in_took_its_window_in_its_own_mode(eval_jobs):
    modes = {
        host: json.loads((eval_jobs["work"] / host / "run" / "hidden_states" / "window.json").read_text())[
            "mode"
        ]
        for host in ("standin1", "standin2")
    }
    assert modes == {"standin1": "stop", "standin2": "memory_saver"}


@pytest.mark.slow
def test_a_rerun_changes_nothing_on_either_host_the_fleet_merge_included(eval_jobs):
    rerun = eval_jobs["rerun"]
    assert rerun.status == "successful" and rerun.rc == 0, job_output(eval_jobs, "rerun")
    assert changed_counts(rerun) == {"standin1": 0, "standin2": 0}, job_output(eval_jobs, "rerun")
    merged = [
        e
        for e in events({"artifacts": job_artifacts(eval_jobs["work"].parent, "rerun")}, "runner_on_ok")
        if e["event_data"].get("task") == "Merge them into one report"
    ]
    assert merged and merged[0]["event_data"]["res"]["changed"] is False


@pytest.mark.slow
def test_a_forced_rescore_scores_both_hosts_again_and_merges(eval_jobs):
    rescore = eval_jobs["rescore"]
    assert rescore.status == "successful" and rescore.rc == 0, job_output(eval_jobs, "rescore")
    scored = {
        e["event_data"]["host"]
        for e in events({"artifacts": job_artifacts(eval_jobs["work"].parent, "rescore")}, "runner_on_ok")
        if e["event_data"].get("role") == "score_drafter" and e["event_data"]["res"].get("changed")
    }
    assert scored == {"standin1", "standin2"}
    assert any(
        e["event_data"].get("task") == "Merge them into one report"
        for e in events({"artifacts": job_artifacts(eval_jobs["work"].parent, "rescore")}, "runner_on_ok")
    )


# -- the docs that ship: every path they cite ships too, and their examples run as written ------------

# A path of the project's source tree or of the collection, as docs cite them (`docs/window.md`,
# `awx/configure.yml`); a path inside a longer path or a URL is not a citation of its own.
CITED = re.compile(
    r"(?<![\w/.~<-])((?:docs|benchmarks|tests|tools|molecule|awx|inventory|prompts|requirements|playbooks"
    r"|roles|plugins|meta|wheels|defaults|templates)/[\w.<>*-]+(?:/[\w.<>*-]+)*/?)"
)
# fla_env documents the layout of a specops checkout that fla_env_specops_source may name.
CHECKOUT_LAYOUT = {"requirements/ml.lock"}
HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)


def module_docs(source: str) -> str:
    """A module's DOCUMENTATION, EXAMPLES and RETURN: what ansible-doc shows of it."""
    tree = ast.parse(source)
    return "\n".join(
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and any(getattr(t, "id", "") in ("DOCUMENTATION", "EXAMPLES", "RETURN") for t in node.targets)
    )


def strings(value) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return [value] if isinstance(value, str) else []


@pytest.fixture(scope="module")
def shipped(user, tmp_path_factory) -> Path:
    """The tarball extracted alone."""
    root = tmp_path_factory.mktemp("shipped")
    with tarfile.open(user["tarball"]) as tar:
        tar.extractall(root, filter="data")
    return root


def shipped_docs(root: Path) -> dict[Path, str]:
    """Every shipped document as its reader sees it (the changelog is history and is left out)."""
    docs = {p: HTML_COMMENT.sub("", p.read_text()) for p in root.rglob("*.md")}
    for spec in root.glob("roles/*/meta/argument_specs.yml"):
        docs[spec] = "\n".join(strings(yaml.safe_load(spec.read_text())))
    for module in root.glob("plugins/modules/*.py"):
        docs[module] = module_docs(module.read_text())
    for path in [*root.glob("awx/**/*.yml"), *root.glob("inventory/**/*.yml")]:
        docs[path] = path.read_text()
    return docs


def test_every_path_a_shipped_doc_cites_ships_too(shipped):
    missing = []
    for doc, text in shipped_docs(shipped).items():
        for found in set(CITED.findall(text)):
            # "<a copy of awx/project/>": the placeholder's closing bracket is not part of the path.
            cited = found if "<" in found else found.rstrip(">")
            if cited in CHECKOUT_LAYOUT:
                continue
            pattern = re.sub(r"<[^>]*>", "*", cited.rstrip("/"))
            # Relative to the document (a role's README citing its defaults/) or to the collection.
            if not (list(doc.parent.glob(pattern)) or list(shipped.glob(pattern))):
                missing.append(f"{doc.relative_to(shipped)}: {cited}")
    assert sorted(missing) == []


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.DOTALL | re.MULTILINE)


README = "README.md"


def readme_inventory(shipped: Path, home: Path) -> Path:
    """The README's inventory of two development servers, as written, in the user's directory."""
    (inventory,) = [
        b for b in blocks((shipped / README).read_text(), "yaml") if "gpu_hosts" in yaml.safe_load(b)
    ]
    path = home / "readme-hosts.yml"
    path.write_text(inventory)
    return path


def test_the_readme_inventory_parses_into_two_stand_ins_on_their_own_ports_and_files(user, shipped):
    path = readme_inventory(shipped, user["home"])
    proc = run([user["bin"] / "ansible-inventory", "-i", path, "--list"], user["env"], user["home"])
    hostvars = json.loads(proc.stdout)["_meta"]["hostvars"]
    assert sorted(hostvars) == ["standin1", "standin2"]
    assert len({h["sglang_service_port"] for h in hostvars.values()}) == 2
    # Each host's own name in its unit name: its own pid, log and state files.
    assert all("{{ inventory_hostname }}" in h["sglang_service_unit_name"] for h in hostvars.values())
    assert hostvars["standin2"]["specops_gpu_window_mode"] == "memory_saver"


def test_the_readme_commands_run_as_written(user, shipped, tmp_path):
    """Every playbook an ansible-playbook line names passes the syntax check against the README's
    inventory (one call for all of them), every ansible-doc line runs, and the tarball installs as the
    README says; installing by name needs a Galaxy server or an Automation Hub, none reachable here."""
    inventory = readme_inventory(shipped, tmp_path)
    shutil.copy(user["tarball"], tmp_path)
    env = dict(user["env"], ANSIBLE_COLLECTIONS_PATH=str(tmp_path / "collections"))
    playbooks, ran = [], []
    for block in blocks((shipped / README).read_text(), "sh"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if (
                not words
                or words[:3] == ["ansible-galaxy", "collection", "install"]
                and "specops.drafter" in line
            ):
                continue
            if words[0] == "ansible-playbook":
                assert words[1] == "-i" and words[2] in ("hosts.yml", "my-inventory"), line
                playbooks.append(words[3])
                continue
            if words[0] == "ansible-galaxy":
                words += ["-p", str(tmp_path / "collections")]
            run(
                [user["bin"] / words[0], *words[1:]],
                env if words[0] == "ansible-galaxy" else user["env"],
                tmp_path,
            )
            ran.append(words[0])
    assert {"ansible-galaxy", "ansible-doc"} <= set(ran)
    assert (
        tmp_path / "collections" / "ansible_collections" / "specops" / "drafter" / "MANIFEST.json"
    ).is_file()
    assert {"specops.drafter.eval", "specops.drafter.service"} <= set(playbooks)
    run(
        [user["bin"] / "ansible-playbook", "-i", inventory, "--syntax-check", *dict.fromkeys(playbooks)],
        user["env"],
        tmp_path,
    )


def test_the_readme_requirements_name_the_collection_and_install_the_tarball(user, shipped, tmp_path):
    found = [yaml.safe_load(b) for b in blocks((shipped / README).read_text(), "yaml")]
    requirements = [r["collections"] for r in found if "collections" in r]
    by_name = [c for r in requirements for c in r if c["name"] == "specops.drafter"]
    assert by_name and by_name[0]["version"] == f"=={GALAXY_VERSION}"
    (from_file,) = [r for r in requirements if r[0].get("type") == "file"]
    (tmp_path / "requirements.yml").write_text(yaml.safe_dump({"collections": from_file}))
    shutil.copy(user["tarball"], tmp_path)
    # Only this directory's collections: the user's installed copy would make the install a no-op.
    env = dict(user["env"], ANSIBLE_COLLECTIONS_PATH=str(tmp_path / "cols"))
    run(
        [
            user["bin"] / "ansible-galaxy",
            "collection",
            "install",
            "--offline",
            "-r",
            "requirements.yml",
            "-p",
            "cols",
        ],
        env,
        tmp_path,
    )
    assert (tmp_path / "cols" / "ansible_collections" / "specops" / "drafter" / "MANIFEST.json").is_file()


def test_every_readme_play_and_task_example_passes_the_syntax_check(user, shipped, tmp_path):
    """Task examples (the roles' "Use", the sglang_service window) run in one play; plays as they are."""
    tasks, plays = [], []
    for readme in sorted(shipped.rglob("*.md")):
        for block in blocks(readme.read_text(), "yaml"):
            loaded = yaml.safe_load(block)
            if isinstance(loaded, list) and loaded and isinstance(loaded[0], dict):
                (plays if "hosts" in loaded[0] else tasks).extend(loaded)
    assert len(tasks) >= len(ROLES)
    path = tmp_path / "examples.yml"
    path.write_text(
        yaml.safe_dump([*plays, {"name": "README examples", "hosts": "localhost", "tasks": tasks}])
    )
    run(
        [user["bin"] / "ansible-playbook", "--syntax-check", "-i", "localhost,", path],
        user["env"],
        user["home"],
    )
