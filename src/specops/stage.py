"""Package side of the stage protocol (docs/architecture.md): JSON in on stdin, JSON out last."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class StageError(Exception):
    """An error the user can act on: the message names the problem and the fix."""


def log(message: str) -> None:
    """Progress goes to stderr so stdout stays one JSON result."""
    print(message, file=sys.stderr, flush=True)


def serve(stage: str, plan: Handler, run: Handler, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m specops.{stage}")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--plan", action="store_true", help="report what would change, change nothing")
    mode.add_argument("--run", action="store_true", help="do the work")
    parser.add_argument("--request", default="-", help="JSON request file, - for stdin")
    args = parser.parse_args(argv)
    try:
        raw = sys.stdin.read() if args.request == "-" else open(args.request).read()
        request = json.loads(raw or "{}")
    except json.JSONDecodeError as error:
        print(json.dumps({"failed": True, "msg": f"{stage}: the request is not JSON: {error}"}))
        return 2
    try:
        if not isinstance(request, dict):
            raise StageError("the request must be a JSON object")
        result = (plan if args.plan else run)(request)
    except StageError as error:
        print(json.dumps({"failed": True, "msg": f"{stage}: {error}"}))
        return 2
    except Exception:  # a crash: keep the traceback for the module to show
        traceback.print_exc()
        return 1
    print(json.dumps(result, default=str))
    return 0
