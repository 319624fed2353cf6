"""Each stage's request is declared once, in the package (`REQUEST`, a specops.schema.Schema), and the
three other places that describe it follow that declaration: the module's argument spec
(`REQUEST_OPTIONS`) and DOCUMENTATION, the role's defaults/main.yml and meta/argument_specs.yml, and
the role's task that calls the module. A module cannot import the package (it runs on the managed
host, where the package may not be importable by Ansible's Python), so this test is the link.
"""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from specops.schema import Option, Schema

ROOT = Path(__file__).resolve().parents[2]
COLLECTION = ROOT / "collections/ansible_collections/specops/drafter"
sys.path.insert(0, str(ROOT / "collections"))

from ansible_collections.specops.drafter.plugins.module_utils.stages import stage_runner  # noqa: E402


@dataclass(frozen=True)
class Stage:
    package: str  # the package module that declares REQUEST
    module: str  # the Ansible module, in plugins/modules
    role: str  # the role, in roles/

    @property
    def schema(self) -> Schema:
        return importlib.import_module(self.package).REQUEST

    @property
    def module_file(self) -> str:
        return f"plugins/modules/{self.module}.py"

    def plugin(self) -> Any:
        return importlib.import_module(f"ansible_collections.specops.drafter.plugins.modules.{self.module}")


STAGES = [
    Stage("specops.completions", "sglang_completions", "sglang_completions"),
    Stage("specops.score", "score_drafter", "score_drafter"),
    Stage("specops.extract.request", "extract_hidden_states", "extract_hidden_states"),
]
# A role variable's type may be wider than the option's: "" means "leave out" for an optional path,
# and `raw` takes a drafter as one path or a list of them.
ROLE_TYPES = {"path": {"path", "str"}, "list": {"list", "raw"}}
# What a role default may be for an option without one: empty (the role leaves it out) or a template.
EMPTY = ("", [], {}, None)


@pytest.fixture(params=STAGES, ids=lambda stage: stage.module)
def stage(request) -> Stage:
    return request.param


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def ansible_view(option: Option) -> dict[str, Any]:
    """The option as an argument spec or DOCUMENTATION states it (absent keys are their defaults)."""
    view: dict[str, Any] = {
        "type": option.type,
        "required": option.required,
        "default": option.default,
        "choices": sorted(option.choices) if option.choices else None,
        "elements": option.elements,
    }
    return view


def spec_view(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": spec.get("type", "str"),
        "required": bool(spec.get("required", False)),
        "default": spec.get("default"),
        "choices": sorted(spec["choices"]) if spec.get("choices") else None,
        "elements": spec.get("elements"),
    }


def differences(where: str, declared: dict[str, Any], found: dict[str, Any], package: str) -> list[str]:
    return [
        f"{where}: {key} is {found[key]!r}, {package} REQUEST says {declared[key]!r}"
        for key in declared
        if found[key] != declared[key]
    ]


def test_the_module_request_options_are_the_package_schema(stage):
    options = stage.plugin().REQUEST_OPTIONS
    missing = [n for n in stage.schema.names if n not in options]
    extra = [n for n in options if n not in stage.schema.names]
    assert not missing and not extra, (
        f"{stage.module_file} REQUEST_OPTIONS: missing {missing}, not in {stage.package} REQUEST {extra}"
    )


def test_the_module_argument_spec_follows_the_package_schema(stage):
    options = stage.plugin().REQUEST_OPTIONS
    wrong = []
    for option in stage.schema.options:
        if option.name in options:
            wrong += differences(
                f"{stage.module_file} option {option.name}",
                ansible_view(option),
                spec_view(options[option.name]),
                stage.package,
            )
    assert not wrong, "\n".join(wrong)


def test_the_module_documentation_follows_the_package_schema(stage):
    documented = yaml.safe_load(stage.plugin().DOCUMENTATION)["options"]
    # Options the module acts on itself, on the host, are not the stage's request (HOST_OPTIONS).
    for name in getattr(stage.plugin(), "HOST_OPTIONS", {}):
        assert name in documented, f"{stage.module_file} does not document its own option {name}"
        del documented[name]
    assert sorted(documented) == sorted(stage.schema.names), (
        f"{stage.module_file} DOCUMENTATION options {sorted(documented)} differ from {stage.package} REQUEST "
        f"{sorted(stage.schema.names)} (the shared options come from the stage doc fragment)"
    )
    wrong = []
    for option in stage.schema.options:
        wrong += differences(
            f"{stage.module_file} DOCUMENTATION option {option.name}",
            ansible_view(option),
            spec_view(documented[option.name]),
            stage.package,
        )
    assert not wrong, "\n".join(wrong)


