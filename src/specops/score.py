"""Score a DFlash drafter offline on extracted hidden states: `python -m specops.score --plan|--run`.

Request (JSON on stdin, docs/architecture.md):
  hidden_states      extraction output directory (manifest.json + shards)            required
  target             target model directory (embed_tokens, lm_head, tokenizer)        required
  drafter            drafter checkpoint directory (config.json + safetensors)         required
  out_dir            where report.json, report.md, the PNGs and manifest.json go       required
  completions        completions directory; its SGLang spec_accept_length is shown     optional
  reference_drafter  a drafter to compare with (tau ratio)                             optional
  server_drafter     which of them the SGLang server speculated with when it made the
                     completions: drafter | reference | "" (unknown); when known, the
                     online_agreement diagnostic compares SGLang's online tau with that
                     drafter's offline tau (report.online_from_offline)                default ""
  device             auto | cpu | cuda | cuda:N (auto: cuda when available)           default auto
  gpu_memory_gib     on a GPU, the most memory scoring may take; it fails at start when the
                     GPU has less free (the restarted server holds the rest); 0: no limit  default 0
  dtype              float32 | bfloat16 | float16                                      default bfloat16
  diagnostics        any of layer_offset, backend, vocabulary                          default all
  layer_offset_tolerance  a shifted layer choice warns when its tau exceeds the configured
                     layers' tau by more than this fraction                            default 0.10
  force              rescore even if the manifest says the report is up to date         default false

The inputs fingerprint covers the hidden-state and completions manifests, the drafters' files,
the target's small files and the options; plan mode decides from it without loading a model.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specops import diagnostics as diag
from specops import report as rep
from specops import window as win
from specops.manifest import (
    atomic_write_json,
    atomic_write_text,
    file_identity,
    fingerprint,
    is_up_to_date,
    load_manifest,
    remove_stale_temporaries,
    write_manifest,
)
from specops.stage import StageError, log, serve

STAGE = "score"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
OUTPUT_FILES = (REPORT_JSON, REPORT_MD, *rep.PLOT_FILES)
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# The target's files that identify it cheaply; its weights are tens of GB and the hidden-state
# manifest already fingerprints the model they came from.
TARGET_IDENTITY_FILES = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json",
)


@dataclass(frozen=True)
class Options:
    hidden_states: Path
    target: Path
    drafter: Path
    out_dir: Path
    completions: Path | None = None
    reference_drafter: Path | None = None
    server_drafter: str = ""
    device: str = "auto"
    gpu_memory_gib: float = 0.0
    dtype: str = "bfloat16"
    diagnostics: tuple[str, ...] = diag.DIAGNOSTICS
    layer_offset_tolerance: float = diag.DEFAULT_LAYER_OFFSET_TOLERANCE
    force: bool = False


def _directory(request: Mapping[str, Any], key: str, required: bool,
               must_hold: str | None = None) -> Path | None:
    value = request.get(key)
    if not value:
        if required:
            raise StageError(f"'{key}' is required: the path of the {key.replace('_', ' ')} directory")
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise StageError(f"{key} {path} is not a directory: check the path")
    if must_hold and not (path / must_hold).is_file():
        fix = {"manifest.json": "run the stage that makes it first (it writes manifest.json last)",
               "config.json": "point it at a checkpoint directory (config.json + safetensors)"}[must_hold]
        raise StageError(f"{key} {path} has no {must_hold}: {fix}")
    return path


def parse_request(request: Mapping[str, Any]) -> Options:
    unknown = set(request) - set(Options.__dataclass_fields__)
    if unknown:
        raise StageError(f"unknown request keys {sorted(unknown)}: allowed are "
                         f"{sorted(Options.__dataclass_fields__)}")
    if not request.get("out_dir"):
        raise StageError("'out_dir' is required: the directory the report is written to")
    device = request.get("device") or "auto"
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise StageError(f"device {device!r} is not one of {', '.join(DEVICES)} (or cuda:N)")
    dtype = request.get("dtype") or "bfloat16"
    if dtype not in DTYPES:
        raise StageError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    checks = request.get("diagnostics")
    checks = tuple(diag.DIAGNOSTICS if checks is None else checks)
    bad = [c for c in checks if c not in diag.DIAGNOSTICS]
    if bad:
        raise StageError(f"unknown diagnostics {bad}: choose from {', '.join(diag.DIAGNOSTICS)}")
    server_drafter = request.get("server_drafter") or ""
    if server_drafter not in rep.SERVER_DRAFTERS:
        raise StageError(f"server_drafter {server_drafter!r} is not one of 'drafter', 'reference' or '' "
                         "(unknown): name the drafter the SGLang server speculated with")
    if server_drafter == "reference" and not request.get("reference_drafter"):
        raise StageError("server_drafter is 'reference' but no reference_drafter is given: pass the "
                         "reference drafter's directory, or the drafter the server really ran")
    gpu_memory_gib = float(request.get("gpu_memory_gib") or 0.0)
    if gpu_memory_gib < 0:
        raise StageError(f"gpu_memory_gib {gpu_memory_gib} is negative: give the GiB scoring may use, or 0")
    tolerance = float(request.get("layer_offset_tolerance", diag.DEFAULT_LAYER_OFFSET_TOLERANCE))
    if tolerance < 0:
        raise StageError(f"layer_offset_tolerance {tolerance} is negative: use a fraction such as 0.1")
    return Options(
        hidden_states=_directory(request, "hidden_states", True, "manifest.json"),
        target=_directory(request, "target", True, "config.json"),
        drafter=_directory(request, "drafter", True, "config.json"),
        out_dir=Path(request["out_dir"]).expanduser(),
        completions=_directory(request, "completions", False, "manifest.json"),
        reference_drafter=_directory(request, "reference_drafter", False, "config.json"),
        server_drafter=server_drafter,
        device=device,
        gpu_memory_gib=gpu_memory_gib,
        dtype=dtype,
        diagnostics=checks,
        layer_offset_tolerance=tolerance,
        force=bool(request.get("force", False)),
    )


def _stage_output_identity(directory: Path) -> dict[str, Any]:
    """A stage output is identified by its manifest: what it was made from and the files it holds."""
    manifest = load_manifest(directory) or {}
    return {"inputs_fingerprint": manifest.get("inputs_fingerprint"), "files": manifest.get("files")}


def _checkpoint_identity(directory: Path) -> dict[str, Any]:
    files = sorted(p for p in directory.iterdir() if p.suffix in (".json", ".safetensors") and p.is_file())
    return {p.name: file_identity(p)["sha256"] for p in files}


def inputs_of(opts: Options) -> dict[str, Any]:
    """Everything the report depends on; reading it loads no model."""
    return {
        "hidden_states": _stage_output_identity(opts.hidden_states),
        "completions": _stage_output_identity(opts.completions) if opts.completions else None,
        "target": {name: file_identity(opts.target / name)["sha256"]
                   for name in TARGET_IDENTITY_FILES if (opts.target / name).is_file()},
        "drafter": _checkpoint_identity(opts.drafter),
        "reference_drafter": _checkpoint_identity(opts.reference_drafter) if opts.reference_drafter else None,
        "window": win.read_window(opts.hidden_states),
        "options": {"device": opts.device, "dtype": opts.dtype, "diagnostics": sorted(opts.diagnostics),
                    "layer_offset_tolerance": opts.layer_offset_tolerance,
                    "server_drafter": opts.server_drafter},
    }


def key_figures(report: Mapping[str, Any], out_dir: Path, changed: bool) -> dict[str, Any]:
    """The stage result: what set_stats publishes, and where the report is."""
    return {
        "changed": changed,
        "tau": report["overall"]["tau"],
        "reference_tau": (report.get("reference") or {}).get("tau"),
        "ratio": report.get("ratio"),
        "online_tau": (report.get("online") or {}).get("tau"),
        "n_prompts": len(report["per_prompt"]),
        "steps": report["overall"]["steps"],
        "verdict": rep.verdict(report),
        "warnings": report["warnings"],
        "out_dir": str(out_dir),
        "report_json": str(out_dir / REPORT_JSON),
        "report_md": str(out_dir / REPORT_MD),
        "plots": [str(out_dir / name) for name in rep.PLOT_FILES],
    }


def plan(request: dict[str, Any]) -> dict[str, Any]:
    opts = parse_request(request)
    inputs = inputs_of(opts)
    if not opts.force and is_up_to_date(opts.out_dir, fingerprint(inputs)):
        report = json.loads((opts.out_dir / REPORT_JSON).read_text())
        return {**key_figures(report, opts.out_dir, changed=False), "msg": "the report is up to date"}
    return {"changed": True, "out_dir": str(opts.out_dir),
            "msg": f"would score {opts.drafter}"
                   + (f" against {opts.reference_drafter}" if opts.reference_drafter else "")
                   + f" on {opts.hidden_states} and write {', '.join(OUTPUT_FILES)} to {opts.out_dir}"}


# ----------------------------------------------------------------------------------------------
# Inputs that are plain files: completions (online tau) and configs
# ----------------------------------------------------------------------------------------------

def online_acceptance(completions_dir: Path | None) -> dict[str, dict[str, Any]]:
    """Per completion id, SGLang's own figures when the server ran speculative decoding."""
    if completions_dir is None:
        return {}
    path = completions_dir / "completions.jsonl"
    if not path.is_file():
        raise StageError(f"{path} does not exist: the completions directory must hold completions.jsonl")
    online = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise StageError(f"{path} line {number} is not JSON ({error}): rerun sglang_completions") \
                from error
        meta = record.get("meta_info") or {}
        verify_ct = meta.get("spec_verify_ct")
        if verify_ct:
            tokens = meta.get("completion_tokens", len(record.get("output_ids") or []))
            online[str(record["id"])] = {
                "tau": meta.get("spec_accept_length", tokens / verify_ct),
                "verify_ct": verify_ct,
                "completion_tokens": tokens,
            }
    return online


