#!/usr/bin/env python3
"""Install the collections of a galaxy requirements file from the `ansible` wheel on PyPI.

Galaxy may be out of reach where the environment is built, but PyPI is not, and the `ansible`
community package bundles every collection it ships. Installing that package whole costs ~35,000
files and ~450 MB more for the two collections the tests use; this takes only the named collections out
of the wheel (downloaded once, hash-checked against the lock) and writes them where ansible-core
finds them. Each collection's MANIFEST.json must carry the version the requirements file asks for.

    python requirements/install_collections.py requirements/collections.yml \
        --source-lock requirements/collection-sources.lock --dest .venv/lib/python3.12/site-packages
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import yaml


def log(message: str) -> None:
    print(f"[collections] {message}", flush=True)


def download_wheel(source_lock: Path, cache: Path) -> Path:
    """The wheel the lock pins, from the cache or through pip (which checks its hash)."""
    cache.mkdir(parents=True, exist_ok=True)
    pinned = [line.split()[0] for line in source_lock.read_text().splitlines() if "==" in line]
    name, version = pinned[0].split("==")
    for wheel in cache.glob(f"{name}-{version}-*.whl"):
        log(f"using {wheel} (already downloaded)")
        return wheel
    log(f"downloading {name}=={version} from the package index (about 50 MB)")
    started = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--require-hashes",
            "--progress-bar",
            "on",
            "--only-binary",
            ":all:",
            "-r",
            str(source_lock),
            "-d",
            str(cache),
        ],
        check=True,
    )
    wheel = next(cache.glob(f"{name}-{version}-*.whl"))
    log(f"downloaded {wheel.name} in {time.monotonic() - started:.0f} s")
    return wheel


def install(wheel: Path, namespace: str, name: str, version: str | None, dest: Path) -> None:
    prefix = f"ansible_collections/{namespace}/{name}/"
    target = dest / "ansible_collections" / namespace / name
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.infolist() if m.filename.startswith(prefix) and not m.is_dir()]
        if not members:
            raise SystemExit(f"{wheel.name} does not bundle {namespace}.{name}")
        manifest = json.loads(archive.read(prefix + "MANIFEST.json"))
        bundled = manifest["collection_info"]["version"]
        if version and bundled != str(version):
            raise SystemExit(
                f"{wheel.name} bundles {namespace}.{name} {bundled}, the requirements ask for {version}: "
                "pin the `ansible` release that bundles it in collection-sources.in and run make lock"
            )
        installed = target / "MANIFEST.json"
        if installed.exists() and json.loads(installed.read_text())["collection_info"]["version"] == bundled:
            log(f"{namespace}.{name} {bundled} is already installed in {target}")
            return
        if target.exists():
            shutil.rmtree(target)
        log(f"extracting {namespace}.{name} {bundled} ({len(members)} files) into {target}")
        for member in members:
            archive.extract(member, dest)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "requirements", type=Path, help="galaxy requirements file (collections: name, version)"
    )
    parser.add_argument(
        "--source-lock", type=Path, required=True, help="hash-pinned `ansible` wheel requirement"
    )
    parser.add_argument("--dest", type=Path, required=True, help="directory that gets ansible_collections/")
    parser.add_argument(
        "--cache", type=Path, default=Path(".work/collection-wheels"), help="where the wheel is kept"
    )
    args = parser.parse_args()

    wanted = yaml.safe_load(args.requirements.read_text())["collections"]
    wheel = download_wheel(args.source_lock, args.cache)
    for entry in wanted:
        namespace, name = entry["name"].split(".")
        install(wheel, namespace, name, entry.get("version"), args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
