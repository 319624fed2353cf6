"""Several drafters share one extraction: the union of their target layers is captured once."""

from __future__ import annotations

import json
import shutil

import pytest

from specops import extract


@pytest.fixture
def completions(tmp_path):
    directory = tmp_path / "completions"
    directory.mkdir()
    (directory / "completions.jsonl").write_text(
        json.dumps({"id": "a", "prompt_ids": [5, 6, 7], "output_ids": [8, 9]}) + "\n"
    )
    (directory / "manifest.json").write_text(json.dumps({"stage": "sglang_completions"}))
    return directory


def drafter_with_layers(fixture_models, tmp_path, name: str, layer_ids: list[int]):
    out = tmp_path / name
    shutil.copytree(fixture_models.drafter, out)
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = layer_ids
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def plan(fixture_models, completions, tmp_path, drafter):
    return extract.prepare(
        {
            "target": str(fixture_models.target),
            "completions": str(completions),
            "out_dir": str(tmp_path / "hs"),
            "drafter": drafter,
            "device": "cpu",
        }
    )


def test_two_drafters_capture_the_union_of_their_layers_in_first_seen_order(
    fixture_models, completions, tmp_path
):
    first = drafter_with_layers(fixture_models, tmp_path, "first", [1, 4])
    second = drafter_with_layers(fixture_models, tmp_path, "second", [4, 2])
    assert plan(fixture_models, completions, tmp_path, [first, second]).target_layer_ids == [1, 4, 2]


def test_a_list_of_one_drafter_plans_as_the_drafter_alone(fixture_models, completions, tmp_path):
    alone = plan(fixture_models, completions, tmp_path, str(fixture_models.drafter))
    listed = plan(fixture_models, completions, tmp_path, [str(fixture_models.drafter)])
    assert listed.inputs == alone.inputs and listed.layer_ids == alone.layer_ids
