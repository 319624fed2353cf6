"""Package side of the stage protocol (docs/architecture.md): JSON in on stdin, JSON out last."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class StageError(Exception):
    """An error the user can act on: the message names the problem and the fix."""


# A file the stage's progress lines are appended to as well, where a waiting play reads the last one.
PROGRESS_LOG_VARIABLE = "SPECOPS_PROGRESS_LOG"


def log(message: str) -> None:
    """Progress goes to stderr so stdout stays one JSON result, and to SPECOPS_PROGRESS_LOG when set."""
    print(message, file=sys.stderr, flush=True)
    path = os.environ.get(PROGRESS_LOG_VARIABLE)
    if path:
        try:
            with open(path, "a") as handle:
                handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}\n")
        except OSError:
            pass  # progress is for people; never a reason to fail the stage


def read_request(source: str) -> Any:
    """The JSON request from a file, or from stdin for '-'."""
    raw = sys.stdin.read() if source == "-" else Path(source).read_text()
    return json.loads(raw or "{}")


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown, once the result is out and every file is closed.

    Tearing down torch, triton and their threads takes seconds (1.9 s on a 2-core host, measured
    with the demo's target loaded) that a play waiting on the process inside its service window pays.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# A full disk, or a full quota: the user's to fix, not a crash.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full_message(error: OSError) -> str:
    where = error.filename or "its output"
    return (
        f"no space left to write {where} ({error.strerror}): free space on that file system (`df -h "
        f"{Path(str(where)).parent if error.filename else '.'}`) and rerun (finished work is kept), or point "
        "the stage's output at another file system"
    )


def respond(name: str, work: Callable[[], dict[str, Any]]) -> int:
    """Print work's result as the one JSON object on stdout; exit 0, 2 for a StageError (its message
    prefixed with name) or 1 for a crash (its traceback on stderr)."""
    try:
        result = work()
    except StageError as error:
        print(json.dumps({"failed": True, "msg": f"{name}: {error}"}))
        return 2
    except OSError as error:
        if error.errno not in DISK_FULL:
            traceback.print_exc()
            return 1
        print(json.dumps({"failed": True, "msg": f"{name}: {disk_full_message(error)}"}))
        return 2
    except Exception:  # a crash: keep the traceback for the module to show
        traceback.print_exc()
        return 1
    print(json.dumps(result, default=str))
    return 0


def serve(stage: str, plan: Handler, run: Handler, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m specops.{stage}")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--plan", action="store_true", help="report what would change, change nothing")
    mode.add_argument("--run", action="store_true", help="do the work")
    parser.add_argument("--request", default="-", help="JSON request file, - for stdin")
    args = parser.parse_args(argv)
    try:
        request = read_request(args.request)
    except json.JSONDecodeError as error:
        print(json.dumps({"failed": True, "msg": f"{stage}: the request is not JSON: {error}"}))
        return 2

    def work() -> dict[str, Any]:
        if not isinstance(request, dict):
            raise StageError("the request must be a JSON object")
        return (plan if args.plan else run)(request)

    return respond(stage, work)