def test_the_module_documents_the_shared_options_with_the_stage_fragment(stage):
    documentation = yaml.safe_load(stage.plugin().DOCUMENTATION)
    assert "specops.drafter.stage" in (documentation.get("extends_documentation_fragment") or []), (
        f"{stage.module_file} does not extend the specops.drafter.stage doc fragment"
    )
    fragment = importlib.import_module("ansible_collections.specops.drafter.plugins.doc_fragments.stage")
    shared = yaml.safe_load(fragment.ModuleDocFragment.DOCUMENTATION)["options"]
    assert sorted(shared) == sorted(stage_runner.STAGE_OPTIONS), (
        f"plugins/doc_fragments/stage.py documents {sorted(shared)}, "
        f"module_utils/stages/stage_runner.py STAGE_OPTIONS are {sorted(stage_runner.STAGE_OPTIONS)}"
    )
    for name, spec in stage_runner.STAGE_OPTIONS.items():
        assert spec_view(shared[name]) == spec_view(spec), f"plugins/doc_fragments/stage.py option {name}"


def test_the_role_defaults_follow_the_package_schema(stage):
    path = f"roles/{stage.role}/defaults/main.yml"
    defaults = load_yaml(ROOT / path)
    wrong = []
    for option in stage.schema.options:
        variable = f"{stage.role}_{option.name}"
        if variable not in defaults:
            wrong.append(f"{path}: {variable} is missing ({stage.package} REQUEST option {option.name})")
            continue
        value = defaults[variable]
        if "{{" in str(value):
            continue
        if option.default is None and value not in EMPTY:
            wrong.append(
                f"{path}: {variable} is {value!r}; {stage.package} REQUEST option {option.name} has "
                "no default (leave it empty or a template)"
            )
        elif option.default is not None and value != option.default:
            wrong.append(f"{path}: {variable} is {value!r}, {stage.package} REQUEST says {option.default!r}")
    assert not wrong, "\n".join(wrong)


def test_the_role_argument_specs_follow_the_package_schema(stage):
    path = f"roles/{stage.role}/meta/argument_specs.yml"
    specs = load_yaml(ROOT / path)["argument_specs"]["main"]["options"]
    wrong = []
    for option in stage.schema.options:
        variable = f"{stage.role}_{option.name}"
        spec = specs.get(variable)
        if spec is None:
            wrong.append(f"{path}: {variable} is not documented ({stage.package} REQUEST has {option.name})")
            continue
        found = spec_view(spec)
        if found["type"] not in ROLE_TYPES.get(option.type, {option.type}):
            wrong.append(
                f"{path}: {variable} type is {found['type']}, {stage.package} REQUEST says {option.type}"
            )
        if found["choices"] != ansible_view(option)["choices"]:
            wrong.append(
                f"{path}: {variable} choices are {found['choices']}, {stage.package} REQUEST says "
                f"{ansible_view(option)['choices']}"
            )
        if found["type"] == "list" and found["elements"] != option.elements:
            wrong.append(
                f"{path}: {variable} elements are {found['elements']}, {stage.package} REQUEST says "
                f"{option.elements}"
            )
        default = spec.get("default")
        if option.default is not None and "{{" not in str(default) and default != option.default:
            wrong.append(
                f"{path}: {variable} default is {default!r}, {stage.package} REQUEST says {option.default!r}"
            )
    assert not wrong, "\n".join(wrong)


def test_the_role_passes_every_option_to_the_module(stage):
    fqcn = f"specops.drafter.{stage.module}"
    calls = []
    for path in sorted((ROOT / "roles" / stage.role / "tasks").glob("*.yml")):
        for task in load_yaml(path) or []:
            if fqcn in task:
                calls.append((path.relative_to(ROOT), set(task[fqcn])))
    assert calls, f"roles/{stage.role}/tasks never calls {fqcn}"
    expected = (
        set(stage.schema.names)
        | set(stage_runner.STAGE_OPTIONS)
        | set(getattr(stage.plugin(), "HOST_OPTIONS", {}))
    )
    for path, passed in calls:
        assert passed <= expected, (
            f"{path}: the {fqcn} task passes unknown options {sorted(passed - expected)}"
        )
    # A plan-only call may leave out what only the run uses (extract_hidden_states' start_signal).
    assert any(passed == expected for _, passed in calls), (
        f"roles/{stage.role}/tasks: no {fqcn} task passes every option; missing "
        f"{[sorted(expected - passed) for _, passed in calls]}"
    )


def test_the_window_prewarm_request_follows_the_prewarm_schema():
    # The extraction role's prepare step calls `python -m specops.prewarm` with a request built in YAML.
    path = "roles/extract_hidden_states/tasks/prepare.yml"
    schema = importlib.import_module("specops.prewarm").REQUEST
    requests = [
        task["vars"]["extract_hidden_states_prewarm_request"]
        for task in load_yaml(ROOT / path)
        if "extract_hidden_states_prewarm_request" in (task.get("vars") or {})
    ]
    assert requests, f"{path} builds no extract_hidden_states_prewarm_request"
    for request in requests:
        unknown, missing = schema.unknown(request), [n for n in schema.required if n not in request]
        assert not unknown and not missing, f"{path}: unknown prewarm options {unknown}, missing {missing}"
        for name, value in request.items():
            # A fallback such as `| default(16384)` must be the option's default.
            for fallback in re.findall(r"default\(([^)]*)\)", str(value)):
                assert yaml.safe_load(fallback) == schema.option(name).default, (
                    f"{path}: extract_hidden_states_prewarm_request.{name} falls back to {fallback}, "
                    f"specops.prewarm REQUEST says {schema.option(name).default!r}"
                )
