"""The environments the tests run in hold exactly what the locks in requirements/ say.

`make venv` and `make ml-env` build them from the locks; a package installed by hand, a lock edited
without rebuilding, or specops recorded as a temporary file:// path shows up here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "requirements" / "check_lock.py"
ML_VENV = ROOT / ".venv-ml"


def check(python: Path | str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), str(CHECK), *args], capture_output=True, text=True, cwd=ROOT)


def test_the_control_environment_matches_the_test_lock():
    done = check(sys.executable, "requirements/test.lock")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(not (ML_VENV / "bin" / "python").exists(), reason="no ML environment (make ml-env)")
def test_the_ml_environment_matches_its_locks_and_names_specops_by_version():
    torch = re.search(
        r"^fla_env_torch: *(\S+)", (ROOT / "inventory/local/group_vars/gpu_hosts.yml").read_text(), re.M
    )
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert torch and version
    done = check(
        ML_VENV / "bin" / "python",
        "requirements/ml.lock",
        "requirements/ml-dev.lock",
        "--also",
        torch[1],
        "--also",
        f"specops=={version[1]}",
    )
    assert done.returncode == 0, done.stdout + done.stderr
