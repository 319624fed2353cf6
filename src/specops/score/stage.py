"""Score DFlash drafters offline on extracted hidden states: `python -m specops.score --plan|--run`.

Request (JSON on stdin, docs/architecture.md):
  hidden_states      extraction output directory (manifest.json + shards)            required
  target             target model directory (embed_tokens, lm_head, tokenizer)        required
  drafter            drafter checkpoint directory (config.json + safetensors), or a
                     list of them (checkpoints of a training run, or rivals)          required
  out_dir            where report.json, report.md, the summary's PNGs, drafters/<name>/
                     (each drafter's report and plots) and manifest.json go           required
  completions        completions directory; its SGLang spec_accept_length is shown     optional
  reference_drafter  a drafter to compare with (tau ratio)                             optional
  server_drafter     which drafter the SGLang server speculated with when it made the
                     completions: drafter (the first) | reference | a drafter's name |
                     "" (unknown); when known, the online_agreement diagnostic compares
                     SGLang's online tau with that drafter's offline tau               default ""
  device             auto | cpu | cuda | cuda:N (auto: cuda when available)           default auto
  gpu_memory_gib     on a GPU, the most memory scoring may take; it fails at start when the
                     GPU has less free (the restarted server holds the rest); 0: no limit  default 0
  dtype              auto | float32 | bfloat16 | float16 (auto: float32 on the CPU,
                     and on a GPU where the head and drafters fit in float32, except
                     bfloat16 on a GPU inside the window)                              default auto
  diagnostics        any of acceptance, layer_offset, backend, vocabulary              default all
  layer_offset_tolerance  a shifted layer choice warns when its tau exceeds the configured
                     layers' tau by more than this fraction                            default 0.10
  detectable_difference  the difference in tau the report says how many prompts a
                     paired comparison needs to resolve (beside the observed one)   default 0.1
  step_costs         {draft_cost, verify_cost} in target decode steps, measured
                     (benchmarks/speedup_h200.py); without it they are estimated       optional
  history            directory of past runs: this run is copied to history/<run_id>/
                     and appended to history/index.jsonl; the report shows the trend  optional
  force              rescore even if the manifest says the report is up to date         default false

A drafter's name is its directory's name (made unique with -2, -3, ... when two agree); its
report and plots go to out_dir/drafters/<name>/.

The inputs fingerprint covers the hidden-state and completions manifests, the drafters' files,
the target's small files and the options; plan mode decides from it without loading a model.

This module holds the stage itself (plan, run, and the diagnostics run puts in each report); the
request is in request, the inputs read before any model loads in inputs, the models and the engine's
run in scorer, and the writing of the reports in writing (the package's __init__ lists them all).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specops import cpu_bounds, devices
from specops import diagnostics as diag
from specops import placement as where
from specops import report as rep
from specops.devices import resolve_device
from specops.manifest import (
    atomic_write_json,
    fingerprint,
    is_up_to_date,
    load_manifest,
    remove_stale_temporaries,
)
from specops.model_files import read_json
from specops.score import report_reuse
from specops.score.inputs import (
    checked_config,
    inputs_of,
    online_acceptance,
)
from specops.score.request import STAGE, Options, parse_request
from specops.score.result import REPORT_JSON, REPORT_MD, key_figures
from specops.score.scorer import (
    Scorer,
    limit_gpu_memory,
    model_errors,
    resolve_dtype,
    versions,
)
from specops.score.writing import write_outputs
from specops.stage import StageError, log, serve

# The word the window's guard reads as the work's end (module_utils/window/guard.py FINISHED).
FINISHED = "finished"


def plan(request: dict[str, Any]) -> dict[str, Any]:
    opts = parse_request(request)
    inputs = inputs_of(opts)
    if not opts.force and is_up_to_date(opts.out_dir, fingerprint(inputs)):
        report = json.loads((opts.out_dir / REPORT_JSON).read_text())
        return {**key_figures(report, opts.out_dir, changed=False), "msg": "the report is up to date"}
    return {
        "changed": True,
        "out_dir": str(opts.out_dir),
        "msg": f"would score {', '.join(map(str, opts.drafter))}"
        + (f" against {opts.reference_drafter}" if opts.reference_drafter else "")
        + f" on {opts.hidden_states} and write {REPORT_MD}, {REPORT_JSON} and the plots to "
        f"{opts.out_dir}",
    }


def _layer_offset(
    scorer: Scorer, drafter, opts: Options, captured: list[int], layer_ids: list[int], base: Mapping[str, Any]
) -> dict[str, Any]:
    base_tau = rep.summarize(base["sequences"], base["block_size"])["tau"]

    def tau_at(ids: list[int]) -> float | None:
        log(f"score: layer-offset check at target layers {ids}")
        scores = scorer.score(drafter, ids)
        return rep.summarize(scores["sequences"], scores["block_size"])["tau"]

    return diag.layer_offset_check(
        tau_at, captured, layer_ids, base_tau, tolerance=opts.layer_offset_tolerance
    )


def _server_drafter_name(opts: Options) -> str:
    """The name under which the server's drafter was scored: a drafter's name, or reference."""
    if opts.server_drafter == "drafter":
        return opts.names[0]
    return opts.server_drafter


def run(request: dict[str, Any]) -> dict[str, Any]:
    started = time.monotonic()
    opts = parse_request(request)
    cpu_bounds.apply_threads(opts.cpu_bounds)
    remove_stale_temporaries(opts.out_dir)
    inputs = inputs_of(opts)
    inputs_fingerprint = fingerprint(inputs)
    if not opts.force and is_up_to_date(opts.out_dir, inputs_fingerprint):
        log(f"score: {opts.out_dir} is up to date, nothing to do")
        report = json.loads((opts.out_dir / REPORT_JSON).read_text())
        return key_figures(report, opts.out_dir, changed=False)
    reused = report_reuse.reusable(opts, inputs)
    if reused is not None:
        return report_reuse.refresh(opts, inputs, inputs_fingerprint, reused, started)

    hidden_manifest = load_manifest(opts.hidden_states) or {}
    captured = list(hidden_manifest.get("layer_ids") or [])
    target_config = read_json(opts.target / "config.json") or {}
    names = opts.names
    label = {name: "drafter" if len(names) == 1 else f"drafter {name}" for name in names}
    configs = {
        name: checked_config(path, label[name], opts.target, target_config, captured)
        for name, path in zip(names, opts.drafter, strict=True)
    }
    reference_config, reference_ids = None, None
    if opts.reference_drafter:
        reference_config, reference_ids = checked_config(
            opts.reference_drafter, "reference drafter", opts.target, target_config, captured
        )
    online = online_acceptance(opts.completions)
    device = str(resolve_device(opts.device))
    limit_gpu_memory(device, opts.gpu_memory_gib)
    scored_paths = [*opts.drafter, *([opts.reference_drafter] if opts.reference_drafter else [])]
    in_window = (opts.placement or {}).get("where") == "window"
    dtype = resolve_dtype(opts.dtype, device, opts.target, scored_paths, in_window=in_window)
    server_name = _server_drafter_name(opts)

    log(f"score: loading the target head from {opts.target} on {device} ({dtype})")
    reports = []
    try:
        scorer = Scorer(opts, device, dtype)
        reference_model, reference_scores = None, None
        server_check: tuple[dict | None, dict | None] | None = None
        if opts.reference_drafter and reference_ids is not None:  # both set together above
            log(f"score: scoring the reference {opts.reference_drafter} at target layers {reference_ids}")
            reference_model = scorer.load(opts.reference_drafter)
            reference_scores = scorer.score(reference_model, reference_ids)
        for name, path in zip(names, opts.drafter, strict=True):
            config, layer_ids = configs[name]
            drafter = scorer.load(path)
            log(f"score: scoring {name} ({path}) at target layers {layer_ids}")
            scores = scorer.score(drafter, layer_ids)
            if not scores["sequences"]:
                raise StageError(
                    f"the hidden states in {opts.hidden_states} hold no sequence: rerun extract_hidden_states"
                )
            findings = []
            if "layer_offset" in opts.diagnostics:
                findings.append(_layer_offset(scorer, drafter, opts, captured, layer_ids, scores))
            comparison, margins = None, None
            if server_name == name:
                comparison, margins = _online_check(scorer, online, opts, drafter, scores, layer_ids)
            # parse_request refuses server_drafter 'reference' without a reference drafter.
            elif server_name == "reference" and reference_scores is not None and reference_ids is not None:
                if server_check is None:  # the reference's check is the same for every drafter
                    server_check = _online_check(
                        scorer, online, opts, reference_model, reference_scores, reference_ids
                    )
                comparison, margins = server_check
            run_info = {
                "target": str(opts.target),
                "drafter": str(path),
                "reference_drafter": str(opts.reference_drafter) if opts.reference_drafter else None,
                "hidden_states": str(opts.hidden_states),
                "completions": str(opts.completions) if opts.completions else None,
                "server_drafter": opts.server_drafter or None,
                "hidden_state_backend": hidden_manifest.get("backend") or {},
                "target_layer_ids": layer_ids,
                "reference_target_layer_ids": reference_ids,
                "device": device,
                "dtype": dtype,
                "versions": versions(),
            }
            report = rep.build_report(
                run_info,
                scores,
                reference_scores,
                online,
                [],
                comparison,
                name=name,
                detectable=opts.detectable_difference,
            )
            findings += _config_findings(opts, config, hidden_manifest, target_config, report)
            if server_name in (name, "reference"):
                findings.append(diag.online_agreement_check(comparison, opts.server_drafter, margins=margins))
            if "acceptance" in opts.diagnostics:
                findings.insert(
                    0,
                    diag.acceptance_pattern_check(
                        report["overall"], report["reference"], report["per_prompt"]
                    ),
                )
            report = rep.build_report(
                run_info,
                scores,
                reference_scores,
                online,
                findings,
                comparison,
                name=name,
                detectable=opts.detectable_difference,
            )
            reports.append(report)
            del drafter
        del scorer, reference_model
    except model_errors() as error:
        raise StageError(str(error)) from error
    finished_file = (opts.placement or {}).get("finished_file")
    if finished_file:
        _say_scored(finished_file, device)

    placed = where.record(opts.placement, time.monotonic() - started, cpu_bounds.observed())
    return write_outputs(opts, inputs, inputs_fingerprint, reports, placement=placed)


def _say_scored(path: str, device: str) -> None:
    """Scoring inside a window: every score is computed and no model is held any more. Give the device its
    memory back and say "finished" in the file the window's guard watches (placement.finished_file), so
    the service resumes while the reports and plots are still being written, as it does at an
    extraction's end (extract/start_signal.py). Where the device keeps memory, nothing is said: the play
    resumes the service after the stage, as without the file."""
    import torch

    reserved = devices.release_device(torch.device(device))
    if reserved > devices.MAX_RESERVED_WHEN_FINISHED:
        log(f"score: the device still holds {reserved >> 20} MiB: the service resumes after the stage")
        return
    atomic_write_json(
        Path(path), {"state": FINISHED, "pid": os.getpid(), "at": time.time(), "reserved": reserved}
    )
    log("score: scores computed and the device's memory given back: the service may resume")


def _online_check(
    scorer: Scorer,
    online: Mapping[str, Any],
    opts: Options,
    model,
    scores: Mapping[str, Any],
    layer_ids: list[int],
) -> tuple[dict | None, dict | None]:
    """SGLang's online figures against the server drafter's offline walk, with the logit margins of the
    prompts that differ (to tell a near-tie from a configuration error)."""
    comparison = rep.online_comparison(online, scores, opts.server_drafter)
    if not comparison or not comparison["mismatched"]:
        return comparison, None
    log(
        f"score: measuring the logit margins of {len(comparison['mismatched'])} prompts whose online and "
        "offline tau differ"
    )
    differing = [row["id"] for row in comparison["mismatched"]]
    return comparison, scorer.margins(model, layer_ids, scores, differing)


def _config_findings(
    opts: Options,
    config: Mapping[str, Any],
    hidden_manifest: Mapping[str, Any],
    target_config: Mapping[str, Any],
    report: Mapping[str, Any],
) -> list[dict[str, Any]]:
    findings = []
    if "backend" in opts.diagnostics:
        findings.append(
            diag.backend_check(
                hidden_manifest,
                target_config,
                reference_tau=(report.get("reference") or {}).get("tau"),
                drafter_tau=report["overall"]["tau"],
            )
        )
    if "vocabulary" in opts.diagnostics:
        findings.append(diag.vocabulary_check(config, opts.target))
    return findings


def main() -> int:
    return serve(STAGE, plan, run)
