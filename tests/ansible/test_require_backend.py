"""require_backend is one vocabulary: the environment check (fla_env) and the extraction take the same
values, declared once in the package (specops.backend.REQUIRE_BACKENDS), and mean the same by them.

The modules cannot import the package, so this test links every place that lists the values: both
modules' argument specs and DOCUMENTATION, both roles' argument specs and defaults, and fla_env's
deprecated alias. What each value does is tested where it acts: tests/ansible/test_fla_env.py (the
environment check) and tests/unit/test_extract.py (the extraction).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import yaml

from specops.backend import REQUIRE_BACKENDS, check_require_backend, resolve_require_backend
from specops.extract.request import REQUEST, parse_request
from specops.stage import StageError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "collections"))

from ansible_collections.specops.drafter.plugins.module_utils.ml_env import fla_env_verify  # noqa: E402

MODULES = "ansible_collections.specops.drafter.plugins.modules"
DEPRECATED = {"fla-cuda": "fla"}


def module_choices(name: str) -> tuple[list[str], list[str]]:
    """(argument spec choices, DOCUMENTATION choices) of a module's require_backend."""
    plugin = importlib.import_module(f"{MODULES}.{name}")
    documented = yaml.safe_load(plugin.DOCUMENTATION)["options"]["require_backend"]
    if hasattr(plugin, "REQUEST_OPTIONS"):
        spec = plugin.REQUEST_OPTIONS["require_backend"]
    else:
        spec = {"choices": fla_env_verify.REQUIRE_BACKEND_CHOICES}
    return list(spec["choices"]), list(documented["choices"])


def role_option(role: str) -> tuple[dict, object]:
    specs = yaml.safe_load((ROOT / f"roles/{role}/meta/argument_specs.yml").read_text())
    defaults = yaml.safe_load((ROOT / f"roles/{role}/defaults/main.yml").read_text())
    variable = f"{role}_require_backend"
    return specs["argument_specs"]["main"]["options"][variable], defaults[variable]


def test_the_package_declares_the_values_once():
    assert REQUIRE_BACKENDS == ("auto", "fla", "torch", "any")
    assert REQUEST.option("require_backend").choices == REQUIRE_BACKENDS


def test_the_extraction_module_and_role_take_exactly_the_values():
    spec, documented = module_choices("extract_hidden_states")
    assert spec == documented == list(REQUIRE_BACKENDS)
    option, default = role_option("extract_hidden_states")
    assert option["choices"] == list(REQUIRE_BACKENDS)
    assert option["default"] == default == "auto"


def test_fla_env_takes_the_same_values_and_only_the_deprecated_alias_beside_them():
    assert fla_env_verify.REQUIRE_BACKENDS == list(REQUIRE_BACKENDS)
    assert fla_env_verify.DEPRECATED_REQUIRE_BACKENDS == DEPRECATED
    spec, documented = module_choices("fla_env")
    assert spec == documented == [*REQUIRE_BACKENDS, *DEPRECATED]
    option, default = role_option("fla_env")
    assert option["choices"] == [*REQUIRE_BACKENDS, *DEPRECATED]
    # The check reports by default; the extraction enforces its own requirement (auto).
    assert option["default"] == default == "any"


def test_the_fla_env_module_translates_the_deprecated_alias_with_a_deprecation():
    class Module:
        def __init__(self, require):
            self.params = {"require_backend": require}
            self.deprecations = []

        def deprecate(self, msg, version=None, collection_name=None):
            self.deprecations.append((msg, version, collection_name))

    for require in REQUIRE_BACKENDS:
        verify = fla_env_verify.FlaEnvVerify()
        verify.module = Module(require)
        verify.params = verify.module.params
        assert verify._require_backend() == require and verify.module.deprecations == []
    verify = fla_env_verify.FlaEnvVerify()
    verify.module = Module("fla-cuda")
    verify.params = verify.module.params
    assert verify._require_backend() == "fla"
    [(msg, version, collection)] = verify.module.deprecations
    assert msg.startswith("require_backend fla-cuda is deprecated: use fla")
    assert (version, collection) == ("1.0.0", "specops.drafter")


@pytest.mark.parametrize(
    ("require", "cuda", "resolved"),
    [
        ("auto", True, "fla"),
        ("auto", False, "any"),
        ("fla", True, "fla"),
        ("fla", False, "fla"),
        ("torch", True, "torch"),
        ("torch", False, "torch"),
        ("any", True, "any"),
        ("any", False, "any"),
    ],
)
def test_auto_is_fla_on_cuda_else_any_and_the_others_stand(require, cuda, resolved):
    assert resolve_require_backend(check_require_backend(require), cuda) == resolved


def test_the_package_refuses_fla_cuda_naming_fla():
    with pytest.raises(StageError, match=r"'fla-cuda' is not one of auto, fla, torch, any: fla requires"):
        check_require_backend("fla-cuda")


@pytest.mark.parametrize("require", REQUIRE_BACKENDS)
def test_the_extraction_request_takes_every_value(require, tmp_path):
    request = {"target": str(tmp_path), "completions": str(tmp_path), "out_dir": str(tmp_path)}
    assert parse_request({**request, "require_backend": require})["require_backend"] == require


def test_the_extraction_request_refuses_fla_cuda_naming_fla(tmp_path):
    request = {"target": str(tmp_path), "completions": str(tmp_path), "out_dir": str(tmp_path)}
    with pytest.raises(StageError, match=r"'fla-cuda' is not one of auto, fla, torch, any: fla requires"):
        parse_request({**request, "require_backend": "fla-cuda"})
