# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""SglangApi: versions, pause modes, the Bearer key on every call, answers of a server that is not there."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json
import threading

from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from ansible_collections.specops.drafter.plugins.module_utils.service.sglang_api import (
    SglangApi,
    has_pause_modes,
    offers,
    parse_version,
    release_tags_keeping_weights,
    releases_weights,
)


@pytest.mark.parametrize("text, expected", [("0.5.23", (0, 5, 23)), ("0.5.23.post1", (0, 5, 23)),
                                            ("v0.5.4rc0", (0, 5, 4)), ("specops-devserver", None), (None, None)])
def test_parse_version(text, expected):
    assert parse_version(text) == expected


def test_only_versions_from_0_5_23_have_pause_modes():
    assert has_pause_modes("0.5.23") and has_pause_modes("0.6.0")
    assert not has_pause_modes("0.5.4") and not has_pause_modes("unknown")


def test_an_empty_tag_list_releases_the_weights():
    assert releases_weights([]) and releases_weights(["weights"])
    # Draft and target weights share `weights` (sglang 0.5.23 weight_updater.py:345-366): no tag of their own.
    assert not releases_weights(["kv_cache", "cuda_graph"]) and not releases_weights(["weights_drafter"])


def test_the_tags_that_keep_the_weights_follow_the_version():
    assert release_tags_keeping_weights("0.5.23") == ("kv_cache", "cuda_graph")
    assert release_tags_keeping_weights("0.6.1") == ("kv_cache", "cuda_graph")
    assert release_tags_keeping_weights("0.5.4") == ("kv_cache",)


class Recorder(BaseHTTPRequestHandler):
    seen = []

    def log_message(self, *args):
        pass

    def _reply(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.seen.append((self.command, self.path, self.headers.get("Authorization"), body))
        if self.path == "/server_info":
            status, data = 404, b"{}"
        elif self.path == "/get_load":
            status, data = 200, json.dumps([{"num_reqs": 2, "num_waiting_reqs": 1}, {"num_reqs": 0}]).encode()
        else:
            status, data = 200, json.dumps({"version": "0.5.4", "enable_memory_saver": True, "api_key": "s3cret",
                                            "admin_api_key": "adm1n"}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _reply


@pytest.fixture
def server():
    Recorder.seen = []
    httpd = HTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield "http://127.0.0.1:%d" % httpd.server_port
    httpd.shutdown()


def test_every_call_carries_the_bearer_key_and_old_servers_answer_get_server_info(server):
    api = SglangApi(server, api_key="s3cret", timeout=5)
    assert api.server_info()["version"] == "0.5.4"
    assert api.running_requests() == 3
    api.pause("retract")
    api.pause(None)
    api.continue_generation()
    paths = ["/server_info", "/get_server_info", "/get_load", "/pause_generation", "/pause_generation",
             "/continue_generation"]
    assert [call[1] for call in Recorder.seen] == paths
    assert set(call[2] for call in Recorder.seen) == {"Bearer s3cret"}
    assert [call[3] for call in Recorder.seen if call[1] == "/pause_generation"] == [{"mode": "retract"}, {}]


def test_a_server_that_is_not_there_answers_minus_one():
    answer = SglangApi("http://127.0.0.1:9", timeout=2).health_generate(2)
    assert answer.status == -1 and not answer.ok and answer.describe().startswith("no answer")


def test_the_release_table_answers_for_versions_between_and_beyond_its_rows():
    assert offers("0.5.23", "weights_checker") and offers("0.6.1", "admin_api_key")
    assert not offers("0.5.10", "weights_checker") and not offers("0.4.0", "pause_modes")
    assert offers("specops-devserver", "weights_checker")  # a name it cannot read: the newest entry


def test_the_admin_key_goes_to_the_admin_endpoints_the_api_key_elsewhere_and_server_info_loses_both(server):
    api = SglangApi(server, api_key="s3cret", timeout=5, admin_api_key="adm1n")
    info = api.server_info()
    api.pause("retract")
    api.flush_cache()
    api.release([])
    api.resume([])
    api.weights_checksum()
    api.continue_generation()
    api.running_requests()
    keys = dict((call[1], call[2]) for call in Recorder.seen)
    for path in ("/pause_generation", "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation",
                 "/weights_checker", "/continue_generation"):
        assert keys[path] == "Bearer adm1n", path
    assert keys["/get_server_info"] == keys["/get_load"] == "Bearer s3cret"
    assert "s3cret" not in repr(info) and "adm1n" not in repr(info)
    assert "s3cret" not in api.server_info_answer().describe()
