# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What an adopted unit's ExecStart says: port, host, memory-saver flags, whether an api key is set (never its value)."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

from ansible_collections.specops.drafter.plugins.module_utils.service.service_systemd import (
    command_line_facts,
    exec_start_argv,
)

SHOWN = ("{ path=/opt/venv/bin/python ; argv[]=/opt/venv/bin/python -m sglang.launch_server --model-path /m "
         "--port=31000 --host 0.0.0.0 --enable-memory-saver --api-key hunter2 --admin-api-key=hunter3 ; "
         "ignore_errors=no ; "
         "start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }")


def test_port_host_flags_and_api_key_presence_come_from_exec_start():
    facts = command_line_facts(exec_start_argv(SHOWN))
    assert facts == {"port": 31000, "host": "0.0.0.0", "enable_memory_saver": True,
                     "enable_weights_cpu_backup": False, "api_key_required": True, "admin_api_key_required": True}
    assert "hunter2" not in repr(facts) and "hunter3" not in repr(facts)


def test_sglangs_defaults_fill_what_the_command_line_leaves_out():
    facts = command_line_facts(["python", "-m", "sglang.launch_server", "--model-path", "/m"])
    assert facts["port"] == 30000 and facts["host"] == "127.0.0.1" and not facts["api_key_required"]