def drafter_layer_ids(config: Mapping[str, Any], name: str) -> list[int]:
    ids = (config.get("dflash_config") or {}).get("target_layer_ids") or config.get("target_layer_ids")
    if not ids:
        raise StageError(f"the {name}'s config.json has no dflash_config.target_layer_ids: set the target "
                         "layers it was trained on")
    return list(ids)


def require_layers(needed: list[int], captured: list[int], name: str, target_layers: int | None) -> None:
    if target_layers is not None:
        out = [k for k in needed if not 0 <= k < target_layers]
        if out:
            raise StageError(f"the {name}'s target layer {out[0]} is out of range: the target has "
                             f"{target_layers} layers (0-{target_layers - 1}); the {name} was built for "
                             "another target")
    absent = [k for k in needed if k not in captured]
    if absent:
        raise StageError(f"the hidden states hold layers {captured} but the {name} needs {needed} "
                         f"(missing {absent}): rerun extract_hidden_states with these target layer ids")


# ----------------------------------------------------------------------------------------------
# The engine: models, hidden states, acceptance
# ----------------------------------------------------------------------------------------------

def versions() -> dict[str, str]:
    found = {}
    for name in ("specops", "torch", "transformers", "fla-core", "flash-linear-attention", "safetensors"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    from specops import __version__

    found["specops"] = __version__
    return found


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise StageError(f"device {device} was asked for but torch sees no CUDA GPU: use device cpu or auto")
    return device


def limit_gpu_memory(device: str, gib: float) -> None:
    """Keep scoring within `gib` on its GPU, and refuse to start where that much is not free."""
    if not gib or not device.startswith("cuda"):
        return
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    if free < gib * 2**30:
        raise StageError(f"{device} has {free / 2**30:.1f} GiB free, less than gpu_memory_gib {gib}: the "
                         "server holds the rest; lower gpu_memory_gib, choose another GPU, or score on cpu")
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), torch.device(device))


