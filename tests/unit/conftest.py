"""Fixtures shared by the package's tests: the small models are built once per test run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specops.fixtures import FixturePaths, build_fixtures


@pytest.fixture(scope="session")
def fixture_models(tmp_path_factory) -> FixturePaths:
    """Tiny hybrid target + random drafter; SPECOPS_FIXTURES reuses a directory across runs."""
    root = os.environ.get("SPECOPS_FIXTURES")
    base = Path(root) if root else tmp_path_factory.getbasetemp() / "fixtures"
    return build_fixtures(base, train_reference=False)
