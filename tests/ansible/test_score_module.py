"""score_drafter as a host runs it: check mode changes nothing, a run writes the report, a rerun is a no-op.

The ML environment (.venv-ml) builds the fixture models and their hidden states; the module runs
`python -m specops.score` there with the checkout's package first on PYTHONPATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from module_call import call_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ML_PYTHON = ROOT / ".venv-ml/bin/python"

pytestmark = pytest.mark.skipif(not ML_PYTHON.exists(), reason="needs the ML environment (.venv-ml)")


def ml_env() -> dict:
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT / "src"),
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("score_module")
    fixtures = Path(os.environ.get("SPECOPS_FIXTURES", root / "fixtures"))
    subprocess.run(
        [str(ML_PYTHON), str(ROOT / "tests/unit/score_data.py"), str(fixtures), str(root / "run")],
        check=True,
        env=ml_env(),
        capture_output=True,
        timeout=900,
    )
    return {
        "python": str(ML_PYTHON),
        "hidden_states": str(root / "run/hidden_states"),
        "completions": str(root / "run/completions"),
        "target": str(fixtures / "target"),
        "drafter": str(fixtures / "drafter"),
        "out_dir": str(root / "run/score"),
        "device": "cpu",
        "dtype": "float32",
        "diagnostics": ["backend", "vocabulary"],
    }


def run_module(args: dict, tmp_path: Path, check: bool = False) -> dict:
    """Run specops.drafter.score_drafter as a host runs it (module_call); its result, with failed set."""
    return call_module("score_drafter", args, check=check, env=ml_env())


def test_check_mode_run_and_rerun(run, tmp_path):
    planned = run_module(run, tmp_path, check=True)
    assert planned["changed"] is True and planned["tau"] is None and not planned["failed"]
    assert not Path(run["out_dir"]).exists()

    first = run_module(run, tmp_path)
    assert first["changed"] is True, first.get("msg")
    assert first["tau"] >= 1.0 and first["n_prompts"] == 2 and first["reference_tau"] is None
    assert first["verdict"].startswith(f"drafter tau {first['tau']:.2f}")
    assert Path(first["report_md"]).is_file() and all(Path(p).is_file() for p in first["plots"])

    again = run_module(run, tmp_path)
    assert again["changed"] is False and again["tau"] == first["tau"]


def test_a_missing_hidden_state_directory_fails_with_its_path(run, tmp_path):
    result = run_module({**run, "hidden_states": str(tmp_path / "nowhere")}, tmp_path)
    assert result.get("failed") is True
    assert "nowhere is not a directory" in result["msg"]