class Scorer:
    """Holds the target head and the hidden states; scores any drafter at any captured layer ids."""

    # Sequences handed to the engine at once: bounds host memory for the features of long runs.
    CHUNK = 32

    def __init__(self, opts: Options, device: str):
        import torch

        from specops.hidden_states import open_hidden_states
        from specops.target_head import load_target_head

        self.device = device
        self.dtype = getattr(torch, opts.dtype)
        self.hidden = open_hidden_states(opts.hidden_states)
        self.head = load_target_head(opts.target, device=device, dtype=self.dtype)

    def load(self, path: Path):
        from specops.drafter import load_drafter

        return load_drafter(path, device=self.device, dtype=self.dtype)

    def sequences(self, layer_ids: list[int]):
        selected = self.hidden.select_layers(layer_ids)
        for meta, input_ids, features in selected:
            yield {"id": str(meta["id"]), "input_ids": input_ids, "features": features,
                   "prompt_len": int(meta["prompt_tokens"])}

    def score(self, drafter, layer_ids: list[int]) -> dict[str, Any]:
        """{"block_size", "sequences": [{"id", "accept_lengths"}]} for one drafter and layer choice."""
        from specops.acceptance import offline_acceptance

        scored: list[dict[str, Any]] = []
        chunk: list[dict[str, Any]] = []
        total = len(self.hidden)

        def flush() -> None:
            for result in offline_acceptance(drafter, self.head, chunk):
                scored.append({"id": result.id, "accept_lengths": list(result.accept_lengths)})
            log(f"score: {len(scored)}/{total} sequences")
            chunk.clear()

        for sequence in self.sequences(layer_ids):
            chunk.append(sequence)
            if len(chunk) == self.CHUNK:
                flush()
        if chunk:
            flush()
        return {"block_size": drafter.block_size, "sequences": scored}


