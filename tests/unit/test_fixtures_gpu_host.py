"""The fixtures build on the CPU even where fla is installed (a GPU host): their process hides fla."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PROBE = textwrap.dedent("""
    import sys
    if sys.argv[1] == "hidden":
        from specops.fixtures.__main__ import hide_gpu_kernels
        hide_gpu_kernels()
    from transformers.utils.import_utils import _is_package_available
    print(_is_package_available("fla")[0])
""")


@pytest.fixture
def installed_fla(tmp_path):
    """A stand-in fla distribution that transformers would find (package and metadata)."""
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("raise RuntimeError('fla imported')\n")
    meta = tmp_path / "flash_linear_attention-0.6.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-linear-attention\nVersion: 0.6.0\n")
    (meta / "top_level.txt").write_text("fla\n")
    return tmp_path


def fla_seen_by_transformers(site: Path, mode: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        check=False,
        env={"PYTHONPATH": f"{site}:{SRC}", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_an_installed_fla_is_visible_to_transformers(installed_fla):
    assert fla_seen_by_transformers(installed_fla, "plain") == "True"


def test_the_fixtures_process_hides_fla_from_transformers(installed_fla):
    assert fla_seen_by_transformers(installed_fla, "hidden") == "False"
