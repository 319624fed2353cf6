"""Fixtures every suite may share: the fixture models with a trained reference drafter.

Training the reference drafter takes a minute or more; the unit tests that need a drafter trained on
the target and the playbook runs of the integration tests use the same one (SPECOPS_TEST_MODELS,
which make test builds once before the suites that read it start).
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def exclusive(lock_file: Path):
    """One builder at a time: pytest-xdist workers share the directory, the first one builds it."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def trained_fixture_models(tmp_path_factory):
    """The tiny target and random drafter of `fixture_models` (same seeds, same files) with the
    reference drafter trained on the target's greedy outputs (300 steps)."""
    # Imported here: the suites that run in the control environment have no torch.
    from specops.fixtures import build_fixtures

    root = os.environ.get("SPECOPS_TEST_MODELS")
    if root:
        base = Path(root)
    else:
        # Under pytest-xdist each worker has its own temporary directory; their parent is shared.
        temp = tmp_path_factory.getbasetemp()
        base = (temp.parent if os.environ.get("PYTEST_XDIST_WORKER") else temp) / "trained-fixtures"
    with exclusive(base.parent / f".{base.name}.lock"):
        return build_fixtures(base, train_reference=True)
