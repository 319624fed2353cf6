"""extract_hidden_states: the states written are the target's, at the drafter's layers, and only those."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from specops import extract, preflight
from specops.backend import BackendMonitor, implementation_of, planned_backends
from specops.extract import backend_guard
from specops.extract import stage as extract_stage
from specops.hidden_states import HiddenStatesError, open_hidden_states
from specops.stage import StageError

pytestmark = pytest.mark.slow
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def target(fixture_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(fixture_models.target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def completions(fixture_models, target, tmp_path_factory) -> Path:
    """Greedy completions of a few shipped prompts, of different lengths, in sglang_completions' format."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fixture_models.target)
    lines = fixture_models.prompts.read_text().splitlines()
    prompts = [json.loads(line) for line in lines if line.strip()][:5]
    directory = tmp_path_factory.mktemp("completions")
    lines = []
    for number, prompt in enumerate(prompts):
        text = prompt.get("prompt") or " ".join(m["content"] for m in prompt["messages"])
        prompt_ids = tokenizer(text)["input_ids"]
        generated = target.generate(
            torch.tensor([prompt_ids]), max_new_tokens=6 + 5 * number, do_sample=False
        )
        output_ids = generated[0, len(prompt_ids) :].tolist()
        lines.append(
            json.dumps(
                {
                    "id": prompt["id"],
                    "prompt_ids": prompt_ids,
                    "output_ids": output_ids,
                    "text": tokenizer.decode(output_ids),
                    "finish_reason": "length",
                    "meta_info": {"completion_tokens": len(output_ids)},
                }
            )
        )
    (directory / "completions.jsonl").write_text("\n".join(lines) + "\n")
    (directory / "manifest.json").write_text(json.dumps({"stage": "sglang_completions"}))
    return directory


def request(fixture_models, completions, out_dir, **overrides):
    return {
        "target": str(fixture_models.target),
        "completions": str(completions),
        "out_dir": str(out_dir),
        "drafter": str(fixture_models.drafter),
        "shard_tokens": 60,
        "device": "cpu",
        **overrides,
    }


def reference_states(target, input_ids, layer_ids):
    """What the drafter's trainer sees: output_hidden_states of a full forward, hidden_states[k + 1]."""
    with torch.no_grad():
        out = target(torch.as_tensor(input_ids)[None], output_hidden_states=True)
    return torch.stack([out.hidden_states[k + 1][0] for k in layer_ids], dim=1)


def shard_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if "shard-" in p.name)


@pytest.fixture(scope="module")
def extracted(fixture_models, completions, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("extracted") / "hidden_states"
    result = extract.run(request(fixture_models, completions, out_dir))
    return out_dir, result


def test_states_equal_output_hidden_states_at_the_drafters_layers(extracted, target):
    out_dir, _ = extracted
    states = open_hidden_states(out_dir)
    assert states.layer_ids == [1, 3, 5]
    assert len(states) == 5
    for meta, input_ids, hidden in states:
        expected = reference_states(target, input_ids, [1, 3, 5])
        assert hidden.shape == (meta["num_tokens"], 3, 64)
        # Records share right-padded batches here: padding must not reach the real tokens.
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)


def test_one_record_per_batch_is_bit_exact(fixture_models, completions, target, tmp_path):
    extract.run(request(fixture_models, completions, tmp_path, batch_tokens=1))
    for _, input_ids, hidden in open_hidden_states(tmp_path):
        assert torch.equal(hidden, reference_states(target, input_ids, [1, 3, 5]))


def test_records_keep_their_ids_tokens_and_completion_order(extracted, completions):
    out_dir, _ = extracted
    lines = [json.loads(line) for line in (completions / "completions.jsonl").read_text().splitlines()]
    states = open_hidden_states(out_dir)
    for (meta, input_ids, _), line in zip(states, lines, strict=True):
        assert meta["id"] == line["id"]
        assert meta["prompt_tokens"] == len(line["prompt_ids"])
        assert input_ids.tolist() == line["prompt_ids"] + line["output_ids"]
    assert states.manifest["num_tokens"] == sum(len(x["prompt_ids"]) + len(x["output_ids"]) for x in lines)


