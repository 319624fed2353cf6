"""What would only fail inside the window is refused while the service still serves: a GPU holder that
is not the server's, and an extraction that fails while it prepares beside the server (its cause in
the play's message). Each ends with the same server process answering, never stopped."""

from __future__ import annotations

import shutil
import subprocess
import sys

from test_faults import said


def test_a_gpu_holder_that_is_not_ours_is_refused_before_the_stop(served, tmp_path):
    site = served
    run_dir = site.seed_run_dir(site.run_dir, tmp_path / "run")
    # A stand-in GPU device file, held open by a process of another tenant (this test's, not the server's).
    devices = tmp_path / "dev"
    devices.mkdir()
    (devices / "nvidia0").write_bytes(b"")
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import time; f = open({str(devices / 'nvidia0')!r}); time.sleep(3600)"]
    )
    try:
        pid_before = site.server_pid()
        result = site.play(
            "eval.yml", specops_run_dir=str(run_dir), gpu_release_device_pattern=str(devices / "nvidia*")
        )
        assert result.rc != 0
        assert "specops stage 'gpu-holders' failed" in said(result), result.output[-4000:]
        assert str(holder.pid) in said(result)
        assert "(the service was not taken down)" in said(result)
        assert site.server_pid() == pid_before and site.health_generate_status() == 200
        assert holder.poll() is None  # never signalled
        assert not (run_dir / "hidden_states").exists()
    finally:
        holder.kill()
        holder.wait()


def test_an_extraction_that_fails_while_preparing_fails_before_the_stop_with_its_cause(served, tmp_path):
    site = served
    run_dir = site.seed_run_dir(site.run_dir, tmp_path / "run")
    # The same target, its weights cut short: the server keeps serving the intact one.
    target = tmp_path / "target"
    shutil.copytree(site.models_dir / "target", target)
    weights = sorted(target.glob("*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    pid_before = site.server_pid()
    result = site.play(
        "eval.yml",
        specops_run_dir=str(run_dir),
        specops_target_model=str(target),
        sglang_service_model_path=str(site.models_dir / "target"),
    )
    assert result.rc != 0
    text = said(result)
    refused = ("specops stage 'extract' failed", "specops stage 'prestart-extraction' failed")
    assert any(stage in text for stage in refused), text[-4000:]
    # The cause, not only "crashed": the weights file is named.
    assert weights.name in text or "safetensors" in text.lower(), text[-4000:]
    assert "(the service was not taken down)" in text
    assert site.server_pid() == pid_before and site.health_generate_status() == 200
    shards = run_dir / "hidden_states"
    assert not shards.exists() or not any(shards.glob("*.safetensors"))
