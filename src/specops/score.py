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
                     and on a GPU where the head and drafters fit in float32)          default auto
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
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

from specops import diagnostics as diag
from specops import history as hist
from specops import report as rep
from specops import speedup as spd
from specops import stats
from specops import window as win
from specops.devices import resolve_device
from specops.dflash_config import DrafterError, target_layer_ids
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
from specops.schema import Option, Schema
from specops.score_result import REPORT_JSON, REPORT_MD, key_figures
from specops.stage import StageError, log, serve
from specops.versions import installed_versions

STAGE = "score"
DRAFTERS_DIR = "drafters"
DTYPES = ("auto", "float32", "bfloat16", "float16")
# dtype auto keeps float32 on a GPU while the head and drafters take at most this share of free memory.
FLOAT32_MEMORY_SHARE = 0.25
DEVICES = ("auto", "cpu", "cuda")
REQUEST = Schema(
    STAGE,
    (
        Option(
            "hidden_states",
            "path",
            "The extract_hidden_states output directory (manifest.json, shards).",
            required=True,
        ),
        Option("completions", "path", "The sglang_completions output directory, for SGLang's online tau."),
        Option(
            "target", "path", "The target model directory (embed_tokens, lm_head, tokenizer).", required=True
        ),
        Option(
            "drafter",
            "list",
            "The drafter checkpoint directory, or a list of them.",
            required=True,
            elements="path",
        ),
        Option("reference_drafter", "path", "A drafter to compare with, scored on the same hidden states."),
        Option(
            "server_drafter",
            "str",
            "Which drafter the SGLang server speculated with: drafter, a drafter's "
            "name, reference, or '' when unknown.",
            default="",
        ),
        Option("out_dir", "path", "Directory the report is written to.", required=True),
        # The server is back on the GPUs when scoring runs: a GPU only when asked.
        Option(
            "device",
            "str",
            "Where to score: cpu, cuda, cuda:N, or auto (a CUDA GPU when torch sees one).",
            default="cpu",
        ),
        Option(
            "gpu_memory_gib",
            "float",
            "On a GPU, the most memory scoring may allocate; 0 sets no limit.",
            default=0.0,
        ),
        Option(
            "dtype", "str", "Precision of the drafter and the target head.", default="auto", choices=DTYPES
        ),
        Option(
            "diagnostics",
            "list",
            "Which diagnostics to run.",
            default=list(diag.DIAGNOSTICS),
            choices=diag.DIAGNOSTICS,
            elements="str",
        ),
        Option(
            "layer_offset_tolerance",
            "float",
            "A layer shift warns when its tau beats the configured layers' by more than this fraction.",
            default=diag.DEFAULT_LAYER_OFFSET_TOLERANCE,
        ),
        Option(
            "detectable_difference",
            "float",
            "The difference in tau the report says how many prompts a paired comparison needs to resolve.",
            default=stats.DETECTABLE_DIFFERENCE,
        ),
        Option(
            "step_costs",
            "dict",
            "Measured draft_cost and verify_cost in target decode steps; empty to estimate them.",
        ),
        Option("history", "path", "Directory of past runs (index.jsonl and one directory per run)."),
        Option("force", "bool", "Score again even when the report is up to date.", default=False),
    ),
)
# The target's files that identify it cheaply; its weights are tens of GB and the hidden-state
# manifest already fingerprints the model they came from.
TARGET_IDENTITY_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors.index.json",
)


@dataclass(frozen=True)
class Options:
    hidden_states: Path
    target: Path
    drafter: tuple[Path, ...]
    out_dir: Path
    completions: Path | None = None
    reference_drafter: Path | None = None
    server_drafter: str = REQUEST.option("server_drafter").default
    device: str = REQUEST.option("device").default
    gpu_memory_gib: float = REQUEST.option("gpu_memory_gib").default
    dtype: str = REQUEST.option("dtype").default
    diagnostics: tuple[str, ...] = diag.DIAGNOSTICS
    layer_offset_tolerance: float = REQUEST.option("layer_offset_tolerance").default
    detectable_difference: float = REQUEST.option("detectable_difference").default
    step_costs: tuple[tuple[str, float], ...] = ()
    history: Path | None = None
    force: bool = REQUEST.option("force").default

    @property
    def names(self) -> list[str]:
        return drafter_names(self.drafter)


def drafter_names(paths: Sequence[Path]) -> list[str]:
    """Each drafter's directory name, made unique (checkpoints often share a last component)."""
    names: list[str] = []
    for path in paths:
        base = path.name or "drafter"
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}-{n}"
        names.append(name)
    return names


