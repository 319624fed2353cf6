#!/usr/bin/env python3
"""Sum the per-test durations make test records (.work/test-reports/*.xml, JUnit XML) by suite and
by test file, slowest first: what to reorder, or to split, when the run gets long.

    python .ci/durations.py [.work/test-reports/*.xml] [--top N]
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="*", type=Path)
    parser.add_argument("--top", type=int, default=15, help="test files listed per suite")
    args = parser.parse_args()
    reports = args.reports or sorted(Path(".work/test-reports").glob("*.xml"))
    if not reports:
        print("no reports: run make test (or a make test-* target) first", file=sys.stderr)
        return 1
    for report in reports:
        by_file: dict[str, float] = defaultdict(float)
        wall = 0.0
        for suite in ElementTree.parse(report).getroot().iter("testsuite"):
            wall += float(suite.get("time", 0))
            for case in suite.iter("testcase"):
                # classname is the module's dotted path, with the class appended for tests in a class.
                module, _, last = case.get("classname", "?").rpartition(".")
                name = module if last[:1].isupper() else f"{module}.{last}".lstrip(".")
                by_file[name] += float(case.get("time", 0))
        total = sum(by_file.values())
        print(f"{report.stem}: {wall:.0f} s wall, {total:.0f} s summed over {len(by_file)} files")
        for name, seconds in sorted(by_file.items(), key=lambda item: -item[1])[: args.top]:
            print(f"  {seconds:8.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
