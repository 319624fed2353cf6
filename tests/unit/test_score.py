"""The score stage end to end on the fixture models: report files, idempotence, diagnostics, errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from score_data import layer_ids_of, request_for, write_hidden_states

from specops import report as rep
from specops import score, stats, window
from specops.stage import StageError

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scored(fixture_models, run_dir, tmp_path_factory) -> tuple[dict, dict, Path]:
    out_dir = tmp_path_factory.mktemp("score") / "score"
    request = request_for(fixture_models, run_dir, out_dir)
    return request, score.run(request), out_dir


def test_plan_on_a_fresh_directory_would_change_and_writes_nothing(fixture_models, run_dir, tmp_path):
    result = score.plan(request_for(fixture_models, run_dir, tmp_path / "score"))
    assert result["changed"] is True
    assert not (tmp_path / "score").exists()


def test_run_writes_the_summary_and_the_drafters_own_directory(scored, fixture_models):
    _, result, out_dir = scored
    assert result["changed"] is True
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        ["report.json", "report.md", rep.PLOT_TAU_BY_DRAFTER, "manifest.json", "drafters"]
    )
    own = out_dir / "drafters" / fixture_models.drafter.name
    assert sorted(p.name for p in own.iterdir()) == sorted(["report.json", "report.md", *rep.PLOT_FILES])


def test_every_plot_the_report_links_exists(scored):
    _, _, out_dir = scored
    for markdown in [out_dir / "report.md", *out_dir.glob("drafters/*/report.md")]:
        links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown.read_text())
        assert links and all((markdown.parent / link).is_file() for link in links), markdown


def test_manifest_lists_every_file_the_run_wrote(scored):
    _, _, out_dir = scored
    listed = set(json.loads((out_dir / "manifest.json").read_text())["files"])
    written = {str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file()} - {"manifest.json"}
    assert listed == written


def test_cpu_scoring_defaults_to_float32(fixture_models, run_dir, tmp_path):
    request = request_for(
        fixture_models, run_dir, tmp_path / "score", dtype=None, reference_drafter=None, diagnostics=[]
    )
    score.run(request)
    assert json.loads((tmp_path / "score/report.json").read_text())["run"]["dtype"] == "float32"


def test_scoring_inside_a_window_on_a_gpu_defaults_to_bfloat16_and_elsewhere_keeps_its_rule(fixture_models):
    from specops.score.scorer import resolve_dtype

    target, drafters = fixture_models.target, [fixture_models.drafter]
    # Inside the window the downtime counts: the benchmarked precision, whatever memory is free (no GPU
    # is asked here: the rule is decided before).
    assert resolve_dtype("auto", "cuda:0", target, drafters, in_window=True) == "bfloat16"
    assert resolve_dtype("auto", "cpu", target, drafters, in_window=True) == "float32"
    assert resolve_dtype("float32", "cuda:0", target, drafters, in_window=True) == "float32"
    assert resolve_dtype("auto", "cpu", target, drafters) == "float32"


def test_result_carries_the_key_figures_of_report_json(scored):
    _, result, out_dir = scored
    report = json.loads((out_dir / "report.json").read_text())
    assert result["tau"] == report["overall"]["tau"]
    assert result["reference_tau"] == report["reference"]["tau"]
    assert result["n_prompts"] == 2 and result["warnings"] == report["warnings"]
    assert 1.0 <= result["tau"] <= report["overall"]["block_size"]


def test_the_result_carries_each_taus_interval_and_the_paired_verdict(scored, fixture_models):
    _, result, out_dir = scored
    report = json.loads((out_dir / "report.json").read_text())
    assert result["tau_interval"] == report["overall"]["interval"]
    assert result["vs_reference"]["names"] == [fixture_models.drafter.name, "reference"]
    # Two prompts are too few for an interval, so no difference can be shown.
    assert result["tau_interval"] is None and result["vs_reference"]["verdict"] == stats.UNRESOLVED
    assert f"({result['ratio']:.2f}x): {stats.UNRESOLVED}" in result["verdict"]


def test_every_completion_is_scored_over_all_its_output_tokens(scored, run_dir):
    _, _, out_dir = scored
    report = json.loads((out_dir / "report.json").read_text())
    lines = (run_dir / "completions/completions.jsonl").read_text().splitlines()
    completions = [json.loads(line) for line in lines]
    # The prefill yields the first output token; every later one is accepted in some verify step.
    assert {row["id"]: row["tokens"] for row in report["per_prompt"]} == {
        c["id"]: len(c["output_ids"]) - 1 for c in completions
    }


def test_online_tau_comes_from_sglangs_meta_info(scored):
    _, result, out_dir = scored
    report = json.loads((out_dir / "report.json").read_text())
    online = {row["id"]: row["online_tau"] for row in report["per_prompt"]}
    assert online == {"fizzbuzz": 3.5, "reverse-words": None}
    assert result["online_tau"] == pytest.approx(14 / 4)


def test_report_records_the_hidden_state_backend_and_run_info(scored):
    _, _, out_dir = scored
    run = json.loads((out_dir / "report.json").read_text())["run"]
    assert run["hidden_state_backend"]["gated_delta_rule"] == "fla"
    assert run["device"] == "cpu" and run["dtype"] == "float32" and "torch" in run["versions"]


def test_rerun_with_the_same_inputs_changes_nothing(scored):
    request, first, out_dir = scored
    before = (out_dir / "manifest.json").read_text()
    again = score.run(request)
    assert again["changed"] is False
    assert again["tau"] == first["tau"]
    assert (out_dir / "manifest.json").read_text() == before


def test_plan_after_a_run_reports_up_to_date_with_the_figures(scored):
    request, first, _ = scored
    result = score.plan(request)
    assert result["changed"] is False and result["tau"] == first["tau"]


def test_plan_sees_a_changed_option(scored):
    request, _, _ = scored
    assert score.plan({**request, "layer_offset_tolerance": 0.5})["changed"] is True


def test_plan_sees_a_changed_drafter_checkpoint(fixture_models, run_dir, scored, tmp_path):
    _, _, out_dir = scored
    drafter = tmp_path / "drafter"
    shutil.copytree(fixture_models.drafter, drafter)
    config = json.loads((drafter / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (drafter / "config.json").write_text(json.dumps(config))
    assert score.plan(request_for(fixture_models, run_dir, out_dir, drafter=str(drafter)))["changed"] is True


def test_layer_offset_check_runs_when_the_shifted_layers_were_captured(scored):
    _, _, out_dir = scored
    check = next(
        d
        for d in json.loads((out_dir / "report.json").read_text())["diagnostics"]
        if d["name"] == "layer_offset"
    )
    assert set(check["details"]["tau_by_offset"]) == {"-1", "0", "+1"}
    # The tiny fixture drafter scores the same at every offset (see layer_sensitive_engine): no verdict.
    assert len(set(check["details"]["tau_by_offset"].values())) == 1
    assert check["status"] == "inconclusive" and "cannot tell" in check["message"]


def test_layer_offset_check_is_skipped_without_shifted_layers(fixture_models, run_dir, tmp_path):
    write_hidden_states(
        fixture_models.target,
        run_dir / "completions",
        tmp_path / "hs",
        layer_ids_of(fixture_models.drafter),
        offsets=(0,),
    )
    request = request_for(
        fixture_models,
        run_dir,
        tmp_path / "score",
        hidden_states=str(tmp_path / "hs"),
        reference_drafter=None,
        diagnostics=["layer_offset"],
    )
    score.run(request)
    (check,) = json.loads((tmp_path / "score/report.json").read_text())["diagnostics"]
    assert check["status"] == "skipped" and "capture_offsets" in check["message"]


def test_backend_diagnostic_warns_for_torch_fallback_hidden_states_of_an_old_transformers(
    fixture_models, run_dir, tmp_path
):
    write_hidden_states(
        fixture_models.target,
        run_dir / "completions",
        tmp_path / "hs",
        layer_ids_of(fixture_models.drafter),
        backend="torch",
    )
    manifest = json.loads((tmp_path / "hs/manifest.json").read_text())
    manifest["versions"]["transformers"] = "4.57.1"  # before the fallback matched fla's kernels
    (tmp_path / "hs/manifest.json").write_text(json.dumps(manifest))
    request = request_for(
        fixture_models,
        run_dir,
        tmp_path / "score",
        hidden_states=str(tmp_path / "hs"),
        reference_drafter=None,
        diagnostics=["backend"],
    )
    result = score.run(request)
    assert [w.split(":")[0] for w in result["warnings"]] == ["backend"]
    assert "TORCH FALLBACK" in (tmp_path / "score/report.md").read_text()


def test_vocabulary_mismatch_between_drafter_and_target_is_reported(fixture_models, run_dir, tmp_path):
    drafter = tmp_path / "drafter"
    shutil.copytree(fixture_models.drafter, drafter)
    config = json.loads((drafter / "config.json").read_text())
    config["vocab_size"] += 100
    (drafter / "config.json").write_text(json.dumps(config))
    request = request_for(
        fixture_models,
        run_dir,
        tmp_path / "score",
        drafter=str(drafter),
        reference_drafter=None,
        diagnostics=["vocabulary"],
    )
    result = score.run(request)
    assert len(result["warnings"]) == 1 and "vocabulary sizes disagree" in result["warnings"][0]


def test_mask_token_outside_the_target_vocabulary_fails_before_loading(fixture_models, run_dir, tmp_path):
    drafter = tmp_path / "drafter"
    shutil.copytree(fixture_models.drafter, drafter)
    config = json.loads((drafter / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 10_000
    (drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(StageError, match="mask_token_id 10000 is out of range"):
        score.run(request_for(fixture_models, run_dir, tmp_path / "score", drafter=str(drafter)))


def test_drafter_layers_missing_from_the_hidden_states_fail_with_the_fix(fixture_models, run_dir, tmp_path):
    write_hidden_states(fixture_models.target, run_dir / "completions", tmp_path / "hs", [0])
    with pytest.raises(StageError, match="rerun extract_hidden_states"):
        score.run(
            request_for(fixture_models, run_dir, tmp_path / "score", hidden_states=str(tmp_path / "hs"))
        )


def test_unknown_request_key_is_refused(fixture_models, run_dir, tmp_path):
    with pytest.raises(StageError, match="unknown request keys"):
        score.plan({**request_for(fixture_models, run_dir, tmp_path), "refrence_drafter": "x"})


def test_the_stage_protocol_prints_one_json_result_last(scored):
    request, first, _ = scored
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "specops.score", "--plan"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["tau"] == first["tau"]


def test_the_stage_protocol_reports_a_user_error_with_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "specops.score", "--run"],
        input=json.dumps({"out_dir": "x"}),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["msg"].startswith("score: 'hidden_states' is required")


def layer_sensitive_engine(true_features: dict):
    """Stand-in for offline_acceptance with a drafter that only works on the layers it was trained on.

    The tiny fixture drafters do not tell adjacent layers apart (a trained one scores the same tau at
    every offset: it predicts the target's loops from the block's first token), so the drafter's
    sensitivity is simulated; everything around it (reading, selecting and shifting layers) is real.
    """
    import torch

    def offline_acceptance(drafter, head, sequences, **_):
        results = []
        for seq in sequences:
            right = torch.equal(seq["features"], true_features[seq["id"]])
            steps = (seq["input_ids"].shape[0] - 1 - seq["prompt_len"]) // 4
            results.append(
                SimpleNamespace(
                    id=seq["id"],
                    accept_lengths=[4 if right else 1] * steps,
                    block_starts=[seq["prompt_len"] + 4 * i for i in range(steps)],
                )
            )
        return results

    return offline_acceptance


def test_layer_offset_check_fires_on_deliberately_shifted_hidden_states(
    fixture_models, run_dir, tmp_path, monkeypatch
):
    from specops.hidden_states import open_hidden_states

    trained_on = layer_ids_of(fixture_models.drafter)
    true_features = {
        meta["id"]: features
        for meta, _, features in open_hidden_states(run_dir / "hidden_states").select_layers(trained_on)
    }
    monkeypatch.setattr("specops.score.acceptance.offline_acceptance", layer_sensitive_engine(true_features))
    # Stored under layer k is layer k + 1: the drafter's configured ids now read the next layers.
    write_hidden_states(
        fixture_models.target,
        run_dir / "completions",
        tmp_path / "hs",
        trained_on,
        offsets=(-1, 0, 1),
        label_shift=1,
    )
    request = request_for(
        fixture_models,
        run_dir,
        tmp_path / "score",
        hidden_states=str(tmp_path / "hs"),
        reference_drafter=None,
        diagnostics=["layer_offset"],
    )
    result = score.run(request)
    assert len(result["warnings"]) == 1
    assert "shifted by -1" in result["warnings"][0]
    assert result["verdict"].endswith("1 diagnostic warn: layer_offset")


def test_layer_offset_check_stays_quiet_on_correctly_labelled_hidden_states(
    fixture_models, run_dir, tmp_path, monkeypatch
):
    from specops.hidden_states import open_hidden_states

    trained_on = layer_ids_of(fixture_models.drafter)
    true_features = {
        meta["id"]: features
        for meta, _, features in open_hidden_states(run_dir / "hidden_states").select_layers(trained_on)
    }
    monkeypatch.setattr("specops.score.acceptance.offline_acceptance", layer_sensitive_engine(true_features))
    request = request_for(
        fixture_models, run_dir, tmp_path / "score", reference_drafter=None, diagnostics=["layer_offset"]
    )
    result = score.run(request)
    assert result["warnings"] == [] and result["tau"] == 4.0


def test_online_agreement_warns_naming_both_taus_when_the_server_drafter_disagrees(
    fixture_models, run_dir, tmp_path
):
    # The fixture's online figures are made up, so they cannot match the drafter's offline walk.
    request = request_for(
        fixture_models, run_dir, tmp_path / "score", server_drafter="drafter", diagnostics=["backend"]
    )
    score.run(request)
    report = json.loads((tmp_path / "score" / "report.json").read_text())
    (agreement,) = [d for d in report["diagnostics"] if d["name"] == "online_agreement"]
    comparison = report["online_comparison"]
    assert agreement["status"] == "warning"
    assert f"{comparison['online_tau']:.6f}" in agreement["message"]
    assert f"{comparison['expected_tau']:.6f}" in agreement["message"]
    assert comparison["online_tau"] == pytest.approx(14 / 4)


def test_server_drafter_must_name_a_scored_drafter(fixture_models, run_dir, tmp_path):
    with pytest.raises(StageError, match="server_drafter 'target' is not one of"):
        score.parse_request(request_for(fixture_models, run_dir, tmp_path, server_drafter="target"))
    with pytest.raises(StageError, match="no reference_drafter is given"):
        score.parse_request(
            request_for(fixture_models, run_dir, tmp_path, server_drafter="reference", reference_drafter=None)
        )


def test_report_carries_the_window_that_produced_the_hidden_states(fixture_models, run_dir, tmp_path):
    write_hidden_states(
        fixture_models.target,
        run_dir / "completions",
        tmp_path / "hs",
        layer_ids_of(fixture_models.drafter),
        offsets=(0,),
    )
    window.run(
        {
            "marks": [["stop-server", 10.0], ["extract", 12.0], ["ready", 40.0]],
            "mode": "stop",
            "hidden_states": str(tmp_path / "hs"),
        }
    )
    request = request_for(
        fixture_models,
        run_dir,
        tmp_path / "score",
        hidden_states=str(tmp_path / "hs"),
        reference_drafter=None,
        diagnostics=[],
    )
    score.run(request)
    assert json.loads((tmp_path / "score/report.json").read_text())["window"]["downtime_s"] == 30.0
    assert "## Service window" in (tmp_path / "score/report.md").read_text()


def test_server_drafter_may_name_one_of_several_drafters(fixture_models, run_dir, tmp_path):
    opts = score.parse_request(
        request_for(
            fixture_models,
            run_dir,
            tmp_path,
            drafter=[str(fixture_models.drafter)],
            server_drafter=fixture_models.drafter.name,
        )
    )
    assert opts.server_drafter == fixture_models.drafter.name and len(opts.drafter) == 1