def _drafter_list(request: Mapping[str, Any]) -> tuple[Path, ...]:
    value = request.get("drafter")
    values = value if isinstance(value, list | tuple) else [value] if value else []
    if not values:
        raise StageError("'drafter' is required: the drafter checkpoint directory, or a list of them")
    paths = []
    for item in values:
        path = _directory({"drafter": item}, "drafter", True, "config.json")
        assert path is not None
        paths.append(path)
    return tuple(paths)


def _step_costs(value: Any) -> tuple[tuple[str, float], ...]:
    if not value:
        return ()
    if not isinstance(value, Mapping) or set(value) != {"draft_cost", "verify_cost"}:
        raise StageError(
            f"step_costs {value!r} must be a mapping with draft_cost and verify_cost (in target "
            "decode steps, as benchmarks/speedup_h200.py measures them), or empty"
        )
    costs = {k: float(v) for k, v in value.items()}
    if costs["draft_cost"] < 0 or costs["verify_cost"] <= 0:
        raise StageError(f"step_costs {costs} must be positive: draft_cost >= 0, verify_cost > 0")
    return tuple(sorted(costs.items()))


@overload
def _directory(
    request: Mapping[str, Any], key: str, required: Literal[True], must_hold: str | None = None
) -> Path: ...
@overload
def _directory(
    request: Mapping[str, Any], key: str, required: bool, must_hold: str | None = None
) -> Path | None: ...
def _directory(
    request: Mapping[str, Any], key: str, required: bool, must_hold: str | None = None
) -> Path | None:
    value = request.get(key)
    if not value:
        if required:
            raise StageError(f"'{key}' is required: the path of the {key.replace('_', ' ')} directory")
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise StageError(f"{key} {path} is not a directory: check the path")
    if must_hold and not (path / must_hold).is_file():
        fix = {
            "manifest.json": "run the stage that makes it first (it writes manifest.json last)",
            "config.json": "point it at a checkpoint directory (config.json + safetensors)",
        }[must_hold]
        raise StageError(f"{key} {path} has no {must_hold}: {fix}")
    return path


def parse_request(request: Mapping[str, Any]) -> Options:
    unknown = REQUEST.unknown(request)
    if unknown:
        raise StageError(f"unknown request keys {unknown}: allowed are {sorted(REQUEST.names)}")
    if not request.get("out_dir"):
        raise StageError("'out_dir' is required: the directory the report is written to")
    device = request.get("device") or REQUEST.option("device").default
    if device not in DEVICES and not re.fullmatch(r"cuda:[0-9]+", str(device)):
        raise StageError(f"device {device!r} is not one of {', '.join(DEVICES)} (or cuda:N)")
    dtype = request.get("dtype") or "auto"
    if dtype not in DTYPES:
        raise StageError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    checks = request.get("diagnostics")
    checks = tuple(diag.DIAGNOSTICS if checks is None else checks)
    bad = [c for c in checks if c not in diag.DIAGNOSTICS]
    if bad:
        raise StageError(f"unknown diagnostics {bad}: choose from {', '.join(diag.DIAGNOSTICS)}")
    hidden_states = _directory(request, "hidden_states", True, "manifest.json")
    target = _directory(request, "target", True, "config.json")
    drafters = _drafter_list(request)
    server_drafter = request.get("server_drafter") or ""
    if server_drafter not in (*rep.SERVER_DRAFTERS, *drafter_names(drafters)):
        raise StageError(
            f"server_drafter {server_drafter!r} is not one of 'drafter', 'reference', a "
            f"drafter's name ({', '.join(drafter_names(drafters))}) or '' (unknown): name the "
            "drafter the SGLang server speculated with"
        )
    if server_drafter == "reference" and not request.get("reference_drafter"):
        raise StageError(
            "server_drafter is 'reference' but no reference_drafter is given: pass the "
            "reference drafter's directory, or the drafter the server really ran"
        )
    gpu_memory_gib = float(request.get("gpu_memory_gib") or 0.0)
    if gpu_memory_gib < 0:
        raise StageError(f"gpu_memory_gib {gpu_memory_gib} is negative: give the GiB scoring may use, or 0")
    tolerance = float(request.get("layer_offset_tolerance", diag.DEFAULT_LAYER_OFFSET_TOLERANCE))
    if tolerance < 0:
        raise StageError(f"layer_offset_tolerance {tolerance} is negative: use a fraction such as 0.1")
    detectable = float(request.get("detectable_difference", stats.DETECTABLE_DIFFERENCE))
    if detectable <= 0:
        raise StageError(
            f"detectable_difference {detectable} must be positive: a difference in tau such as 0.1"
        )
    return Options(
        hidden_states=hidden_states,
        target=target,
        drafter=drafters,
        out_dir=Path(request["out_dir"]).expanduser(),
        completions=_directory(request, "completions", False, "manifest.json"),
        reference_drafter=_directory(request, "reference_drafter", False, "config.json"),
        server_drafter=server_drafter,
        device=device,
        gpu_memory_gib=gpu_memory_gib,
        dtype=dtype,
        diagnostics=checks,
        layer_offset_tolerance=tolerance,
        detectable_difference=detectable,
        step_costs=_step_costs(request.get("step_costs")),
        history=Path(request["history"]).expanduser() if request.get("history") else None,
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
        "target": {
            name: file_identity(opts.target / name)["sha256"]
            for name in TARGET_IDENTITY_FILES
            if (opts.target / name).is_file()
        },
        "drafter": [_checkpoint_identity(path) for path in opts.drafter],
        "reference_drafter": _checkpoint_identity(opts.reference_drafter) if opts.reference_drafter else None,
        "window": win.read_window(opts.hidden_states),
        "options": {
            "device": opts.device,
            "dtype": opts.dtype,
            "diagnostics": sorted(opts.diagnostics),
            "layer_offset_tolerance": opts.layer_offset_tolerance,
            "detectable_difference": opts.detectable_difference,
            "server_drafter": opts.server_drafter,
            "step_costs": dict(opts.step_costs),
            "history": str(opts.history) if opts.history else None,
        },
    }


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
            raise StageError(
                f"{path} line {number} is not JSON ({error}): rerun sglang_completions"
            ) from error
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
    try:
        return target_layer_ids(config, f"the {name}'s config.json")
    except DrafterError as error:
        raise StageError(str(error)) from None