def test_manifest_records_target_layers_backend_and_checksums(extracted, fixture_models):
    out_dir, _ = extracted
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["layer_ids"] == manifest["target_layer_ids"] == [1, 3, 5]
    assert manifest["num_layers"] == 8 and manifest["hidden_size"] == 64 and manifest["dtype"] == "float32"
    assert manifest["backend"]["gated_delta_rule"] == "torch"
    assert manifest["backend"]["device"] == "cpu"
    assert manifest["target"]["weights"][0]["name"] == "model.safetensors"
    assert manifest["versions"]["torch"] and manifest["versions"]["transformers"]
    assert set(manifest["files"]) == set(shard_files(out_dir))
    assert len(manifest["files"]) > 1  # shard_tokens=60 splits the records
    for name, digest in manifest["files"].items():
        from specops.manifest import sha256_file

        assert digest["sha256"] == sha256_file(out_dir / name)
    assert not (out_dir / extract.STATE_NAME).exists()


def test_capture_stops_after_the_last_captured_layer(target):
    calls = []
    hooks = [
        layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
        for i, layer in enumerate(target.model.layers)
    ]
    hooks.append(target.model.norm.register_forward_hook(lambda m, a, o: calls.append("norm")))
    hooks.append(target.lm_head.register_forward_hook(lambda m, a, o: calls.append("lm_head")))
    try:
        with extract.LayerCapture(target, [1, 3]) as capture:
            outputs = capture(torch.tensor([[5, 6, 7, 8]]))
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == [0, 1, 2, 3]
    assert [o.shape for o in outputs] == [(1, 4, 64), (1, 4, 64)]


def test_unpadded_batches_skip_mask_creation_and_padded_ones_do_not(target, monkeypatch):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    built = []
    create = modeling.create_causal_mask
    monkeypatch.setattr(modeling, "create_causal_mask", lambda **kw: built.append(1) or create(**kw))
    ids = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with extract.LayerCapture(target, [1, 2]) as capture:
        unpadded = capture(ids)
        assert built == []  # transformers' own masks were not built: no read-back from the device
        padded = capture(ids, mask)
        assert built == [1]
    with extract.LayerCapture(target, [1, 2], skip_mask_creation=False) as capture:
        built_by_transformers = capture(ids)
    assert all(torch.equal(a, b) for a, b in zip(unpadded, built_by_transformers, strict=True))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(unpadded, padded, strict=True))


def test_mask_mapping_only_where_no_mask_is_what_transformers_would_build(target):
    assert extract.unpadded_mask_mapping(target.model) == {"full_attention": None, "linear_attention": None}
    sliding = types.SimpleNamespace(
        config=types.SimpleNamespace(layer_types=["sliding_attention", "full_attention"])
    )
    assert extract.unpadded_mask_mapping(sliding) is None  # a sliding window needs its mask

    class SingleMaskBody(torch.nn.Module):  # a model that takes one mask, not a mapping
        config = types.SimpleNamespace(layer_types=["full_attention"])

        def forward(self, input_ids, attention_mask=None):
            return input_ids

    assert extract.unpadded_mask_mapping(SingleMaskBody()) is None


