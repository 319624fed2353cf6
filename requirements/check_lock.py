#!/usr/bin/env python3
"""Compare an environment's `pip freeze` with the locks it was built from.

Run it with the environment's own interpreter: the locks' markers are evaluated for it. Every
locked package whose marker applies must be installed at its locked version, and nothing else may be
installed except what --also names (torch, which the host's index decides, and specops itself,
which must be recorded by version, never as a file:// path of a temporary copy). Exit 1 with the differences.

    .venv-ml/bin/python requirements/check_lock.py requirements/ml.lock requirements/ml-dev.lock \
        --also torch==2.13.0 --also specops==0.1.0
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

try:
    from packaging.markers import Marker
except ImportError:  # every venv has pip, which vendors packaging
    from pip._vendor.packaging.markers import Marker

# pip itself comes with every venv and is in no lock.
UNLOCKED = {"pip"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(paths: list[Path]) -> dict[str, str]:
    pins = {}
    for path in paths:
        for line in path.read_text().splitlines():
            match = PIN.match(line)
            if not match:
                continue
            marker = line.split(";", 1)[1].split("\\")[0].strip() if ";" in line else ""
            if not marker or Marker(marker).evaluate():
                pins[normalize(match[1])] = match[2]
    return pins


def frozen() -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--all"], check=True, capture_output=True, text=True
    ).stdout
    found = {}
    for line in out.splitlines():
        match = PIN.match(line)
        if match:
            found[normalize(match[1])] = match[2]
        elif line.strip() and not line.startswith("#"):
            # A direct reference (name @ file://...): no version is recorded.
            found[normalize(line.split("@")[0].strip())] = line.strip()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("locks", type=Path, nargs="+")
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        help="name==version installed beside the locks (a local version label +cpu matches)",
    )
    args = parser.parse_args()

    want = locked(args.locks)
    extra = {}
    for text in args.also:
        name, version = text.split("==")
        extra[normalize(name)] = version
    have = frozen()
    problems = []
    for name, version in sorted(want.items()):
        if have.get(name) != version:
            problems.append(f"{name}: locked {version}, installed {have.get(name, 'nothing')}")
    for name, version in sorted(extra.items()):
        if have.get(name, "").split("+")[0] != version:
            problems.append(f"{name}: expected {version}, installed {have.get(name, 'nothing')}")
    for name in sorted(set(have) - set(want) - set(extra) - UNLOCKED):
        problems.append(f"{name}: installed {have[name]}, in no lock")
    print(f"{sys.prefix}: {len(have)} installed, {len(want)} locked in {', '.join(map(str, args.locks))}")
    for problem in problems:
        print(f"  {problem}")
    print("same versions as the locks" if not problems else f"{len(problems)} differences")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
