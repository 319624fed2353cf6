# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""run_stage: the module side of the stage protocol, against a stand-in package (conftest.FAKE_STAGE)."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json

import pytest

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.testing import patch_module_args
from ansible_collections.specops.drafter.plugins.module_utils.stages import stage_host
from ansible_collections.specops.drafter.plugins.module_utils.stages.stage_runner import (
    crash_message,
    run_stage,
    stage_module,
    stage_result,
)
from ansible_collections.specops.drafter.tests.unit.helpers import AnsibleFailJson


@pytest.fixture
def make_module(module_exits):
    def make(check_mode=False):
        args = {"_ansible_check_mode": True} if check_mode else {}
        with patch_module_args(args):
            return AnsibleModule(argument_spec={}, supports_check_mode=True)

    return make


def test_run_mode_invokes_the_stage_module_with_run(make_module, fake_python):
    result = run_stage(make_module(), fake_python, "score", {"x": 1})
    assert result["seen"]["argv"] == ["-m", "specops.score", "--run"]
    assert result["changed"] is True


def test_the_request_reaches_the_package_as_json_on_stdin(make_module, fake_python):
    request = {"out_dir": "/tmp/run/score", "layers": [1, 9, 17], "force": False}
    result = run_stage(make_module(), fake_python, "score", request)
    assert result["seen"]["request"] == request


def test_check_mode_asks_the_package_for_a_plan(make_module, fake_python):
    result = run_stage(make_module(check_mode=True), fake_python, "extract", {})
    assert result["seen"]["argv"] == ["-m", "specops.extract", "--plan"]
    assert result["changed"] is False


def test_an_explicit_plan_overrides_check_mode(make_module, fake_python):
    result = run_stage(make_module(check_mode=False), fake_python, "extract", {}, plan=True)
    assert result["seen"]["argv"][-1] == "--plan"


def test_only_the_last_stdout_line_is_the_result(make_module, fake_python):
    # The stand-in prints a progress line on stdout before its JSON result.
    result = run_stage(make_module(), fake_python, "score", {"result": {"tau": 3.02}})
    assert result["tau"] == 3.02


def test_extra_env_reaches_the_package(make_module, fake_python):
    result = run_stage(make_module(), fake_python, "score", {}, extra_env={"SPECOPS_TEST_ENV": "yes"})
    assert result["seen"]["env"] == "yes"


def test_a_user_error_fails_with_the_package_message(make_module, fake_python):
    with pytest.raises(AnsibleFailJson) as failure:
        run_stage(make_module(), fake_python, "score", {"behave": "user_error"})
    assert failure.value.result["msg"] == "score: target layer 64 out of range"
    assert "progress: score --run" in failure.value.result["stderr_tail"]


def test_a_crash_fails_naming_the_stage_and_exit_code_with_the_traceback(make_module, fake_python):
    with pytest.raises(AnsibleFailJson) as failure:
        run_stage(make_module(), fake_python, "extract", {"behave": "crash"})
    assert failure.value.result["msg"].startswith("specops.extract crashed (exit 1)")
    assert "ZeroDivisionError" in failure.value.result["stderr_tail"]


def test_a_crash_returns_its_error_output_as_stderr_lines_ending_with_the_exception(make_module, fake_python):
    # Playbooks append the last of stderr_lines to msg, as for ansible.builtin.command.
    with pytest.raises(AnsibleFailJson) as failure:
        run_stage(make_module(), fake_python, "extract", {"behave": "crash"})
    assert failure.value.result["msg"].endswith("the end of its error output follows:")
    assert failure.value.result["stderr_lines"][-1] == "ZeroDivisionError: division by zero"


def test_a_killed_stage_is_said_to_be_killed_not_to_have_crashed(make_module, fake_python):
    with pytest.raises(AnsibleFailJson) as failure:
        run_stage(make_module(), fake_python, "extract", {"behave": "killed"})
    assert failure.value.result["msg"].startswith("specops.extract was killed by signal 9 (exit -9)")
    assert failure.value.result["stderr_lines"] == ["progress: extract --run"]


