"""A stage's request, declared once: each option's name, type, default, choices and description.

The package parses its request with it; the module's options, the role's defaults and the role's
argument specs are checked against it (tests/ansible/test_stage_schemas.py), since a module runs on
the managed host where this package may not be importable. Types use Ansible's vocabulary (str,
int, float, bool, path, list, dict, raw) so the three can be compared name for name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specops.stage import StageError


@dataclass(frozen=True)
class Option:
    name: str
    type: str
    description: str
    # None: no default (the option is left out of the request when unset, or is required).
    default: Any = None
    required: bool = False
    choices: tuple[str, ...] | None = None
    # The type of a list's items.
    elements: str | None = None


@dataclass(frozen=True)
class Schema:
    stage: str
    options: tuple[Option, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(option.name for option in self.options)

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(option.name for option in self.options if option.required)

    @property
    def defaults(self) -> dict[str, Any]:
        """Every optional key with its default (None where there is none); lists are fresh copies."""
        return {
            o.name: list(o.default) if isinstance(o.default, list) else o.default
            for o in self.options
            if not o.required
        }

    def option(self, name: str) -> Option:
        for option in self.options:
            if option.name == name:
                return option
        raise KeyError(f"{self.stage} has no option {name!r}: the options are {', '.join(self.names)}")

    def unknown(self, request: Mapping[str, Any]) -> list[str]:
        return sorted(set(request) - set(self.names))

    def merged(self, request: Mapping[str, Any], required_are: str = "") -> dict[str, Any]:
        """The request over the defaults (a key given as None counts as unset), after refusing keys the
        stage does not know and required ones left empty; required_are says what those are for."""
        unknown = self.unknown(request)
        if unknown:
            raise StageError(f"unknown request keys {unknown}: the keys are {sorted(self.names)}")
        missing = [name for name in self.required if not request.get(name)]
        if missing:
            for_what = f": {required_are}" if required_are else ""
            raise StageError(f"missing required keys {missing}{for_what}")
        return {**self.defaults, **{k: v for k, v in request.items() if v is not None}}
