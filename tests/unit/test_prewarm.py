"""Work moved before the service window: the target's weights read, fla's kernels tuned for the plan."""

import numpy as np
import pytest
from score_data import write_completions
from transformers import AutoConfig

from specops import prewarm
from specops.extract import Record
from specops.stage import StageError


def record(index: int, tokens: int) -> Record:
    return Record(index, index, np.zeros(tokens, dtype=np.int64), 1)


def test_batch_shapes_are_the_distinct_padded_batches_of_the_extraction_plan():
    records = [record(0, 100), record(1, 90), record(2, 40), record(3, 40)]
    shapes = prewarm.batch_shapes(records, shard_tokens=1000, batch_tokens=200)
    assert shapes == [(2, 100, True), (1, 40, False)]


def test_one_layer_of_each_kind_keeps_the_layer_shapes_and_cuts_the_rest():
    config = AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=248320,
        hidden_size=64,
        num_hidden_layers=8,
        layer_types=["linear_attention"] * 3
        + ["full_attention"]
        + ["linear_attention"] * 3
        + ["full_attention"],
    )
    cut = prewarm.one_layer_of_each_kind(config)
    assert cut.num_hidden_layers == 4 and cut.layer_types[-1] == "full_attention"
    assert (cut.hidden_size, cut.vocab_size) == (64, 1024)
    assert config.num_hidden_layers == 8


def test_weights_are_read_once_and_timed(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 3_000_000)
    result = prewarm.read_into_page_cache(prewarm.weight_files(tmp_path))
    assert result["done"] is True and result["bytes"] == 3_000_000


def test_weights_that_would_not_fit_in_host_memory_are_not_read(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    monkeypatch.setattr(prewarm, "available_memory_bytes", lambda: 1000)
    result = prewarm.read_into_page_cache(prewarm.weight_files(tmp_path))
    assert result["done"] is False and "would not fit" in result["reason"]


@pytest.fixture(scope="module")
def completions(fixture_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("prewarm") / "completions"
    write_completions(fixture_models.target, fixture_models.prompts, out, n_prompts=2, max_new_tokens=8)
    return out


def test_on_the_cpu_the_kernels_are_not_tuned_and_the_reason_is_given(fixture_models, completions):
    result = prewarm.run(
        {"target": str(fixture_models.target), "completions": str(completions), "device": "cpu"}
    )
    assert result["read_weights"]["done"] is True
    assert result["tune_kernels"]["done"] is False and "CUDA only" in result["tune_kernels"]["reason"]


def test_unknown_request_keys_are_refused():
    with pytest.raises(StageError, match="unknown request keys"):
        prewarm.parse_request({"target": "t", "completions": "c", "batch": 3})