def test_a_stage_the_host_takes_is_not_started_again_and_gets_the_priority_asked(
        make_module, fake_python, monkeypatch):
    calls = []

    def host_run(python, module, args, data, env, nice=0):
        calls.append((module, args, json.loads(data), nice))
        return 0, '{"changed": true, "from": "host"}', "progress: score --run"

    monkeypatch.setattr(stage_host, "run", host_run)
    result = run_stage(make_module(), fake_python, "score", {"x": 1}, nice=7)
    assert result == {"changed": True, "from": "host"}
    assert calls == [("specops.score", ["--run"], {"x": 1}, 7)]


def test_a_wrapped_run_never_goes_through_the_host_and_nice_prefixes_a_started_stage(
        make_module, fake_python, monkeypatch, tmp_path):
    monkeypatch.setattr(stage_host, "run", lambda *args, **kwargs: pytest.fail("the host was asked"))
    wrapper = tmp_path / "wrapped"
    result = run_stage(make_module(), fake_python, "score", {}, wrap=lambda cmd: ["env", "WRAPPED=%s" % wrapper] + cmd)
    assert result["seen"]["argv"][-1] == "--run"

    monkeypatch.setattr(stage_host, "run", lambda *args, **kwargs: None)  # no host: started as a process
    commands = []
    module = make_module()
    real = module.run_command

    def recording(cmd, **kwargs):
        commands.append(cmd)
        return real(cmd, **kwargs)

    monkeypatch.setattr(module, "run_command", recording)
    run_stage(module, fake_python, "score", {}, nice=5)
    assert commands[0][:3] == ["nice", "-n", "5"]


def test_a_crash_without_error_output_says_so_instead_of_promising_it():
    assert crash_message("extract", 1, "  \n").endswith("; it wrote no error output")


def test_success_without_a_json_result_counts_as_a_crash(make_module, fake_python):
    with pytest.raises(AnsibleFailJson) as failure:
        run_stage(make_module(), fake_python, "score", {"behave": "no_json"})
    assert "crashed (exit 0)" in failure.value.result["msg"]
    assert "not a JSON object" in failure.value.result["stdout_tail"]


def test_a_missing_interpreter_fails_and_names_the_fix(make_module, tmp_path):
    missing = str(tmp_path / "nowhere" / "bin" / "python")
    with pytest.raises(AnsibleFailJson) as failure:
        run_stage(make_module(), missing, "score", {})
    assert missing in failure.value.result["msg"]
    assert "fla_env" in failure.value.result["msg"]


REQUEST_OPTIONS = dict(out_dir=dict(type="path", required=True), layers=dict(type="list", elements="int"))


@pytest.fixture
def make_stage_module(module_exits):
    def make(args):
        with patch_module_args(args):
            return stage_module(REQUEST_OPTIONS)

    return make


def test_a_stage_module_has_the_shared_python_option(make_stage_module):
    with pytest.raises(AnsibleFailJson) as failure:
        make_stage_module({"out_dir": "/tmp/run/score"})
    assert "python" in failure.value.result["msg"]


def test_the_request_holds_the_set_options_only(make_stage_module, fake_python):
    module = make_stage_module({"python": fake_python, "out_dir": "/tmp/run/score"})
    result = stage_result(module, "score", REQUEST_OPTIONS)
    assert result["seen"]["request"] == {"out_dir": "/tmp/run/score"}


def test_figures_the_package_leaves_out_keep_their_defaults(make_stage_module, fake_python, fake_stage):
    fake_stage(result={"tau": 3.02, "msg": "scored", "extra": 1})
    module = make_stage_module({"python": fake_python, "out_dir": "/tmp/run/score"})
    result = stage_result(module, "score", REQUEST_OPTIONS, {"tau": None, "plots": []})
    assert result == {"tau": 3.02, "plots": [], "changed": True, "msg": "scored"}


def test_a_renamed_figure_comes_from_the_package_key(make_stage_module, fake_python, fake_stage):
    fake_stage(result={"warnings": ["layer_offset: shifted by +1"]})
    module = make_stage_module({"python": fake_python, "out_dir": "/tmp/run/score"})
    result = stage_result(module, "score", REQUEST_OPTIONS, {"diagnostic_warnings": []},
                          renamed={"warnings": "diagnostic_warnings"})
    assert result["diagnostic_warnings"] == ["layer_offset: shifted by +1"]
