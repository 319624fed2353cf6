"""Fixtures shared by the package's tests: the small models are built once per test run, the score
stage's inputs once per module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from score_data import layer_ids_of, write_completions, write_hidden_states

from specops.fixtures import FixturePaths, build_fixtures


@pytest.fixture(scope="session")
def fixture_models(tmp_path_factory) -> FixturePaths:
    """Tiny hybrid target + random drafter; SPECOPS_FIXTURES reuses a directory across runs."""
    root = os.environ.get("SPECOPS_FIXTURES")
    base = Path(root) if root else tmp_path_factory.getbasetemp() / "fixtures"
    return build_fixtures(base, train_reference=False)


@pytest.fixture(scope="module")
def run_dir(fixture_models, tmp_path_factory) -> Path:
    """The score stage's inputs: completions (one with SGLang's online figures) and hidden states at
    the drafter's layers +-1; built once per test module that asks for them."""
    root = tmp_path_factory.mktemp("score_run")
    online = {"fizzbuzz": {"spec_accept_length": 3.5, "spec_verify_ct": 4, "completion_tokens": 14}}
    write_completions(
        fixture_models.target,
        fixture_models.prompts,
        root / "completions",
        n_prompts=2,
        max_new_tokens=14,
        online=online,
    )
    write_hidden_states(
        fixture_models.target,
        root / "completions",
        root / "hidden_states",
        layer_ids_of(fixture_models.drafter),
        offsets=(-1, 0, 1),
    )
    return root
