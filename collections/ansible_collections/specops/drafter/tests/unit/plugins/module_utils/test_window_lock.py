# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""WindowLock: one window per server; another token is refused naming the holder; a dead guard's lock is stale."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import os
import subprocess
import sys

import pytest

from ansible_collections.specops.drafter.plugins.module_utils.common import procfs
from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError
from ansible_collections.specops.drafter.plugins.module_utils.window.window_lock import NO_WINDOW_TOKEN, WindowLock


@pytest.fixture
def guard_process():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_a_second_token_is_refused_naming_the_holder(tmp_path, guard_process):
    lock = WindowLock(str(tmp_path), "sglang-qwen")
    assert lock.acquire("run-a", "eval.yml on ctl-1", wait=0) is True
    lock.set_guard("run-a", {"pid": guard_process.pid, "starttime": procfs.start_time(guard_process.pid)})

    with pytest.raises(ServiceError) as refused:
        lock.acquire("run-b", "eval.yml on ctl-2", wait=0)

    assert "eval.yml on ctl-1" in refused.value.msg and refused.value.fields["window_holder"]["token"] == "run-a"
    assert lock.acquire("run-a", "eval.yml on ctl-1", wait=0) is False  # the holder itself goes on


def test_a_lock_whose_guard_is_dead_is_stale(tmp_path, guard_process):
    lock = WindowLock(str(tmp_path), "sglang-qwen")
    lock.acquire("run-a", "a", wait=0)
    lock.set_guard("run-a", {"pid": guard_process.pid, "starttime": procfs.start_time(guard_process.pid)})
    guard_process.kill()
    guard_process.wait()

    assert lock.holder() is None
    assert lock.acquire("run-b", "b", wait=0) is True


def test_release_gives_back_only_the_holders_lock(tmp_path):
    lock = WindowLock(str(tmp_path), "sglang-qwen")
    lock.acquire(NO_WINDOW_TOKEN, "operator", wait=0)
    assert lock.release("someone-else") is False and os.path.exists(lock.path)
    assert lock.release(NO_WINDOW_TOKEN) is True and not os.path.exists(lock.path)
