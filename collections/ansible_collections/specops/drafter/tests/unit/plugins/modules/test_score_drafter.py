# -*- coding: utf-8 -*-
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""score_drafter: argument spec, check mode and result shape, against a stand-in package."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json

import pytest

from ansible_collections.specops.drafter.plugins.modules import score_drafter
from ansible_collections.specops.drafter.tests.unit.helpers import AnsibleExitJson, AnsibleFailJson


def args_for(python, tmp_path, **extra):
    args = {
        "python": python,
        "hidden_states": str(tmp_path / "run" / "hidden_states"),
        "target": str(tmp_path / "models" / "target"),
        "drafter": str(tmp_path / "models" / "drafter"),
        "out_dir": str(tmp_path / "run" / "score"),
    }
    args.update(extra)
    return args


def test_missing_required_options_are_named(run_module):
    with pytest.raises(AnsibleFailJson) as failure:
        run_module(score_drafter.main, {"python": "/usr/bin/python3"})
    for option in ("hidden_states", "target", "drafter", "out_dir"):
        assert option in failure.value.result["msg"]


def test_an_unknown_device_is_rejected_with_the_choices(run_module, fake_python, tmp_path):
    with pytest.raises(AnsibleFailJson) as failure:
        run_module(score_drafter.main, args_for(fake_python, tmp_path, device="tpu"))
    assert "auto, cpu, cuda, cuda:N" in failure.value.result["msg"]


def test_check_mode_asks_the_package_for_a_plan(run_module, fake_python, fake_stage, tmp_path):
    fake_stage(result={"changed": True, "msg": "the report would be written"})
    with pytest.raises(AnsibleExitJson) as done:
        run_module(score_drafter.main, args_for(fake_python, tmp_path), check_mode=True)
    assert fake_stage.received()["argv"] == ["-m", "specops.score", "--plan"]
    assert done.value.result["changed"] is True
    assert done.value.result["tau"] is None
    assert done.value.result["msg"] == "the report would be written"


def test_check_mode_writes_nothing(run_module, fake_python, fake_stage, tmp_path):
    fake_stage(result={"changed": True})
    with pytest.raises(AnsibleExitJson):
        run_module(score_drafter.main, args_for(fake_python, tmp_path), check_mode=True)
    assert not (tmp_path / "run").exists()


def test_the_request_carries_the_options_and_leaves_out_unset_ones(run_module, fake_python, fake_stage, tmp_path):
    fake_stage()
    with pytest.raises(AnsibleExitJson):
        run_module(score_drafter.main, args_for(fake_python, tmp_path, dtype="float32"))
    received = fake_stage.received()
    assert received["argv"][-1] == "--run"
    assert received["request"]["dtype"] == "float32"
    assert received["request"]["out_dir"] == str(tmp_path / "run" / "score")
    assert "reference_drafter" not in received["request"]


def test_server_drafter_reaches_the_package(run_module, fake_python, fake_stage, tmp_path):
    fake_stage()
    with pytest.raises(AnsibleExitJson):
        run_module(score_drafter.main, args_for(fake_python, tmp_path, server_drafter="drafter"))
    assert fake_stage.received()["request"]["server_drafter"] == "drafter"


def test_server_drafter_reference_needs_a_reference_drafter(run_module, fake_python, tmp_path):
    with pytest.raises(AnsibleFailJson) as failure:
        run_module(score_drafter.main, args_for(fake_python, tmp_path, server_drafter="reference"))
    assert "reference_drafter" in failure.value.result["msg"]


def test_the_key_figures_come_from_the_package(run_module, fake_python, fake_stage, tmp_path):
    figures = {"changed": True, "tau": 3.02, "reference_tau": 12.41, "ratio": 0.243, "n_prompts": 10,
               "verdict": "the drafter accepts 3.02 tokens per step, 24% of the reference"}
    fake_stage(result=figures)
    with pytest.raises(AnsibleExitJson) as done:
        run_module(score_drafter.main, args_for(fake_python, tmp_path))
    for key, value in figures.items():
        assert done.value.result[key] == value


def test_the_intervals_and_the_paired_comparison_come_from_the_package(run_module, fake_python, fake_stage, tmp_path):
    figures = {"changed": True, "tau": 3.02, "tau_interval": [2.91, 3.13], "reference_tau_interval": [11.9, 12.8],
               "vs_reference": {"difference": -9.39, "interval": [-9.7, -9.1], "verdict": "worse"},
               "pairs": [{"names": ["a", "b"], "verdict": "no difference shown at this size"}],
               "changes": [{"drafter": "a", "direction": "up", "before": 2.5, "after": 3.02}]}
    fake_stage(result=figures)
    with pytest.raises(AnsibleExitJson) as done:
        run_module(score_drafter.main, args_for(fake_python, tmp_path))
    for key, value in figures.items():
        assert done.value.result[key] == value


def test_an_up_to_date_report_is_not_a_change(run_module, fake_python, fake_stage, tmp_path):
    fake_stage(result={"changed": False, "tau": 3.02})
    with pytest.raises(AnsibleExitJson) as done:
        run_module(score_drafter.main, args_for(fake_python, tmp_path))
    assert done.value.result["changed"] is False


def test_a_package_error_fails_the_module_with_its_message(run_module, fake_python, fake_stage, tmp_path):
    fake_stage(behave="user_error")
    with pytest.raises(AnsibleFailJson) as failure:
        run_module(score_drafter.main, args_for(fake_python, tmp_path))
    assert "target layer 64 out of range" in failure.value.result["msg"]


def test_started_ahead_of_a_window_it_scores_once_the_extraction_says_finished(
        run_module, fake_python, fake_stage, tmp_path):
    fake_stage()
    finished = tmp_path / "extract.start.state"
    finished.write_text(json.dumps({"state": "finished", "at": 1.0}))
    own = tmp_path / "score.w1.state"
    with pytest.raises(AnsibleExitJson):
        run_module(score_drafter.main, args_for(fake_python, tmp_path, placement={"finished_file": str(own)},
                                                start_after={"finished_file": str(finished),
                                                             "ended_file": str(tmp_path / "job.json"),
                                                             "timeout": 600}))
    assert fake_stage.received()["argv"][-1] == "--run"
    assert "start_after" not in fake_stage.received()["request"]
    # It said it waits, in the file the play reads before it opens the window.
    assert json.loads(own.read_text())["state"] == "waiting"


def test_started_ahead_of_a_window_it_does_not_score_when_the_extraction_ended_otherwise(
        run_module, fake_python, fake_stage, tmp_path):
    fake_stage()
    state, job = tmp_path / "extract.start.state", tmp_path / "job.json"
    state.write_text(json.dumps({"state": "stopped"}))
    job.write_text(json.dumps({"failed": True, "finished": 1, "msg": "out of memory"}))
    with pytest.raises(AnsibleFailJson) as failure:
        run_module(score_drafter.main, args_for(fake_python, tmp_path, start_after={
            "finished_file": str(state), "ended_file": str(job), "timeout": 600}))
    assert "the extraction ended without finishing (out of memory)" in failure.value.result["msg"]
    assert failure.value.result["not_started"] is True
    with pytest.raises((OSError, ValueError)):
        fake_stage.received()  # the stage never ran
