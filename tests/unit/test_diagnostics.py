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


def test_layer_offset_is_inconclusive_when_every_offset_scores_the_same():
    result = diag.layer_offset_check(lambda ids: 1.0, [0, 1, 2, 3, 4, 5], [1, 4], base_tau=1.0)
    assert result["status"] == "inconclusive"
    assert "cannot tell" in result["message"] and "0: 1.00, -1: 1.00, +1: 1.00" in result["message"]


def test_backend_fallback_of_an_aligned_transformers_does_not_warn():
    manifest = {
        "backend": {"gated_delta_rule": "torch", "device": "cpu"},
        "versions": {"transformers": "5.23.0"},
    }
    result = diag.backend_check(manifest, HYBRID)
    assert result["status"] == "ok" and "does not change this tau" in result["message"]


def test_backend_fallback_does_not_warn_when_the_reference_scores_well_on_the_same_states():
    manifest = {"backend": {"gated_delta_rule": "torch"}, "versions": {"transformers": "4.57.1"}}
    result = diag.backend_check(manifest, HYBRID, reference_tau=4.15, drafter_tau=1.0)
    assert result["status"] == "ok" and "does not explain" in result["message"]


def test_backend_fallback_warns_when_nothing_shows_the_states_are_usable():
    manifest = {"backend": {"gated_delta_rule": "torch"}, "versions": {"transformers": "4.57.1"}}
    assert diag.backend_check(manifest, HYBRID, reference_tau=1.0, drafter_tau=1.0)["status"] == "warning"


BLOCK = 4


def overall_of(lengths: list[int], block: int = BLOCK) -> dict:
    from specops import report as rep

    return rep.summarize([{"id": "x", "accept_lengths": lengths}], block)


def rows(ratios: dict[str, float]) -> list[dict]:
    return [{"id": key, "ratio": value} for key, value in ratios.items()]


def test_acceptance_names_position_one_near_zero_as_the_cause():
    result = diag.acceptance_pattern_check(overall_of([1] * 40), overall_of([4] * 40), rows({"a": 0.25}))
    assert result["status"] == "warning"
    assert result["message"].startswith("position-1 acceptance is 0.000")
    assert "mask_token_id" in result["message"] and "the reference scores tau 4.00" in result["message"]
    assert result["details"]["cause"].startswith("position-1 acceptance 0.000")


def test_acceptance_names_a_collapse_after_position_k():
    # Every step accepts exactly 2 drafts: position 3 is never accepted once reached.
    overall = overall_of([3] * 30, block=8)
    result = diag.acceptance_pattern_check(overall, None, [])
    assert result["status"] == "warning" and result["details"]["collapse_after"] == 2
    assert "collapses after position 2" in result["message"] and "block size 3" in result["message"]


def test_acceptance_tells_far_below_the_reference_on_every_prompt():
    result = diag.acceptance_pattern_check(
        overall_of([2, 1, 2, 1]), overall_of([4] * 4), rows({"a": 0.3, "b": 0.4})
    )
    assert "on every prompt" in result["message"] and "systematic" in result["details"]["cause"]


def test_acceptance_tells_far_below_the_reference_on_some_prompts():
    result = diag.acceptance_pattern_check(
        overall_of([2, 1, 2, 1]), overall_of([4] * 4), rows({"a": 0.3, "b": 0.95, "c": 1.0})
    )
    assert "on 1 of 3 prompts (a)" in result["message"]
    assert result["details"]["prompts_far_below_reference"] == ["a"]


def test_acceptance_is_ok_without_a_telling_pattern():
    result = diag.acceptance_pattern_check(overall_of([4, 3, 4, 2]), overall_of([4] * 4), rows({"a": 0.9}))
    assert result["status"] == "ok"


def comparison(mismatched_ids: list[str]) -> dict:
    return {
        "server_drafter": "reference",
        "n_prompts": 3,
        "online_tau": 4.0,
        "expected_tau": 4.1,
        "offline_tau": 4.0,
        "expected_steps": 10,
        "expected_tokens": 41,
        "not_scored": [],
        "mismatched": [
            {"id": i, "online_tau": 4.0, "expected_tau": 4.1, "online_verify_ct": 5, "expected_verify_ct": 4}
            for i in mismatched_ids
        ],
    }


def test_online_difference_at_near_ties_is_not_a_configuration_error():
    margins = {
        "p1": {"closest": 0.02, "block_start": 30, "position": 3},
        "p2": {"closest": 0.3, "block_start": 12, "position": 1},
    }
    result = diag.online_agreement_check(comparison(["p1", "p2"]), "reference", margins=margins)
    assert result["status"] == "ok" and result["details"]["classification"] == "near_tie"
    assert "near-tie" in result["message"] and "smallest 0.020" in result["message"]


def test_online_difference_without_a_near_tie_is_a_configuration_error():
    margins = {
        "p1": {"closest": 0.02, "block_start": 30, "position": 3},
        "p2": {"closest": 6.5, "block_start": 12, "position": 1},
    }
    result = diag.online_agreement_check(comparison(["p1", "p2"]), "reference", margins=margins)
    assert result["status"] == "warning" and result["details"]["classification"] == "configuration"
    assert "prompt p2 had no draft within 0.5 logits" in result["message"]


def test_online_difference_without_margins_says_it_could_not_tell():
    result = diag.online_agreement_check(comparison(["p1"]), "reference")
    assert result["status"] == "warning" and result["details"]["classification"] == "unmeasured"


def test_online_difference_too_large_for_one_flip_is_a_configuration_error():
    wide = comparison(["p1"])
    wide["mismatched"][0]["online_tau"] = 8.0
    margins = {"p1": {"closest": 0.01, "block_start": 30, "position": 3}}
    result = diag.online_agreement_check(wide, "reference", margins=margins)
    assert result["details"]["classification"] == "configuration"
    assert "by more than 20% in tau" in result["message"]
