"""Every role documents and validates its knobs: meta/argument_specs.yml describes each variable
of defaults/main.yml, with the same default, and meta/main.yml carries galaxy_info."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "tasks" / "main.yml").is_file())


def load(path: Path):
    return yaml.safe_load(path.read_text()) if path.is_file() else None


@pytest.fixture(params=ROLES)
def role(request):
    base = ROOT / "roles" / request.param
    specs = load(base / "meta" / "argument_specs.yml") or {}
    return {
        "name": request.param,
        "defaults": load(base / "defaults" / "main.yml") or {},
        "main": (specs.get("argument_specs") or {}).get("main"),
        "meta": load(base / "meta" / "main.yml"),
    }


def test_the_role_has_a_main_entry_point_in_argument_specs(role):
    assert role["main"], f"roles/{role['name']}/meta/argument_specs.yml has no argument_specs.main"
    assert role["main"].get("short_description")


def test_every_default_is_a_documented_option(role):
    options = (role["main"] or {}).get("options") or {}
    undocumented = sorted(set(role["defaults"]) - set(options))
    assert not undocumented, f"roles/{role['name']}: defaults without an argument spec: {undocumented}"


def test_every_option_has_a_description_and_a_type(role):
    for name, option in ((role["main"] or {}).get("options") or {}).items():
        assert option.get("description"), f"roles/{role['name']}: {name} has no description"
        assert option.get("type"), f"roles/{role['name']}: {name} has no type"


def test_spec_defaults_agree_with_defaults_main(role):
    options = (role["main"] or {}).get("options") or {}
    for name, value in role["defaults"].items():
        if name in options and "default" in options[name] and "{{" not in str(value):
            assert options[name]["default"] == value, f"roles/{role['name']}: {name} defaults disagree"


# eval_vars documents the eval playbook's own variables, which are the playbook's: specops_*.
PREFIX = {"eval_vars": "specops_"}


def test_every_variable_is_prefixed_with_the_role_name(role):
    options = (role["main"] or {}).get("options") or {}
    prefix = PREFIX.get(role["name"], role["name"] + "_")
    stray = sorted(n for n in set(role["defaults"]) | set(options) if not n.startswith(prefix))
    assert not stray, f"roles/{role['name']}: variables without the role prefix: {stray}"


def test_meta_main_has_galaxy_info(role):
    assert role["meta"] and role["meta"].get("galaxy_info"), (
        f"roles/{role['name']}/meta/main.yml lacks galaxy_info"
    )
