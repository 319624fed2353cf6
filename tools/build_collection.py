"""Build the specops.drafter collection as users install it.

The checkout keeps one copy of the roles and playbooks: the collection's roles/ and playbooks/ are
links to the top-level directories. `ansible-galaxy collection build` skips links to directories
outside the collection, so the build assembles the collection with those links followed in a
temporary directory, together with the specops wheel (wheels/, what the fla_env role installs by
default) and the files of the checkout that the collection's docs cite (FROM_THE_CHECKOUT), and
builds the tarball from there.

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
# What the collection's docs cite from outside the collection directory, shipped at these paths in it
# (tests/ansible/test_collection_build.py checks that every path a shipped doc cites is in the tarball):
# the window's interface, the production inventory to start from, and the AWX material, whose
# execution environment builds from the collection alone (with the control node's lock beside it).
FROM_THE_CHECKOUT = {
    "docs/window.md": "docs/window.md",
    "inventory/production.example": "inventory/production.example",
    "awx": "awx",
    "requirements/control.lock": "awx/control.lock",
}


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
    for source, target in FROM_THE_CHECKOUT.items():
        path, dest = ROOT / source, staged / target
        dest.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.copytree(path, dest, ignore=NOT_SHIPPED)
        else:
            shutil.copy2(path, dest)
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
