"""Diagnostics that explain a low tau: layer offsets, the extraction backend, vocabulary and mask token."""

from __future__ import annotations

import json
import shutil

import pytest

from specops import diagnostics as diag

HYBRID = {"layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}


def fake_scorer(best_offset: int, base: float = 2.0, gain: float = 3.0):
    """tau as a drafter trained on layers shifted by best_offset would score."""
    calls = []

    def score(ids: list[int]) -> float:
        calls.append(ids)
        offset = ids[0] - 1
        return base + gain if offset == best_offset else base

    return score, calls


def test_layer_offset_warns_when_a_shift_scores_clearly_higher():
    score, _ = fake_scorer(best_offset=1)
    result = diag.layer_offset_check(score, [0, 1, 2, 3, 4, 5], [1, 4], base_tau=2.0)
    assert result["status"] == "warning"
    assert "shifted by +1" in result["message"] and "[2, 5]" in result["message"]
    assert result["details"]["tau_by_offset"] == {"0": 2.0, "-1": 2.0, "+1": 5.0}


def test_layer_offset_is_ok_when_the_configured_layers_score_best():
    score, calls = fake_scorer(best_offset=0, base=1.0)
    result = diag.layer_offset_check(score, [0, 1, 2, 3, 4, 5], [1, 4], base_tau=4.0)
    assert result["status"] == "ok"
    assert calls == [[0, 3], [2, 5]]


def test_layer_offset_ignores_a_gain_within_the_tolerance():
    result = diag.layer_offset_check(lambda ids: 2.15, [0, 1, 2, 3], [1, 2], base_tau=2.0, tolerance=0.1)
    assert result["status"] == "ok"


def test_layer_offset_is_skipped_with_the_fix_when_shifted_layers_were_not_captured():
    score, calls = fake_scorer(best_offset=1)
    result = diag.layer_offset_check(score, [1, 4], [1, 4], base_tau=2.0)
    assert result["status"] == "skipped"
    assert "capture_offsets" in result["message"]
    assert calls == []


def test_layer_offset_runs_the_one_shift_that_was_captured():
    score, calls = fake_scorer(best_offset=-1)
    result = diag.layer_offset_check(score, [0, 1, 3, 4], [1, 4], base_tau=2.0)
    assert calls == [[0, 3]]
    assert result["status"] == "warning" and result["details"]["missing_layers"] == {"+1": [2, 5]}


def test_backend_warns_loudly_on_the_torch_fallback():
    result = diag.backend_check({"backend": {"gated_delta_rule": "torch", "device": "cpu"}}, HYBRID)
    assert result["status"] == "warning"
    assert "TORCH FALLBACK" in result["message"] and "fla" in result["message"]


def test_backend_is_ok_with_fla_kernels():
    result = diag.backend_check({"backend": {"gated_delta_rule": "fla", "device": "cuda"}}, HYBRID)
    assert result["status"] == "ok"


def test_backend_warns_when_the_manifest_does_not_say():
    assert diag.backend_check({}, HYBRID)["status"] == "warning"


def test_backend_does_not_matter_for_a_target_without_linear_attention():
    dense = {"layer_types": ["full_attention"]}
    result = diag.backend_check({"backend": {"gated_delta_rule": "torch"}}, dense)
    assert result["status"] == "ok"


def test_backend_reads_the_text_config_of_a_multimodal_target():
    result = diag.backend_check({"backend": {"gated_delta_rule": "torch"}}, {"text_config": HYBRID})
    assert result["status"] == "warning"


@pytest.fixture
def drafter_config(fixture_models) -> dict:
    return json.loads((fixture_models.drafter / "config.json").read_text())


def test_vocabulary_is_ok_for_the_matching_fixture_drafter(fixture_models, drafter_config):
    result = diag.vocabulary_check(drafter_config, fixture_models.target)
    assert result["status"] == "ok", result["message"]
    assert result["details"]["mask_token"] == {"content": "<|mask|>", "kind": "special"}
    assert result["details"]["lm_head_rows"] == result["details"]["target_vocab_size"]


def test_vocabulary_mismatch_is_reported(fixture_models, drafter_config):
    drafter_config["vocab_size"] += 7
    result = diag.vocabulary_check(drafter_config, fixture_models.target)
    assert result["status"] == "warning"
    assert "vocabulary sizes disagree" in result["message"]


def test_mask_token_that_is_an_ordinary_token_is_reported(fixture_models, drafter_config):
    drafter_config["dflash_config"]["mask_token_id"] = 300  # a BPE merge, not a special token
    result = diag.vocabulary_check(drafter_config, fixture_models.target)
    assert result["status"] == "warning"
    assert "ordinary token" in result["message"]
    assert diag.mask_token_error(result) is None


def test_mask_token_outside_the_vocabulary_is_an_error(fixture_models, drafter_config):
    drafter_config["dflash_config"]["mask_token_id"] = 10_000
    result = diag.vocabulary_check(drafter_config, fixture_models.target)
    assert "out of range" in diag.mask_token_error(result)


def test_vocabulary_check_without_a_tokenizer_checks_sizes_only(fixture_models, drafter_config, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    for path in fixture_models.target.iterdir():
        if path.name in ("config.json",) or path.suffix == ".safetensors":
            shutil.copy(path, target / path.name)
    result = diag.vocabulary_check(drafter_config, target)
    assert result["status"] == "ok"
    assert result["details"]["tokenizer"] == "not found"