def require_layers(needed: list[int], captured: list[int], name: str, target_layers: int | None) -> None:
    if target_layers is not None:
        out = [k for k in needed if not 0 <= k < target_layers]
        if out:
            raise StageError(
                f"the {name}'s target layer {out[0]} is out of range: the target has "
                f"{target_layers} layers (0-{target_layers - 1}); the {name} was built for "
                "another target"
            )
    absent = [k for k in needed if k not in captured]
    if absent:
        raise StageError(
            f"the hidden states hold layers {captured} but the {name} needs {needed} "
            f"(missing {absent}): rerun extract_hidden_states with these target layer ids"
        )


# ----------------------------------------------------------------------------------------------
# The engine: models, hidden states, acceptance
# ----------------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    from specops import __version__

    libraries = ("torch", "transformers", "fla-core", "flash-linear-attention", "safetensors")
    found = {name: version for name, version in installed_versions(libraries).items() if version}
    return {"specops": __version__, **found}


def limit_gpu_memory(device: str, gib: float) -> None:
    """Keep scoring within `gib` on its GPU, and refuse to start where that much is not free."""
    if not gib or not device.startswith("cuda"):
        return
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    if free < gib * 2**30:
        raise StageError(
            f"{device} has {free / 2**30:.1f} GiB free, less than gpu_memory_gib {gib}: the "
            "server holds the rest; lower gpu_memory_gib, choose another GPU, or score on cpu"
        )
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), torch.device(device))