def model_errors() -> tuple[type[Exception], ...]:
    """The engine's errors that name a fix; anything else is a crash with a traceback."""
    from specops.drafter import DrafterError
    from specops.hidden_states import HiddenStatesError
    from specops.target_head import TargetHeadError

    return DrafterError, HiddenStatesError, TargetHeadError


def score_all(opts: Options, device: str, captured: list[int], layer_ids: list[int],
              reference_ids: list[int] | None) -> tuple[dict, dict | None, dict | None]:
    """Drafter scores, reference scores and the layer-offset finding (None when not asked for)."""
    log(f"score: loading the target head from {opts.target} on {device} ({opts.dtype})")
    scorer = Scorer(opts, device)
    drafter = scorer.load(opts.drafter)
    log(f"score: scoring {opts.drafter} at target layers {layer_ids}")
    drafter_scores = scorer.score(drafter, layer_ids)
    if not drafter_scores["sequences"]:
        raise StageError(f"the hidden states in {opts.hidden_states} hold no sequence: "
                         "rerun extract_hidden_states")
    reference_scores = None
    if opts.reference_drafter:
        log(f"score: scoring the reference {opts.reference_drafter} at target layers {reference_ids}")
        reference_scores = scorer.score(scorer.load(opts.reference_drafter), reference_ids)
    if "layer_offset" not in opts.diagnostics:
        return drafter_scores, reference_scores, None
    base_tau = rep.summarize(drafter_scores["sequences"], drafter_scores["block_size"])["tau"]

    def tau_at(ids: list[int]) -> float | None:
        log(f"score: layer-offset check at target layers {ids}")
        scores = scorer.score(drafter, ids)
        return rep.summarize(scores["sequences"], scores["block_size"])["tau"]

    offset_finding = diag.layer_offset_check(tau_at, captured, layer_ids, base_tau,
                                             tolerance=opts.layer_offset_tolerance)
    return drafter_scores, reference_scores, offset_finding


