"""Build the specops.drafter collection as users install it.

The checkout keeps one copy of the roles and playbooks: the collection's roles/ and playbooks/ are
links to the top-level directories. `ansible-galaxy collection build` skips links to directories
outside the collection, so the build assembles the collection with those links followed in a
temporary directory, together with the specops wheel (wheels/, what the fla_env role installs by
default), and builds the tarball from there.

Usage: python tools/build_collection.py [--output-path DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLLECTION = ROOT / "collections" / "ansible_collections" / "specops" / "drafter"
WHEELS = COLLECTION / "wheels"
# What the package is built from; a private copy keeps build/ and *.egg-info out of the checkout
# (and stale files in an old build/ out of the wheel).
PACKAGE_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "src")
NOT_SHIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "output", ".plugin-cache.yaml")


def build_wheel(work: Path) -> Path:
    """The specops wheel, built offline with the running interpreter's setuptools, into wheels/."""
    source = work / "specops"
    source.mkdir()
    for name in PACKAGE_SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=NOT_SHIPPED)
        else:
            shutil.copy2(path, source / name)
    shutil.rmtree(WHEELS, ignore_errors=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(WHEELS),
            str(source),
        ],
        check=True,
    )
    (wheel,) = WHEELS.glob("specops-*.whl")
    return wheel


def assemble(work: Path) -> Path:
    """The collection with its linked roles/ and playbooks/ copied in, links followed."""
    staged = work / "ansible_collections" / "specops" / "drafter"
    shutil.copytree(COLLECTION, staged, symlinks=False, ignore=NOT_SHIPPED)
    return staged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-path", type=Path, default=ROOT / "dist", help="where the tarball goes")
    args = parser.parse_args()
    galaxy = Path(sys.executable).parent / "ansible-galaxy"
    with tempfile.TemporaryDirectory(prefix="specops-collection-") as tmp:
        work = Path(tmp)
        wheel = build_wheel(work)
        print(f"Built {wheel.relative_to(ROOT)}")
        staged = assemble(work)
        args.output_path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                str(galaxy),
                "collection",
                "build",
                str(staged),
                "--output-path",
                str(args.output_path),
                "--force",
            ],
            check=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