def resolve_dtype(dtype: str, device: str, target: Path, drafters: Sequence[Path]) -> str:
    """auto: float32 (exact argmax ties, no bf16 drift) on the CPU, and on a GPU where it fits."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    head = spd.weight_bytes(target, "lm_head.weight") + spd.weight_bytes(target, "embed_tokens.weight")
    # Weights are usually stored in 16 bits: float32 doubles them.
    need = 2 * (head + sum(spd.weight_bytes(path) for path in drafters))
    return "float32" if need <= FLOAT32_MEMORY_SHARE * free else "bfloat16"


class Scorer:
    """Holds the target head and the hidden states; scores any drafter at any captured layer ids."""

    # Host memory the features of the sequences handed to the engine at once may take: the engine
    # drafts one block per sequence per step, and the larger the batch of blocks, the better a GPU's
    # matrix products run (at hidden 5120, 8 GiB holds ~140 completions of 1,128 tokens).
    CHUNK_BYTES = 8 << 30

    def __init__(self, opts: Options, device: str, dtype: str):
        import torch

        from specops.hidden_states import open_hidden_states
        from specops.target_head import load_target_head

        self.device = device
        self.dtype = getattr(torch, dtype)
        self.hidden = open_hidden_states(opts.hidden_states)
        self.head = load_target_head(opts.target, device=device, dtype=self.dtype)

    def load(self, path: Path):
        from specops.drafter import load_drafter

        return load_drafter(path, device=self.device, dtype=self.dtype)

    def sequences(self, layer_ids: list[int]):
        selected = self.hidden.select_layers(layer_ids)
        for meta, input_ids, features in selected:
            yield {
                "id": str(meta["id"]),
                "input_ids": input_ids,
                "features": features,
                "prompt_len": int(meta["prompt_tokens"]),
            }

    def score(self, drafter, layer_ids: list[int]) -> dict[str, Any]:
        """{"block_size", "sequences": [{"id", "accept_lengths", "block_starts"}]} for one drafter and
        layer choice."""
        from specops.acceptance import offline_acceptance

        scored: list[dict[str, Any]] = []
        chunk: list[dict[str, Any]] = []
        total = len(self.hidden)

        def flush() -> None:
            for result in offline_acceptance(drafter, self.head, chunk):
                scored.append(
                    {
                        "id": result.id,
                        "accept_lengths": list(result.accept_lengths),
                        "block_starts": list(result.block_starts),
                    }
                )
            log(f"score: {len(scored)}/{total} sequences")
            chunk.clear()

        held = 0
        for sequence in self.sequences(layer_ids):
            chunk.append(sequence)
            held += sequence["features"].numel() * sequence["features"].element_size()
            if held >= self.CHUNK_BYTES:
                flush()
                held = 0
        if chunk:
            flush()
        return {"block_size": drafter.block_size, "sequences": scored}

    def margins(
        self, drafter, layer_ids: list[int], scores: Mapping[str, Any], ids: Sequence[str]
    ) -> dict[str, dict[str, Any]]:
        """The closest call of every draft of the given prompts (specops.margins)."""
        from specops.acceptance import as_input
        from specops.margins import closest_call

        walked = {seq["id"]: seq for seq in scores["sequences"]}
        found = {}
        for sequence in self.sequences(layer_ids):
            if sequence["id"] in ids and sequence["id"] in walked:
                seq = walked[sequence["id"]]
                found[sequence["id"]] = closest_call(
                    drafter, self.head, as_input(sequence), seq["block_starts"], seq["accept_lengths"]
                )
        return found


def model_errors() -> tuple[type[Exception], ...]:
    """The engine's errors that name a fix; anything else is a crash with a traceback."""
    from specops.drafter import DrafterError
    from specops.hidden_states import HiddenStatesError
    from specops.target_head import TargetHeadError

    return DrafterError, HiddenStatesError, TargetHeadError


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


def _checked_config(
    path: Path, label: str, target: Path, target_config: Mapping[str, Any], captured: list[int]
) -> tuple[dict[str, Any], list[int]]:
    """A drafter's config and target layers, checked against the target and the hidden states before
    any model loads (a bad mask id or layer would only crash the engine)."""
    config = diag.read_json(path / "config.json") or {}
    text = diag.text_config(target_config)
    layer_ids = drafter_layer_ids(config, label)
    require_layers(layer_ids, captured, label, text.get("num_hidden_layers"))
    if text.get("hidden_size") and config.get("hidden_size") != text["hidden_size"]:
        raise StageError(
            f"the {label}'s hidden_size {config.get('hidden_size')} differs from the "
            f"target's {text['hidden_size']}: the {label} was built for another target"
        )
    error = diag.mask_token_error(diag.vocabulary_check(config, target))
    if error:
        raise StageError(error.replace("the drafter's", f"the {label}'s"))
    return config, layer_ids


def _server_drafter_name(opts: Options) -> str:
    """The name under which the server's drafter was scored: a drafter's name, or reference."""
    if opts.server_drafter == "drafter":
        return opts.names[0]
    return opts.server_drafter


def run(request: dict[str, Any]) -> dict[str, Any]:
    opts = parse_request(request)
    remove_stale_temporaries(opts.out_dir)
    inputs = inputs_of(opts)
    inputs_fingerprint = fingerprint(inputs)
    if not opts.force and is_up_to_date(opts.out_dir, inputs_fingerprint):
        log(f"score: {opts.out_dir} is up to date, nothing to do")
        report = json.loads((opts.out_dir / REPORT_JSON).read_text())
        return key_figures(report, opts.out_dir, changed=False)

    hidden_manifest = load_manifest(opts.hidden_states) or {}
    captured = list(hidden_manifest.get("layer_ids") or [])
    target_config = diag.read_json(opts.target / "config.json") or {}
    names = opts.names
    label = {name: "drafter" if len(names) == 1 else f"drafter {name}" for name in names}
    configs = {
        name: _checked_config(path, label[name], opts.target, target_config, captured)
        for name, path in zip(names, opts.drafter, strict=True)
    }
    reference_config, reference_ids = None, None
    if opts.reference_drafter:
        reference_config, reference_ids = _checked_config(
            opts.reference_drafter, "reference drafter", opts.target, target_config, captured
        )
    online = online_acceptance(opts.completions)
    device = str(resolve_device(opts.device))
    limit_gpu_memory(device, opts.gpu_memory_gib)
    scored_paths = [*opts.drafter, *([opts.reference_drafter] if opts.reference_drafter else [])]
    dtype = resolve_dtype(opts.dtype, device, opts.target, scored_paths)
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
    except model_errors() as error:
        raise StageError(str(error)) from error

    return _write(opts, inputs, inputs_fingerprint, reports)


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


