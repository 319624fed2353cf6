"""Fixtures shared by the package's tests: the small models are built once per test run."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

import pytest

from specops.fixtures import FixturePaths, build_fixtures


@contextmanager
def exclusive(path: Path):
    """One builder at a time: pytest-xdist workers share the directories below, the first one builds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A directory every worker of this run sees (the workers' common temporary root)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name


@pytest.fixture(scope="session")
def fixture_models(tmp_path_factory) -> FixturePaths:
    """Tiny hybrid target + random drafter; SPECOPS_FIXTURES reuses a directory across runs."""
    root = os.environ.get("SPECOPS_FIXTURES")
    base = Path(root) if root else shared_dir(tmp_path_factory, "fixtures")
    with exclusive(base.parent / f".{base.name}.lock"):
        return build_fixtures(base, train_reference=False)


@pytest.fixture(scope="session")
def trained_fixture_models(tmp_path_factory) -> FixturePaths:
    """The same target and drafter, with the reference drafter trained on the target's greedy outputs
    (300 steps). SPECOPS_TEST_MODELS shares it with the integration tests, which build the same."""
    root = os.environ.get("SPECOPS_TEST_MODELS")
    base = Path(root) if root else shared_dir(tmp_path_factory, "trained-fixtures")
    with exclusive(base.parent / f".{base.name}.lock"):
        return build_fixtures(base, train_reference=True)
