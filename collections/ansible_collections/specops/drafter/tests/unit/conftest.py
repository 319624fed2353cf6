# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Shared fixtures: run a module in-process and catch its exit_json/fail_json as exceptions."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json
import stat
import sys
import textwrap

import pytest

from ansible.module_utils import basic
from ansible.module_utils.testing import patch_module_args
from ansible_collections.specops.drafter.tests.unit.helpers import exit_json, fail_json


@pytest.fixture
def module_exits(monkeypatch):
    """exit_json/fail_json raise instead of printing and exiting the test process."""
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", fail_json)


@pytest.fixture
def run_module(module_exits):
    """Call a module's main() with the given args (check_mode adds _ansible_check_mode)."""

    def run(main, args, check_mode=False):
        args = dict(args)
        if check_mode:
            args["_ansible_check_mode"] = True
        with patch_module_args(args):
            main()
        raise AssertionError("the module returned without calling exit_json or fail_json")

    return run


# A stand-in for the ML environment's python that follows the stage protocol
# (docs/architecture.md): invoked as `<python> -m specops.<stage> --plan|--run`, JSON request on
# stdin, progress on stderr, one JSON object as the last line of stdout. "behave" picks an outcome
# and "result" the stage's figures, from the request or, for tests that go through a module's own
# request, from the SPECOPS_FAKE_STAGE environment variable (JSON).
FAKE_STAGE = textwrap.dedent(
    """
    import json
    import os
    import sys

    stage = sys.argv[2].split(".", 1)[1]  # -m specops.<stage>
    mode = sys.argv[3]
    request = json.loads(sys.stdin.read() or "{}")
    control = json.loads(os.environ.get("SPECOPS_FAKE_STAGE") or "{}")
    control.update((k, request[k]) for k in ("behave", "result") if k in request)
    behave = control.get("behave", "ok")
    if os.environ.get("SPECOPS_FAKE_RECORD"):
        with open(os.environ["SPECOPS_FAKE_RECORD"], "w") as record:
            json.dump({"argv": sys.argv[1:], "request": request}, record)
    sys.stderr.write("progress: %s %s\\n" % (stage, mode))
    if behave == "user_error":
        print(json.dumps({"failed": True, "msg": "%s: target layer 64 out of range" % stage}))
        sys.exit(2)
    if behave == "crash":
        sys.stderr.write("Traceback (most recent call last):\\nZeroDivisionError: division by zero\\n")
        sys.exit(1)
    if behave == "killed":
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
    if behave == "no_json":
        print("not a JSON object")
        sys.exit(0)
    print("a progress line on stdout that is not the result")
    result = dict(control.get("result") or {})
    result.setdefault("changed", mode == "--run")
    result["seen"] = {"argv": sys.argv[1:], "request": request, "env": os.environ.get("SPECOPS_TEST_ENV")}
    print(json.dumps(result))
    """
)


@pytest.fixture(autouse=True)
def no_stage_host(monkeypatch):
    """Stages start as processes of their own here (the stage host is tested with the package, in
    tests/unit/test_stage_host.py); a test of the dispatch replaces stage_host.run itself."""
    monkeypatch.setenv("SPECOPS_STAGE_HOST", "0")


@pytest.fixture
def fake_python(tmp_path):
    """Path of an executable that behaves like `python -m specops.<stage>` (see FAKE_STAGE)."""
    path = tmp_path / "fake-ml-python"
    path.write_text("#!%s\n%s" % (sys.executable, FAKE_STAGE))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


@pytest.fixture
def fake_stage(monkeypatch, tmp_path):
    """Set what the stand-in package answers when a module builds the request itself.

    Returns a function; its .received() gives the argv and request of the last call.
    """
    record = tmp_path / "fake-stage-call.json"
    monkeypatch.setenv("SPECOPS_FAKE_RECORD", str(record))

    def answer(behave="ok", result=None):
        monkeypatch.setenv("SPECOPS_FAKE_STAGE", json.dumps({"behave": behave, "result": result or {}}))

    answer.received = lambda: json.loads(record.read_text())
    return answer
