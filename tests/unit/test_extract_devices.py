"""extract.devices: which devices extraction runs on and how, decided from memory alone (no GPU needed)."""

from __future__ import annotations

import pytest

from specops import extract
from specops.extract.devices import (
    GIB,
    Footprint,
    activation_reserve,
    assign_shards,
    choose,
    footprint,
    place_layers,
    truncated_config,
)
from specops.stage import StageError

# 1 GiB of embeddings, four 2 GiB layers (up to the last captured one), a 1 GiB head: 10 GiB a copy.
MODEL = Footprint(embed_bytes=1 * GIB, layer_bytes=[2 * GIB] * 4, lm_head_bytes=1 * GIB)
RESERVE = 2 * GIB


def test_shards_go_longest_first_to_the_least_loaded_worker():
    sizes = [("a", 9), ("b", 7), ("c", 5), ("d", 4), ("e", 3), ("f", 2)]
    assert assign_shards(sizes, 2) == [["a", "d", "f"], ["b", "c", "e"]]  # 15 tokens each


def test_shard_assignment_breaks_ties_by_name_and_worker_number():
    assert assign_shards([("s1", 5), ("s0", 5), ("s2", 5)], 2) == [["s0", "s2"], ["s1"]]


def test_more_workers_than_shards_leaves_some_idle():
    assert assign_shards([("a", 3)], 3) == [["a"], [], []]


def test_one_worker_takes_every_shard_longest_first():
    assert assign_shards([("a", 1), ("b", 3), ("c", 2)], 1) == [["b", "c", "a"]]


def test_layers_split_in_proportion_to_spare_memory():
    assert place_layers(0, [1] * 4, [10, 10]) == [0, 0, 1, 1]
    assert place_layers(0, [1] * 4, [30, 10]) == [0, 0, 0, 1]


def test_embeddings_count_against_the_first_device():
    # 2 + 4 x 1 bytes over two equal devices: 3 each, so the first holds the embeddings and one layer.
    assert place_layers(2, [1] * 4, [10, 10]) == [0, 1, 1, 1]


def test_a_model_larger_than_the_spare_memory_is_refused_with_the_figures():
    with pytest.raises(StageError, match=r"needs 9\.0 GiB and the devices have 8\.0 GiB to spare"):
        place_layers(GIB, [2 * GIB] * 4, [4 * GIB, 4 * GIB])


def test_layers_that_cannot_be_cut_to_the_devices_are_refused():
    # 10 bytes fit in 5 + 5 only as 5 + 5; layers of 4 and 2 cannot make that.
    with pytest.raises(StageError, match="cannot be cut to fit"):
        place_layers(0, [4, 2, 2, 2], [5, 5])


def test_auto_runs_one_copy_per_device_when_the_model_fits_on_each():
    plan = choose("auto", ["cuda:0", "cuda:1"], [12 * GIB, 14 * GIB], MODEL, RESERVE)
    assert (plan.mode, plan.devices) == ("data", ["cuda:0", "cuda:1"])


def test_auto_uses_only_the_devices_the_model_fits_on():
    plan = choose("auto", ["cuda:0", "cuda:1", "cuda:2"], [12 * GIB, 5 * GIB, 13 * GIB], MODEL, RESERVE)
    assert (plan.mode, plan.devices) == ("data", ["cuda:0", "cuda:2"])


def test_auto_runs_on_the_one_device_the_model_fits_on():
    plan = choose("auto", ["cuda:0", "cuda:1"], [5 * GIB, 12 * GIB], MODEL, RESERVE)
    assert (plan.mode, plan.devices) == ("single", ["cuda:1"])


def test_auto_splits_a_model_that_fits_on_no_device():
    plan = choose("auto", ["cuda:0", "cuda:1"], [8 * GIB, 8 * GIB], MODEL, RESERVE)
    # 9 GiB of body (the head is not placed) over 6 + 6 GiB spare: the embeddings and a layer on the first.
    assert (plan.mode, plan.devices, plan.layer_devices) == ("split", ["cuda:0", "cuda:1"], [0, 0, 1, 1])
    assert plan.describe()["layers"] == [
        {"device": "cuda:0", "layers": [0, 1]},
        {"device": "cuda:1", "layers": [2, 3]},
    ]


def test_split_leaves_out_devices_without_spare_memory():
    plan = choose("auto", ["cuda:0", "cuda:1", "cuda:2"], [8 * GIB, 1 * GIB, 8 * GIB], MODEL, RESERVE)
    assert (plan.mode, plan.devices) == ("split", ["cuda:0", "cuda:2"])


def test_split_can_be_forced_on_a_model_that_fits():
    plan = choose("split", ["cuda:0", "cuda:1"], [80 * GIB, 80 * GIB], MODEL, RESERVE)
    assert (plan.mode, plan.layer_devices) == ("split", [0, 0, 1, 1])


def test_data_parallel_when_asked_names_the_device_it_does_not_fit_on():
    with pytest.raises(StageError, match=r"12\.0 GiB on each device but cuda:1 has 5\.0 GiB free"):
        choose("data", ["cuda:0", "cuda:1"], [12 * GIB, 5 * GIB], MODEL, RESERVE)


def test_single_when_asked_takes_the_first_device():
    plan = choose("single", ["cuda:0", "cuda:1"], [80 * GIB, 80 * GIB], MODEL, RESERVE)
    assert (plan.mode, plan.devices) == ("single", ["cuda:0"])


def test_the_plan_records_what_it_was_decided_from():
    described = choose("auto", ["cuda:0", "cuda:1"], [12 * GIB, 14 * GIB], MODEL, RESERVE).describe()
    assert described["copy_gib"] == 10.0 and described["reserve_gib"] == 2.0
    assert described["free_gib"] == {"cuda:0": 12.0, "cuda:1": 14.0}
    assert described["reason"] == "the model fits on every device"


def test_the_footprint_is_the_loaded_models_up_to_the_last_captured_layer(fixture_models):
    import torch
    from transformers import AutoModelForCausalLM

    config = truncated_config(fixture_models.target, 5)
    measured = footprint(config, torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(fixture_models.target, config=config, dtype=torch.bfloat16)
    size = lambda m: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])  # noqa: E731
    layers = model.model.layers
    assert len(layers) == 6 and measured.layer_bytes == [size(layer) for layer in layers]
    assert measured.body_bytes + measured.lm_head_bytes == size(model)
    assert measured.lm_head_bytes == size(model.lm_head)


def test_the_reserve_grows_with_the_batch_and_the_captured_layers(fixture_models):
    config = truncated_config(fixture_models.target, 5)
    # hidden 64, intermediate 128: (2 x 128 + 8 x 64 + 2 x 3 x 64) x 2 bytes per token past the fixed GiB.
    assert activation_reserve(config, 1000, 3, 2) == GIB + 1000 * 1152 * 2


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("parallel", "tensor", r"parallel 'tensor' is not one of auto, single, data, split"),
        ("devices", "cuda:0", r"devices must be auto or a non-empty list"),
        ("devices", [], r"devices must be auto or a non-empty list"),
    ],
)
def test_bad_device_requests_are_named(key, value, match):
    with pytest.raises(StageError, match=match):
        extract.parse_request({"target": "t", "completions": "c", "out_dir": "o", key: value})