def test_device_timer_counts_busy_time_and_keeps_only_events_in_flight(monkeypatch):
    class Event:
        """A CUDA event on a fake clock: recorded at `at` ms, finished once the clock passes it."""

        clock = 0.0

        def __init__(self, at):
            self.at = at

        def query(self):
            return Event.clock >= self.at

        def elapsed_time(self, other):
            return other.at - self.at

    moments = iter([0.0, 10.0, 12.0, 20.0, 25.0, 40.0])  # forwards of 10, 8 and 15 ms, gaps of 2 and 5
    timer = extract.DeviceTimer(torch.device("cuda"))
    monkeypatch.setattr(timer, "_record", lambda: Event(next(moments)))
    monkeypatch.setattr(timer, "synchronize", lambda: setattr(Event, "clock", 1e9))
    in_flight = []
    for finished_by in (10.0, 11.0, 100.0):  # the device's clock when the host records the end
        timer.begin()
        Event.clock = finished_by
        timer.end()
        in_flight.append(len(timer.pending))
    assert in_flight == [0, 1, 0]  # a finished pair is read and let go; one still running is kept
    assert timer.summary() == {"device_busy_s": 0.033, "device_span_s": 0.040}
    assert extract.DeviceTimer(torch.device("cpu")).summary() == {}


def test_progress_log_reports_tokens_done_and_rate(extracted):
    out_dir, result = extracted
    last = (out_dir / "progress.log").read_text().splitlines()[-1]
    total = result["tokens"]
    assert f"tokens {total}/{total} (100.0%)" in last and "tok/s" in last


def test_rerun_with_unchanged_inputs_is_unchanged_and_loads_no_model(
    extracted, fixture_models, completions, monkeypatch
):
    out_dir, _ = extracted
    monkeypatch.setattr(extract_stage, "load_model", lambda prep: pytest.fail("the model was loaded"))
    result = extract.run(request(fixture_models, completions, out_dir))
    assert result["changed"] is False
    assert extract.plan(request(fixture_models, completions, out_dir))["changed"] is False


def test_changed_layers_make_the_output_out_of_date(extracted, fixture_models, completions):
    out_dir, _ = extracted
    planned = extract.plan(request(fixture_models, completions, out_dir, layer_ids=[2]))
    assert planned["changed"] is True and planned["layer_ids"] == [2]


def test_plan_changes_nothing(fixture_models, completions, tmp_path):
    planned = extract.plan(request(fixture_models, completions, tmp_path / "hs"))
    assert planned["changed"] is True and planned["records"] == 5
    assert not (tmp_path / "hs").exists()


KILL_AFTER_FIRST_SHARD = """
import os, signal, sys
import specops.extract as extract
import specops.hidden_states as hidden_states
finish = hidden_states.ShardFile.finish
finished = []
def finish_then_die(self):
    if finished:
        os.kill(os.getpid(), signal.SIGKILL)  # half of the second shard is on disk under a temporary name
    finished.append(self.path)
    return finish(self)
hidden_states.ShardFile.finish = finish_then_die
sys.exit(extract.main(["--run"]))
"""


