"""awx/configure.yml calls each awx.awx module only with options that module documents, with values of
the documented type and among its choices, and with every option it requires; the job templates'
surveys are ones AWX accepts. The documentation is read with ansible-doc from the awx.awx collection
itself: the ansible package in requirements/control.txt no longer ships it, so it is taken from an
ansible release that does (kept under .work/, fetched once from the package index pip uses)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# A release of the community package that ships awx.awx (19.4.0).
ANSIBLE_WITH_AWX_SDIST = "ansible-4.10.0.tar.gz"
ANSIBLE_WITH_AWX_SHA256 = "88af9479e81a3931bb3a1b8c4eeb252cd4f38c03daafd6a5aa120d6b0d70d45c"
AWX_COLLECTIONS = Path(os.environ.get("SPECOPS_AWX_COLLECTIONS", ROOT / ".work" / "awx-collection"))
CONTROLLER = yaml.safe_load((ROOT / "awx" / "controller.yml").read_text())
PLAY = yaml.safe_load((ROOT / "awx" / "configure.yml").read_text())[0]
TYPES = {"str": str, "bool": bool, "int": int, "float": (int, float), "dict": dict, "list": list, "path": str}
# AWX's survey question types (awx/main/models/mixins.py SurveyJobTemplateMixin).
SURVEY_TYPES = {"text", "textarea", "password", "integer", "float", "multiplechoice", "multiselect"}


def index_url() -> str:
    """The package index pip uses on this host (PIP_INDEX_URL, then pip's configuration), so a mirror
    is honoured."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    configured = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True, text=True
    )
    return configured.stdout.strip() if configured.returncode == 0 else "https://pypi.org/simple"


def fetch_sdist(dest: Path) -> Path:
    """The release's source archive, checked against its pinned digest. Fetched from the index's JSON
    listing (PEP 691) rather than by `pip download`, which builds the archive's metadata first: its
    setup.py walks 30,000 files (42 CPU-s here)."""
    listing = urllib.request.Request(
        f"{index_url().rstrip('/')}/ansible/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(listing, timeout=120) as response:
        files = json.loads(response.read())["files"]
    (entry,) = [f for f in files if f["filename"] == ANSIBLE_WITH_AWX_SDIST]
    dest.mkdir(parents=True, exist_ok=True)
    partial = dest / (ANSIBLE_WITH_AWX_SDIST + ".part")
    digest = hashlib.sha256()
    url = urllib.parse.urljoin(listing.full_url, entry["url"])
    with urllib.request.urlopen(url, timeout=900) as response:
        with open(partial, "wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    assert digest.hexdigest() == ANSIBLE_WITH_AWX_SHA256, f"{url}: sha256 {digest.hexdigest()}"
    return partial.rename(dest / ANSIBLE_WITH_AWX_SDIST)


def awx_collection() -> Path:
    if not (AWX_COLLECTIONS / "ansible_collections" / "awx" / "awx" / "MANIFEST.json").is_file():
        sdist = fetch_sdist(AWX_COLLECTIONS.parent / "awx-download")
        with tarfile.open(sdist) as tar:
            prefix = tar.getnames()[0].split("/")[0] + "/"
            members = [
                m for m in tar.getmembers() if m.name.startswith(prefix + "ansible_collections/awx/awx/")
            ]
            for member in members:
                member.name = member.name[len(prefix) :]
            tar.extractall(AWX_COLLECTIONS, members=members, filter="data")
    return AWX_COLLECTIONS


def tasks() -> list[tuple[str, dict, str]]:
    """(module, arguments, controller.yml list) of every awx.awx task in configure.yml."""
    found = []
    for task in PLAY["tasks"]:
        module = next(k for k in task if k.startswith("awx.awx."))
        kind = re.search(r"\{\{\s*(\w+)\s*\}\}", task["loop"]).group(1)
        found.append((module, task[module], kind))
    return found


@pytest.fixture(scope="module")
def docs() -> dict:
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(awx_collection())}
    modules = sorted({module for module, _, _ in tasks()})
    proc = subprocess.run(
        [str(BIN / "ansible-doc"), "--json", "-t", "module", *modules],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert sorted(found) == modules, f"awx.awx does not document {set(modules) - set(found)}"
    return {name: doc["doc"]["options"] for name, doc in found.items()}


def option(options: dict, name: str) -> dict | None:
    for key, spec in options.items():
        if name == key or name in (spec.get("aliases") or []):
            return spec
    return None


def item_value(template, item: dict):
    """What configure.yml passes for an option: the controller.yml field its `item.x` names."""
    match = re.fullmatch(r"\{\{\s*item\.(\w+)\s*\}\}", str(template))
    return item[match.group(1)] if match else template


@pytest.mark.parametrize("module,arguments,kind", tasks(), ids=[t[0] for t in tasks()])
def test_every_argument_is_a_documented_option_of_its_module(docs, module, arguments, kind):
    unknown = [name for name in arguments if option(docs[module], name) is None]
    assert not unknown, f"{module} documents no option {unknown}"


@pytest.mark.parametrize("module,arguments,kind", tasks(), ids=[t[0] for t in tasks()])
def test_every_required_option_is_given(docs, module, arguments, kind):
    required = [name for name, spec in docs[module].items() if spec.get("required")]
    assert not [name for name in required if name not in arguments], f"{module} requires {required}"


@pytest.mark.parametrize("module,arguments,kind", tasks(), ids=[t[0] for t in tasks()])
def test_every_value_has_the_documented_type_and_is_among_the_choices(docs, module, arguments, kind):
    for item in CONTROLLER[kind]:
        for name, template in arguments.items():
            spec = option(docs[module], name)
            value = item_value(template, item)
            if isinstance(value, str) and "{{" in value:
                continue  # templated when applied
            wanted = TYPES.get(spec.get("type", "str"))
            if wanted:
                assert isinstance(value, wanted), (
                    f"{item['name']}: {module} {name}={value!r} is not {spec['type']}"
                )
            if spec.get("elements") in TYPES and isinstance(value, list):
                assert all(isinstance(v, TYPES[spec["elements"]]) for v in value), (item["name"], name)
            if spec.get("choices"):
                assert value in spec["choices"], (
                    f"{item['name']}: {module} {name}={value!r} not in {spec['choices']}"
                )


SURVEYED = [t for t in CONTROLLER["controller_templates"] if t.get("survey_enabled")]


@pytest.mark.parametrize("template", SURVEYED, ids=[t["name"] for t in SURVEYED])
def test_each_survey_is_one_awx_accepts(template):
    survey = template["survey_spec"]
    assert survey["name"] and "description" in survey
    variables = [question["variable"] for question in survey["spec"]]
    assert len(set(variables)) == len(variables), "a survey asks for each variable once"
    for question in survey["spec"]:
        assert {"question_name", "variable", "type", "required"} <= set(question), question
        assert question["type"] in SURVEY_TYPES, question
        if question["type"] in ("multiplechoice", "multiselect"):
            choices = question["choices"]
            choices = choices.split("\n") if isinstance(choices, str) else choices
            assert str(question["default"]) in choices, question
        if question["type"] == "integer":
            assert (
                isinstance(question["default"], int)
                and question["min"] <= question["default"] <= question["max"]
            )
        else:
            assert isinstance(question.get("default", ""), str), "AWX passes text answers as strings"
