# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The memory window: the marker is claimed once; the pause never loses a request; the resume is followed by continue."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import itertools
import threading

import pytest

from ansible_collections.specops.drafter.plugins.module_utils.service.service_errors import ServiceError
from ansible_collections.specops.drafter.plugins.module_utils.service.sglang_api import Answer
from ansible_collections.specops.drafter.plugins.module_utils.window.memory_window import (
    ReleasedMarker,
    flush_retry_delays,
    flush_until_idle,
    pause_without_losing_requests,
    resume_claimed,
)


class FakeApi(object):
    url = "http://sglang"

    def __init__(self, loads=(0,), resume_status=200, flush=(200,)):
        self.calls = []
        self.loads = list(loads)
        self.resume_status = resume_status
        self.flush = list(flush)

    def pause(self, mode):
        self.calls.append(("pause", mode))
        return Answer(200, "")

    def running_requests(self):
        self.calls.append(("load", None))
        return self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]

    def resume(self, tags):
        self.calls.append(("resume", tags))
        return Answer(self.resume_status, "boom")

    def continue_generation(self):
        self.calls.append(("continue", None))
        return Answer(200, "")

    def flush_cache(self):
        self.calls.append(("flush", None))
        status = self.flush.pop(0) if len(self.flush) > 1 else self.flush[0]
        return Answer(status, "Flush cache failed.")


def test_a_version_with_modes_retracts_without_draining():
    api = FakeApi()
    assert pause_without_losing_requests(api, "0.5.23", drain_timeout=1, delay=0) == "retract"
    assert api.calls == [("pause", "retract")]


def test_a_version_without_modes_drains_before_its_aborting_pause():
    api = FakeApi(loads=[2, 1, 0])
    assert pause_without_losing_requests(api, "0.5.4", drain_timeout=5, delay=0) == "drain then abort"
    assert api.calls == [("load", None)] * 3 + [("pause", None)]


def test_a_drain_that_never_ends_pauses_nothing():
    api = FakeApi(loads=[1])
    with pytest.raises(ServiceError) as failed:
        pause_without_losing_requests(api, "0.5.4", drain_timeout=0.2, delay=0.05)
    assert "sglang_service_drain_timeout" in failed.value.msg and ("pause", None) not in api.calls


def test_flush_is_polled_while_it_answers_400():
    api = FakeApi(flush=[400, 400, 200])
    flush_until_idle(api, timeout=5, delay=0)
    assert api.calls.count(("flush", None)) == 3


def test_the_flush_inside_the_downtime_is_tried_again_soon_then_less_often():
    retries = flush_retry_delays(0.5)
    assert list(itertools.islice(retries, 7)) == [0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5]
    assert next(flush_retry_delays(0.01)) == 0.01  # never longer than the module's own delay


def test_the_marker_is_claimed_by_exactly_one_of_many(tmp_path):
    marker = ReleasedMarker(str(tmp_path))
    marker.write(["kv_cache"], 1.0)
    claims = []
    threads = [threading.Thread(target=lambda: claims.append(marker.claim())) for dummy in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [claim for claim in claims if claim is not None] == [{"tags": ["kv_cache"], "at": 1.0}]


def test_continue_follows_a_resume_that_failed_and_it_is_not_retried():
    api = FakeApi(resume_status=500)
    with pytest.raises(ServiceError) as failed:
        resume_claimed(api, [], 5)
    assert api.calls == [("resume", []), ("continue", None)] and "not retried" in failed.value.msg