def test_a_killed_run_resumes_from_its_finished_shards(fixture_models, completions, target, tmp_path):
    req = request(fixture_models, completions, tmp_path, writer_threads=1)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    killed = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_FIRST_SHARD],
        input=json.dumps(req),
        text=True,
        capture_output=True,
        env=env,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    finished = [name for name in shard_files(tmp_path) if not name.endswith(".tmp")]
    assert finished == ["shard-00000.safetensors"]
    assert not (tmp_path / "manifest.json").exists()
    first = (tmp_path / "shard-00000.safetensors").stat()

    result = extract.run(req)
    assert not [name for name in shard_files(tmp_path) if name.endswith(".tmp")]
    assert result["progress"]["shards_resumed"] == 1
    assert (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns == first.st_mtime_ns
    for _, input_ids, hidden in open_hidden_states(tmp_path):
        assert torch.equal(hidden, reference_states(target, input_ids, [1, 3, 5])) or torch.allclose(
            hidden, reference_states(target, input_ids, [1, 3, 5]), rtol=1e-5, atol=1e-5
        )


def test_capture_offsets_capture_neighbours_and_skip_those_out_of_range(
    fixture_models, completions, target, tmp_path
):
    result = extract.run(
        request(fixture_models, completions, tmp_path, layer_ids=[0, 4, 7], capture_offsets=[-1, 0, 1])
    )
    states = open_hidden_states(tmp_path)
    assert result["layer_ids"] == states.layer_ids == [0, 1, 3, 4, 5, 6, 7]
    assert states.manifest["skipped_layer_ids"] == [-1, 8]
    meta, input_ids, hidden = next(iter(states.select_layers([5, 3])))
    assert torch.allclose(hidden, reference_states(target, input_ids, [5, 3]), rtol=1e-5, atol=1e-5)
    with pytest.raises(HiddenStatesError, match=r"layers \[2\] were not captured"):
        states.select_layers([2])


def test_a_truncated_shard_is_named_with_the_fix(fixture_models, completions, tmp_path):
    extract.run(request(fixture_models, completions, tmp_path))
    victim = tmp_path / "shard-00001.safetensors"
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(
        HiddenStatesError,
        match=r"shard-00001\.safetensors is truncated.*rerun the "
        r"extraction",
    ):
        list(open_hidden_states(tmp_path))


# ------------------------------------------------------------------ bad inputs: clear errors, no shards


def run_fails(req, match):
    with pytest.raises(StageError, match=match):
        extract.run(req)
    out_dir = Path(req["out_dir"])
    if out_dir.exists():
        assert not [p for p in out_dir.iterdir() if "shard-" in p.name or p.name.endswith(".tmp")]


def test_missing_model_directory_is_named(fixture_models, completions, tmp_path):
    run_fails(
        request(fixture_models, completions, tmp_path, target=str(tmp_path / "nope")),
        r"target model directory .*nope does not exist",
    )


def test_directory_without_config_is_not_a_model(fixture_models, completions, tmp_path):
    (tmp_path / "empty").mkdir()
    run_fails(
        request(fixture_models, completions, tmp_path / "out", target=str(tmp_path / "empty")),
        r"has no config\.json",
    )


def test_layer_id_out_of_range_names_the_valid_range(fixture_models, completions, tmp_path):
    run_fails(
        request(fixture_models, completions, tmp_path, layer_ids=[1, 8]),
        r"target layer 8 out of range: the model has 8 layers \(0-7\)",
    )


def test_empty_completions_are_refused(fixture_models, tmp_path):
    (tmp_path / "completions").mkdir()
    (tmp_path / "completions" / "completions.jsonl").write_text("")
    run_fails(request(fixture_models, tmp_path / "completions", tmp_path / "out"), r"holds no completions")


@pytest.mark.parametrize(
    "line, match",
    [
        ("{not json", r"line 2 is not JSON"),
        (
            '{"id": "x", "prompt_ids": [1, "a"], "output_ids": []}',
            r"line 2: 'prompt_ids' must be a list of "
            r"token ids",
        ),
        (
            '{"id": "x", "prompt_ids": [1], "output_ids": [100000]}',
            r"token id 100000 outside the target's "
            r"vocabulary",
        ),
        ('{"id": "x", "prompt_ids": [], "output_ids": []}', r"line 2 \(id 'x'\) has no tokens"),
    ],
)
def test_malformed_completions_name_the_line(fixture_models, completions, tmp_path, line, match):
    (tmp_path / "completions").mkdir()
    good = (completions / "completions.jsonl").read_text().splitlines()[0]
    (tmp_path / "completions" / "completions.jsonl").write_text(f"{good}\n{line}\n")
    run_fails(request(fixture_models, tmp_path / "completions", tmp_path / "out"), match)


def test_not_enough_disk_space_fails_before_loading(fixture_models, completions, tmp_path, monkeypatch):
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=1000))
    monkeypatch.setattr(extract_stage, "load_model", lambda prep: pytest.fail("the model was loaded"))
    run_fails(
        request(fixture_models, completions, tmp_path),
        r"not enough disk space .* KiB .* are to stay free \(disk_reserve_bytes\), 1000 bytes are free",
    )