def _speedup(opts: Options, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Each drafter's expected speedup (into its report) and the model's statement for the summary."""
    measured = dict(opts.step_costs)
    for report, path in zip(reports, opts.drafter, strict=True):
        costs = measured or spd.estimated_costs(opts.target, path)
        report["speedup"] = {
            **costs,
            "source": "measured" if measured else "estimated",
            "expected": spd.expected_speedup(report["overall"]["tau"], **costs),
        }
    model = spd.model_description("measured" if measured else "estimated", measured)
    if opts.reference_drafter and reports[0].get("reference"):
        costs = measured or spd.estimated_costs(opts.target, opts.reference_drafter)
        model["reference_expected"] = spd.expected_speedup(reports[0]["reference"]["tau"], **costs)
    return model


def _write(
    opts: Options, inputs: dict[str, Any], inputs_fingerprint: str, reports: list[dict[str, Any]]
) -> dict[str, Any]:
    """Every drafter's directory, then the summary; the history; the manifest last."""
    from specops import plots

    out = opts.out_dir
    out.mkdir(parents=True, exist_ok=True)
    model = _speedup(opts, reports)
    files: list[str] = []
    plot_dirs = {}
    for report in reports:
        directory = out / DRAFTERS_DIR / report["name"]
        directory.mkdir(parents=True, exist_ok=True)
        report["plots"] = plots.render_plots(report, directory)
        atomic_write_text(directory / REPORT_MD, rep.render_markdown(report))
        atomic_write_json(directory / REPORT_JSON, report)
        plot_dirs[report["name"]] = f"{DRAFTERS_DIR}/{report['name']}/"
        files += [
            f"{DRAFTERS_DIR}/{report['name']}/{name}" for name in (REPORT_MD, REPORT_JSON, *report["plots"])
        ]
    # A drafter no longer in the list leaves no stale directory behind.
    for stale in (out / DRAFTERS_DIR).iterdir():
        if stale.name not in plot_dirs and stale.is_dir():
            shutil.rmtree(stale)
    run_info = {
        key: value for key, value in reports[0]["run"].items() if key not in ("drafter", "target_layer_ids")
    }
    summary = rep.build_summary(run_info, reports, model, detectable=opts.detectable_difference)
    summary_plots = [plots.render_comparison(summary, out)]
    run_id = None
    if opts.history:
        run_id = hist.new_run_id(inputs_fingerprint)
        hist.append(opts.history, hist.entry(run_id, summary))
        runs = hist.read(opts.history)
        summary["history"] = hist.trend(runs, run_id, opts.history / hist.INDEX)
        summary_plots.append(
            plots.render_trend(runs, summary["history"]["drafters"], out, summary["history"]["changes"])
        )
    summary["plots"] = summary_plots
    summary["window"] = win.read_window(opts.hidden_states)
    atomic_write_text(
        out / REPORT_MD,
        rep.render_summary(summary, plot_dirs, summary_plots) + win.render_markdown(summary["window"]),
    )
    atomic_write_json(out / REPORT_JSON, summary)
    files = [REPORT_JSON, REPORT_MD, *summary_plots, *files]
    if opts.history and run_id:
        hist.keep_run(
            opts.history,
            run_id,
            [out / name for name in (REPORT_JSON, REPORT_MD, *summary_plots)] + [out / DRAFTERS_DIR],
        )
    figures = {
        "tau": summary["overall"]["tau"],
        "reference_tau": (summary.get("reference") or {}).get("tau"),
        "ratio": summary.get("ratio"),
        "drafters": {r["name"]: r["overall"]["tau"] for r in reports},
    }
    write_manifest(out, STAGE, inputs, files, figures=figures)
    log(f"score: {summary['verdict']}; report in {out / REPORT_MD}")
    return key_figures(summary, out, changed=True)


def main() -> int:
    return serve(STAGE, plan, run)


if __name__ == "__main__":
    raise SystemExit(main())
