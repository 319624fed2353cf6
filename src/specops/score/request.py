"""The score stage's request: its declared options (REQUEST), the parsed Options, and the checks
that turn a request into them with errors that name the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

from specops import diagnostics as diag
from specops import report as rep
from specops import stats
from specops.schema import Option, Schema
from specops.stage import StageError

STAGE = "score"
DTYPES = ("auto", "float32", "bfloat16", "float16")
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
        Option("placement", "dict", "Where the play placed the scoring and why (said in the report)."),
        Option("cpu_bounds", "dict", "nice, cpu_quota_percent and threads the stage runs within."),
    ),
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
    # Neither is an input of the report's figures: they say where and how it was made.
    placement: Mapping[str, Any] | None = None
    cpu_bounds: Mapping[str, Any] | None = None

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
        placement=dict(request.get("placement") or {}) or None,
        cpu_bounds=dict(request.get("cpu_bounds") or {}) or None,
    )
