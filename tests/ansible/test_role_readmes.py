"""Every role's README documents its variables as its meta/argument_specs.yml declares them: the
generated part of a README is what tools/role_readmes.py would write today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("role_readmes", ROOT / "tools" / "role_readmes.py")
role_readmes = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(role_readmes)
# Roles whose hand-written README does not carry the generated variables yet; strict, so the entry
# goes once `python tools/role_readmes.py` has written them.
WITHOUT_GENERATED_VARIABLES: set[str] = set()
ROLES = [
    pytest.param(p, id=p.name, marks=pytest.mark.xfail(strict=True, reason="README without its variables"))
    if p.name in WITHOUT_GENERATED_VARIABLES
    else pytest.param(p, id=p.name)
    for p in role_readmes.roles([])
]


@pytest.mark.parametrize("role_dir", ROLES)
def test_the_role_readme_is_generated_from_its_current_argument_specs(role_dir):
    readme = role_dir / "README.md"
    assert readme.is_file(), f"{role_dir.name} has no README: run python tools/role_readmes.py"
    assert readme.read_text() == role_readmes.render(role_dir), (
        f"roles/{role_dir.name}/README.md is out of date with its meta/argument_specs.yml: "
        "run python tools/role_readmes.py"
    )


def test_a_hand_written_readme_keeps_its_prose_around_the_generated_variables(tmp_path, monkeypatch):
    role = tmp_path / "roles" / "demo"
    (role / "meta").mkdir(parents=True)
    (role / "meta" / "argument_specs.yml").write_text(
        "argument_specs:\n  main:\n    short_description: Demo\n    options:\n"
        "      demo_port:\n        type: int\n        default: 30000\n        description: The C(port).\n"
    )
    (role / "README.md").write_text("# demo\n\nWhy this role exists.\n")
    first = role_readmes.render(role)
    assert first.startswith("# demo\n\nWhy this role exists.\n")
    assert "| `demo_port` | int | `30000` | The `port`. |" in first
    (role / "README.md").write_text(first + "\nA closing note.\n")
    (role / "meta" / "argument_specs.yml").write_text(
        (role / "meta" / "argument_specs.yml").read_text().replace("30000", "30001")
    )
    second = role_readmes.render(role)
    assert "`30001`" in second and "`30000`" not in second
    assert second.startswith("# demo\n\nWhy this role exists.\n") and second.endswith("A closing note.\n")