def run(request: dict[str, Any]) -> dict[str, Any]:
    opts = parse_request(request)
    remove_stale_temporaries(opts.out_dir)
    inputs = inputs_of(opts)
    if not opts.force and is_up_to_date(opts.out_dir, fingerprint(inputs)):
        log(f"score: {opts.out_dir} is up to date, nothing to do")
        report = json.loads((opts.out_dir / REPORT_JSON).read_text())
        return key_figures(report, opts.out_dir, changed=False)

    hidden_manifest = load_manifest(opts.hidden_states) or {}
    captured = list(hidden_manifest.get("layer_ids") or [])
    target_config = diag.read_json(opts.target / "config.json") or {}
    target_layers = diag.text_config(target_config).get("num_hidden_layers")
    drafter_config = diag.read_json(opts.drafter / "config.json") or {}
    layer_ids = drafter_layer_ids(drafter_config, "drafter")
    require_layers(layer_ids, captured, "drafter", target_layers)
    reference_config = None
    if opts.reference_drafter:
        reference_config = diag.read_json(opts.reference_drafter / "config.json")
    reference_ids = drafter_layer_ids(reference_config, "reference drafter") if reference_config else None
    if reference_ids:
        require_layers(reference_ids, captured, "reference drafter", target_layers)

    target_hidden = diag.text_config(target_config).get("hidden_size")
    for name, config in (("drafter", drafter_config), ("reference drafter", reference_config)):
        if config and target_hidden and config.get("hidden_size") != target_hidden:
            raise StageError(f"the {name}'s hidden_size {config.get('hidden_size')} differs from the "
                             f"target's {target_hidden}: the {name} was built for another target")

    # Config-level checks run before any model loads: a bad mask id would only crash the engine.
    findings = []
    vocabulary = diag.vocabulary_check(drafter_config, opts.target)
    error = diag.mask_token_error(vocabulary)
    if error:
        raise StageError(error)
    if reference_config:
        ref_error = diag.mask_token_error(diag.vocabulary_check(reference_config, opts.target))
        if ref_error:
            raise StageError(ref_error.replace("the drafter's", "the reference drafter's"))
    if "backend" in opts.diagnostics:
        findings.append(diag.backend_check(hidden_manifest, target_config))
    if "vocabulary" in opts.diagnostics:
        findings.append(vocabulary)
    online = online_acceptance(opts.completions)

    device = resolve_device(opts.device)
    limit_gpu_memory(device, opts.gpu_memory_gib)
    try:
        drafter_scores, reference_scores, offset_finding = score_all(
            opts, device, captured, layer_ids, reference_ids)
    except model_errors() as error:
        raise StageError(str(error)) from error
    if offset_finding:
        findings.insert(0, offset_finding)
    server_scores = {"drafter": drafter_scores, "reference": reference_scores}.get(opts.server_drafter)
    comparison = rep.online_comparison(online, server_scores, opts.server_drafter)
    if opts.server_drafter:
        findings.append(diag.online_agreement_check(comparison, opts.server_drafter))

    run_info = {
        "target": str(opts.target),
        "drafter": str(opts.drafter),
        "reference_drafter": str(opts.reference_drafter) if opts.reference_drafter else None,
        "hidden_states": str(opts.hidden_states),
        "completions": str(opts.completions) if opts.completions else None,
        "server_drafter": opts.server_drafter or None,
        "hidden_state_backend": hidden_manifest.get("backend") or {},
        "target_layer_ids": layer_ids,
        "reference_target_layer_ids": reference_ids,
        "device": device,
        "dtype": opts.dtype,
        "versions": versions(),
    }
    report = rep.build_report(run_info, drafter_scores, reference_scores, online, findings, comparison)
    report["window"] = win.read_window(opts.hidden_states)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    rep.render_plots(report, opts.out_dir)
    markdown = rep.render_markdown(report) + win.render_markdown(report["window"])
    atomic_write_text(opts.out_dir / REPORT_MD, markdown)
    atomic_write_json(opts.out_dir / REPORT_JSON, report)
    figures = {"tau": report["overall"]["tau"], "reference_tau": (report.get("reference") or {}).get("tau"),
               "ratio": report.get("ratio")}
    write_manifest(opts.out_dir, STAGE, inputs, list(OUTPUT_FILES), figures=figures)
    log(f"score: {rep.verdict(report)}; report in {opts.out_dir / REPORT_MD}")
    return key_figures(report, opts.out_dir, changed=True)


def main() -> int:
    return serve(STAGE, plan, run)


if __name__ == "__main__":
    raise SystemExit(main())
