"""eval.yml that fails on the local default: the failing stage is named, and the service is brought
back, or never taken down when the failure can be known before the window."""

from __future__ import annotations

import re
import shutil


def test_failed_extraction_names_the_stage_and_the_service_comes_back(first_run, local_default, tmp_path):
    # Truncated weights pass the input checks (config and tensor index are intact) and fail only when
    # the extraction loads the model: inside the GPU window, with the service down, when the extraction
    # is not started ahead of the window (started ahead, it fails before the stop).
    good = local_default.models_dir / "target"
    broken = tmp_path / "truncated-target"
    shutil.copytree(good, broken)
    weights = broken / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    pid_before = local_default.server_pid()
    result = local_default.play(
        "eval.yml",
        specops_run_dir=str(local_default.work_dir / "run-broken"),
        specops_target_model=str(broken),
        sglang_service_model_path=str(good),
        specops_prestart_extraction=False,
    )
    assert result.rc != 0
    assert "specops stage 'extract' failed" in result.output, result.output[-4000:]
    assert "the service was brought back" in result.output
    assert local_default.server_pid() != pid_before, "the window should have stopped the server"
    assert local_default.health_generate_status() == 200
    # The failed window is on the record: the start's own moments are read, not the extraction's failure
    # (which has no ready_at, and left the serve stage's, from before the stop).
    assert re.search(r"TASK \[Stage record: publish the window[^\n]*\n(ok|changed): ", result.output), (
        result.output[-6000:]
    )


def test_bad_layer_id_fails_before_the_service_is_touched(first_run, local_default):
    pid_before = local_default.server_pid()
    run_dir = local_default.seed_run_dir(local_default.run_dir, local_default.work_dir / "run-bad-layer")
    result = local_default.play(
        "eval.yml",
        specops_run_dir=str(run_dir),
        extract_hidden_states_layer_ids=[99],
    )
    assert result.rc != 0
    assert "specops stage 'extract' failed" in result.output
    assert "99" in result.output and "the service was not taken down" in result.output
    assert local_default.server_pid() == pid_before
    assert local_default.health_generate_status() == 200


def test_mistyped_target_model_is_refused_before_the_healthy_server_is_restarted(first_run, local_default):
    pid_before = local_default.server_pid()
    result = local_default.play(
        "eval.yml",
        specops_run_dir=str(local_default.work_dir / "run-typo"),
        specops_target_model=str(local_default.models_dir / "Qwen3.6-27b"),
    )
    assert result.rc != 0
    assert "specops stage 'serve' failed" in result.output, result.output[-4000:]
    assert "sglang_service_model_path" in result.output and "does not exist" in result.output
    assert "the service was not taken down" in result.output
    assert local_default.server_pid() == pid_before
    assert local_default.health_generate_status() == 200
