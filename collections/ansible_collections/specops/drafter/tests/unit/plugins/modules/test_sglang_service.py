# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""sglang_service: refusals before anything is touched, check mode that writes nothing, the key kept out of results."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json
import os
import threading

from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from ansible_collections.specops.drafter.plugins.modules import sglang_service
from ansible_collections.specops.drafter.tests.unit.helpers import AnsibleExitJson, AnsibleFailJson


class Server(BaseHTTPRequestHandler):
    info = {}
    posts = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        data = json.dumps(self.info).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        self.posts.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


@pytest.fixture
def sglang():
    Server.posts = []
    httpd = HTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield "http://127.0.0.1:%d" % httpd.server_port
    httpd.shutdown()


def args(url, tmp_path, **extra):
    base = {"state": "released", "backend": "process", "url": url, "api_key": "hunter2",
            "state_dir": str(tmp_path / "state"),
            "spec": {"argv": ["/bin/true"], "pid_file": str(tmp_path / "s.pid"), "log_file": str(tmp_path / "s.log")}}
    base.update(extra)
    return base


def test_a_server_without_the_memory_saver_is_refused_before_anything(run_module, sglang, tmp_path):
    Server.info = {"version": "0.5.23", "enable_memory_saver": False}
    with pytest.raises(AnsibleFailJson) as failed:
        run_module(sglang_service.main, args(sglang, tmp_path))
    assert "--enable-memory-saver" in failed.value.result["msg"]
    assert Server.posts == [] and not os.path.exists(str(tmp_path / "state"))


def test_weights_without_cpu_backup_are_refused_and_the_fix_named(run_module, sglang, tmp_path):
    Server.info = {"version": "0.5.23", "enable_memory_saver": True, "enable_weights_cpu_backup": False}
    with pytest.raises(AnsibleFailJson) as failed:
        run_module(sglang_service.main, args(sglang, tmp_path, tags=["weights"]))
    assert "--enable-weights-cpu-backup" in failed.value.result["msg"] and Server.posts == []


def test_kv_cache_alone_may_be_released_without_cpu_backup_in_check_mode(run_module, sglang, tmp_path):
    Server.info = {"version": "0.5.23", "enable_memory_saver": True, "enable_weights_cpu_backup": False}
    with pytest.raises(AnsibleExitJson) as planned:
        run_module(sglang_service.main, args(sglang, tmp_path, tags=["kv_cache"]), check_mode=True)
    assert planned.value.result["changed"] is True and planned.value.result["version"] == "0.5.23"
    assert Server.posts == [] and not os.path.exists(str(tmp_path / "state"))
    assert "hunter2" not in json.dumps(planned.value.result)


def test_check_mode_stop_of_a_server_that_does_not_run_changes_nothing(run_module, sglang, tmp_path):
    with pytest.raises(AnsibleExitJson) as planned:
        run_module(sglang_service.main, args(sglang, tmp_path, state="stopped"), check_mode=True)
    assert planned.value.result["changed"] is False and not os.path.exists(str(tmp_path / "state"))
