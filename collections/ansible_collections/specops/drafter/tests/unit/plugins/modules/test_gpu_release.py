# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""gpu_release: argument spec and check mode, with a stand-in "device" file and a holder we start."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from ansible_collections.specops.drafter.plugins.modules import gpu_release
from ansible_collections.specops.drafter.tests.unit.helpers import AnsibleExitJson, AnsibleFailJson

HOLDER = (
    "import sys, time\n"
    "handle = open(sys.argv[1])\n"
    "open(sys.argv[2], 'w').close()\n"
    "time.sleep(120)\n"
)
# The module never signals its own process tree, so the holder is started through a parent that
# exits at once: the holder is re-parented, in a session of its own, like a leaked server worker.
LAUNCHER = (
    "import subprocess, sys\n"
    "holder = subprocess.Popen([sys.executable, '-c', sys.argv[1]] + sys.argv[2:], start_new_session=True,\n"
    "                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    "print(holder.pid)\n"
)


def _cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode()
    except (IOError, OSError):
        return ""


@pytest.fixture
def holder(tmp_path):
    """A process, started here, that holds a stand-in GPU device file open; its marker is in argv."""
    device = tmp_path / "nvidia0"
    device.write_text("")
    ready = tmp_path / "holding"
    marker = "specops-test-holder-%s" % uuid.uuid4().hex[:12]
    out = subprocess.check_output([sys.executable, "-c", LAUNCHER, HOLDER, str(device), str(ready), marker])
    pid = int(out.decode().strip())
    try:
        deadline = time.time() + 10
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the stand-in holder did not start"
        yield {"pid": pid, "marker": marker, "device_pattern": str(tmp_path / "nvidia*")}
    finally:
        # Only the process this fixture started: its pid still carries the unique marker.
        if marker in _cmdline(pid):
            os.kill(pid, signal.SIGKILL)


def alive(holder):
    return holder["marker"] in _cmdline(holder["pid"])


def test_an_unknown_nvml_mode_is_rejected_with_the_choices(run_module):
    with pytest.raises(AnsibleFailJson) as failure:
        run_module(gpu_release.main, {"nvml": "maybe"})
    assert "auto, true, false" in failure.value.result["msg"]


def test_no_unit_and_no_patterns_is_an_error(run_module):
    with pytest.raises(AnsibleFailJson) as failure:
        run_module(gpu_release.main, {"patterns": [], "nvml": "false"})
    assert failure.value.result["failed"] is True


def test_no_holders_is_no_change(run_module, tmp_path):
    args = {"patterns": ["specops-test-nothing-matches"], "device_pattern": str(tmp_path / "nvidia*"),
            "nvml": "false"}
    with pytest.raises(AnsibleExitJson) as done:
        run_module(gpu_release.main, args)
    assert done.value.result["changed"] is False
    assert done.value.result["targets"] == []
    assert done.value.result["killed"] == []


def test_check_mode_reports_our_holder_and_signals_nothing(run_module, holder):
    args = {"patterns": [holder["marker"]], "device_pattern": holder["device_pattern"], "nvml": "false",
            "grace": 0.5, "timeout": 2}
    with pytest.raises(AnsibleExitJson) as done:
        run_module(gpu_release.main, args, check_mode=True)
    result = done.value.result
    assert result["changed"] is False and result["would_signal"] == 1
    assert [t["pid"] for t in result["targets"]] == [holder["pid"]]
    assert result["killed"] == []
    time.sleep(0.2)
    assert alive(holder), "check mode must not signal the holder"


def test_a_holder_that_matches_nothing_is_foreign_and_fails_before_any_signal(run_module, holder):
    args = {"patterns": ["specops-test-nothing-matches"], "device_pattern": holder["device_pattern"],
            "nvml": "false", "orphans": False}
    with pytest.raises(AnsibleFailJson) as failure:
        run_module(gpu_release.main, args)
    assert holder["pid"] in [f["pid"] for f in failure.value.result["foreign"]]
    assert alive(holder)