def test_disk_full_while_writing_leaves_no_partial_shard(fixture_models, completions, tmp_path, monkeypatch):
    import specops.hidden_states as hs

    class FullDisk:
        """A shard file that takes half of the first write, then reports the disk full."""

        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def fileno(self):
            return self.handle.fileno()

        def close(self):
            self.handle.close()

        def write(self, data):
            self.handle.write(bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")

    class OsWithFullDisk:
        def __getattr__(self, name):
            return getattr(os, name)

        def fdopen(self, fd, *args, **kwargs):
            return FullDisk(os.fdopen(fd, *args, **kwargs))

    monkeypatch.setattr(hs, "os", OsWithFullDisk())
    run_fails(
        request(fixture_models, completions, tmp_path),
        r"no space left on the device of .*: free "
        r"space",
    )
    assert not (tmp_path / "manifest.json").exists()
    assert not list(tmp_path.glob("shard-*")) and not list(tmp_path.glob(".*.tmp"))


# ------------------------------------------------------------------ backends


def fake_kernel_wrapper(monkeypatch, body):
    """transformers' own dispatcher, built as if an installed package 'fakefla' provided the kernel."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    torch_function = modeling.torch_chunk_gated_delta_rule.__wrapped__
    package = types.ModuleType("fakefla")
    ops = types.ModuleType("fakefla.ops.gated_delta_rule")
    kernel = types.FunctionType(
        body.__code__,
        {"torch_function": torch_function, "torch": torch},
        "chunk_gated_delta_rule",
        None,
        body.__closure__,
    )
    kernel.__module__ = "fakefla.ops.gated_delta_rule"
    ops.chunk_gated_delta_rule = kernel
    monkeypatch.setitem(sys.modules, "fakefla", package)
    monkeypatch.setitem(sys.modules, "fakefla.ops", types.ModuleType("fakefla.ops"))
    monkeypatch.setitem(sys.modules, "fakefla.ops.gated_delta_rule", ops)
    wrapped = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fakefla")(torch_function)
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", wrapped)
    return modeling, kernel


# Named parameters, like fla's: transformers' wrapper passes only the keywords a kernel declares.
def correct_kernel(
    q,
    k,
    v,
    g=None,
    beta=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
):
    return torch_function(  # noqa: F821 (bound by fake_kernel_wrapper)
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )


def wrong_kernel(
    q,
    k,
    v,
    g=None,
    beta=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
):
    out, state = torch_function(  # noqa: F821
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    # Wrong the way a misaligned kernel is: right shapes and scale, wrong mixing over time.
    return torch.flip(out, dims=[1]), state


def test_the_kernel_transformers_dispatches_to_is_detected(monkeypatch, target):
    modeling, kernel = fake_kernel_wrapper(monkeypatch, correct_kernel)
    assert implementation_of(modeling.torch_chunk_gated_delta_rule)[0] == "fakefla"
    assert planned_backends(modeling)["gated_delta_rule"] == "fakefla"
    with BackendMonitor(modeling) as monitor, extract.LayerCapture(target, [2]) as capture:
        capture(torch.tensor([[5, 6, 7, 8]]))
    assert monitor.summary()["gated_delta_rule"] == "fakefla"


def test_forcing_torch_bypasses_the_kernel(monkeypatch, target):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    expected = reference_states(target, ids[0], [2])[:, 0]
    modeling, kernel = fake_kernel_wrapper(monkeypatch, wrong_kernel)
    with extract.LayerCapture(target, [2]) as capture:
        with BackendMonitor(modeling, force_torch=True) as monitor:
            forced = capture(ids)[0]
        with BackendMonitor(modeling) as plain:
            kernel_out = capture(ids)[0]
    assert monitor.summary()["gated_delta_rule"] == "torch"
    assert plain.summary()["gated_delta_rule"] == "fakefla"
    assert torch.allclose(forced[0], expected, atol=1e-5)
    assert not torch.allclose(forced, kernel_out, atol=1e-3)


def test_cpu_with_a_gpu_kernel_installed_fails_before_loading(
    fixture_models, completions, tmp_path, monkeypatch
):
    fake_kernel_wrapper(monkeypatch, correct_kernel)
    monkeypatch.setattr(extract_stage, "load_model", lambda prep: pytest.fail("the model was loaded"))
    run_fails(
        request(fixture_models, completions, tmp_path),
        r"fakefla is installed .* need a CUDA GPU, and the device is cpu.*require_backend: torch",
    )


def test_require_torch_on_cpu_forces_the_fallback_past_an_installed_kernel(
    fixture_models, completions, tmp_path, monkeypatch
):
    _, kernel = fake_kernel_wrapper(monkeypatch, wrong_kernel)
    result = extract.run(request(fixture_models, completions, tmp_path, require_backend="torch"))
    assert result["backend"]["gated_delta_rule"] == "torch" and result["backend"]["forced_torch"] is True


def test_require_fla_fails_when_the_torch_fallback_would_run(fixture_models, completions, tmp_path):
    run_fails(
        request(fixture_models, completions, tmp_path, require_backend="fla"),
        r"require_backend is fla but transformers will use the torch fallback",
    )


@pytest.mark.parametrize(("require", "checked"), [("auto", "any"), ("torch", "torch"), ("any", "any")])
def test_require_backend_values_the_cpu_can_satisfy_are_planned_with_auto_resolved(
    fixture_models, completions, tmp_path, require, checked
):
    # The values and meanings of fla_env's require_backend: auto is fla on CUDA only, fla fails here.
    plan = extract.plan(request(fixture_models, completions, tmp_path, require_backend=require))
    assert plan["require_backend"] == checked


def test_require_fla_fails_when_the_fallback_actually_ran():
    with pytest.raises(StageError, match=r"ran with the torch implementation, but require_backend is fla"):
        extract.check_backend("fla", {"gated_delta_rule": "torch"})
    extract.check_backend("fla", {"gated_delta_rule": "fla"})


def test_parity_probe_reports_agreement_per_layer(fixture_models, completions, tmp_path):
    result = extract.run(request(fixture_models, completions, tmp_path, parity_samples=2))
    parity = result["parity"]
    assert parity["samples"] == 2 and parity["passed"] is True
    assert [layer["layer"] for layer in parity["layers"]] == [1, 3, 5]
    assert all(layer["cosine"] > 0.99999 and layer["rel_error"] < 1e-5 for layer in parity["layers"])


def test_parity_probe_in_bf16_measures_the_noise_floor(fixture_models, completions, tmp_path):
    result = extract.run(request(fixture_models, completions, tmp_path, parity_samples=1, dtype="bfloat16"))
    layers = result["parity"]["layers"]
    assert all(0 < layer["noise_floor_rel_error"] < 0.05 for layer in layers)
    assert result["parity"]["passed"] is True
    assert open_hidden_states(tmp_path).load(0)[1].dtype == torch.bfloat16


def test_parity_probe_fails_on_a_wrong_kernel(fixture_models, completions, tmp_path, monkeypatch):
    fake_kernel_wrapper(monkeypatch, wrong_kernel)
    # Past the CPU guard: pretend the planned backend is the reference one, as a mis-detection would.
    monkeypatch.setattr(backend_guard, "planned_backends", lambda modeling: {})
    # In fp32 the reference agrees to ~1e-7, so a tight tolerance is fair; the fixture's residual
    # stream is large against its tiny attention outputs, so a wrong kernel moves states by ~0.4%.
    run_fails(
        request(fixture_models, completions, tmp_path, parity_samples=2, parity_tolerance=1e-3),
        r"parity probe failed: layer \d+ differs from the fp32 torch reference",
    )
