"""What the ML environment can really run: imports, GPUs, and fla's gated delta rule against torch.

Run inside the environment as `python -m specops.envcheck --run` (the stage protocol, see
docs/architecture.md). The report says which backend extraction will use. `fla-cuda` is claimed
only after fla's `chunk_gated_delta_rule` ran on the GPU and matched transformers' torch reference
(computed in fp32 on the same inputs) within GDR_TOLERANCE; anything less is `torch-cuda` or
`torch-cpu`, so a silent fallback can no longer pass for the fast, checked path.

torch is imported lazily: `decide()` and the constants are usable without it (the control node
tests them with injected facts).
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import platform
import sys
import time
from typing import Any

from specops.stage import StageError, log, serve
from specops.versions import distribution_version

BACKENDS = ("fla-cuda", "torch-cuda", "torch-cpu")
REQUIRE_CHOICES = ("any", "fla-cuda")

# Relative error ||kernel - reference|| / ||reference|| (Frobenius; the larger of the output's and
# the final state's) allowed per input dtype. The reference is always fp32 on the kernel's own
# (rounded) inputs, so this measures the kernel's arithmetic only. fla 0.6.0 on an H200 measured
# 1.5e-3 with fp32 inputs (its triton dots use TF32) and 3.9e-3 with bf16 inputs, at every shape of
# benchmarks/fla_env_h200.sh: the tolerances leave 3-5x headroom and still catch a wrong kernel
# (a skipped q/k l2norm or a transposed state is off by O(1)).
GDR_TOLERANCE = {"float32": 5e-3, "bfloat16": 2e-2}

# Small enough for any GPU in a second, shaped to hit the awkward cases: a sequence that is not a
# multiple of the 64-token chunk, and grouped value heads (more value heads than key heads).
DEFAULT_GDR_SIZES: list[dict[str, Any]] = [
    {
        "batch": 2,
        "seq_len": 300,
        "k_heads": 2,
        "v_heads": 4,
        "head_k_dim": 64,
        "head_v_dim": 64,
        "dtype": "float32",
    },
    {
        "batch": 2,
        "seq_len": 300,
        "k_heads": 2,
        "v_heads": 4,
        "head_k_dim": 64,
        "head_v_dim": 64,
        "dtype": "bfloat16",
    },
]
SIZE_KEYS = ("batch", "seq_len", "k_heads", "v_heads", "head_k_dim", "head_v_dim")

FLA_CRASH_WARNING = (
    "fla and triton import on a host without a GPU: transformers would choose fla's kernels and "
    "crash ('0 active drivers'); uninstall fla here (fla-core, flash-linear-attention) or run on a GPU host"
)
FLA_NOT_USABLE_NOTE = (
    "fla is not usable here: no CUDA GPU is visible and fla's kernels run only on a GPU (triton); "
    "transformers will use its torch reference implementation of the gated delta rule on the CPU"
)


# ----------------------------------------------------------------------------------------------
# Facts: what is installed and what the hardware offers (no kernels run here)
# ----------------------------------------------------------------------------------------------


def _version_of(module_name: str) -> str | None:
    try:
        module = importlib.import_module(module_name)
    except Exception:  # any import failure means "not usable", the error is reported separately
        return None
    return getattr(module, "__version__", None)


def driver_facts() -> dict[str, Any]:
    """The NVIDIA kernel driver as the host exposes it, independent of torch."""
    version_file = "/proc/driver/nvidia/version"
    version = None
    if os.path.isfile(version_file):
        try:
            with open(version_file) as handle:
                version = handle.readline().strip() or None
        except OSError:
            version = None
    return {
        "present": os.path.isdir("/proc/driver/nvidia") or os.path.exists("/dev/nvidia0"),
        "version": version,
    }


def torch_reference() -> tuple[Any, str]:
    """transformers' torch implementation of the chunked gated delta rule and where it lives.

    transformers decorates it with `use_kernel_func_from_hub_with_fallback`, whose wrapper may call
    fla instead; `inspect.unwrap` follows `__wrapped__` back to the torch function itself.
    """
    errors = []
    for name in ("qwen3_5", "qwen3_next"):
        module_name = f"transformers.models.{name}.modeling_{name}"
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            errors.append(f"{module_name}: {error}")
            continue
        function = getattr(module, "torch_chunk_gated_delta_rule", None)
        if function is not None:
            return inspect.unwrap(function), f"{module_name}.torch_chunk_gated_delta_rule"
    raise StageError(
        "transformers has no torch_chunk_gated_delta_rule in qwen3_5 or qwen3_next "
        f"({'; '.join(errors) or 'function not found'}): install transformers>=5.6.2,<6"
    )


def transformers_gdr_choice() -> str | None:
    """The implementation transformers' Qwen3.5 layers will call: 'torch' or fla's function path.

    The choice is made once, when the modeling module is imported; the hub wrapper keeps it in
    its closure as `implementation`.
    """
    try:
        module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
        function = module.torch_chunk_gated_delta_rule
    except Exception:
        return None
    torch_function = inspect.unwrap(function)
    current = function
    while current is not None:
        try:
            implementation = inspect.getclosurevars(current).nonlocals.get("implementation")
        except (TypeError, ValueError):
            implementation = None
        if implementation is not None:
            if implementation is torch_function:
                return "torch"
            return f"{getattr(implementation, '__module__', '?')}.{getattr(implementation, '__name__', '?')}"
        current = getattr(current, "__wrapped__", None)
    return None


def collect_facts() -> dict[str, Any]:
    """Everything the decision needs, gathered without running a kernel."""
    try:
        import torch
    except Exception as error:
        raise StageError(
            f"torch does not import in {sys.executable} ({error}): install torch into this environment "
            "(the fla_env module's 'torch' option)"
        ) from error

    triton_version = _version_of("triton")
    fla_error = None
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
        fla_importable = True
    except Exception as error:  # ImportError, or triton failing at import on odd hosts
        fla_importable = False
        fla_error = f"{type(error).__name__}: {error}"

    cuda_available = bool(torch.cuda.is_available())
    devices = []
    if cuda_available:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "index": index,
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "memory_gib": round(props.total_memory / 2**30, 1),
                }
            )

    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "versions": {
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "transformers": _version_of("transformers"),
            "fla": _version_of("fla") if fla_importable else distribution_version("fla-core"),
            "triton": triton_version,
            "specops": _version_of("specops"),
        },
        "cuda_available": cuda_available,
        "devices": devices,
        "driver": driver_facts(),
        "fla_importable": fla_importable,
        "fla_import_error": fla_error,
        "triton_importable": triton_version is not None or _importable("triton"),
        "transformers_gdr_impl": transformers_gdr_choice(),
    }


def _importable(module_name: str) -> bool:
    try:
        importlib.import_module(module_name)
    except Exception:
        return False
    return True


# ----------------------------------------------------------------------------------------------
# The kernel check: fla's chunk_gated_delta_rule against the torch reference
# ----------------------------------------------------------------------------------------------


def normalize_sizes(sizes: Any) -> list[dict[str, Any]]:
    """Validate `gdr_sizes` from the request; each entry names every dimension and a dtype."""
    if sizes is None:
        return [dict(size) for size in DEFAULT_GDR_SIZES]
    if not isinstance(sizes, list) or not sizes:
        raise StageError(
            "gdr_sizes must be a non-empty list of shapes, e.g. [{'batch': 1, 'seq_len': 2048, "
            "'k_heads': 16, 'v_heads': 48, 'head_k_dim': 128, 'head_v_dim': 128}]"
        )
    normalized = []
    for position, size in enumerate(sizes):
        if not isinstance(size, dict):
            raise StageError(f"gdr_sizes[{position}] must be a mapping of {', '.join(SIZE_KEYS)} and dtype")
        merged = {**DEFAULT_GDR_SIZES[0], **size}
        unknown = sorted(set(merged) - set(SIZE_KEYS) - {"dtype"})
        if unknown:
            raise StageError(
                f"gdr_sizes[{position}] has unknown keys {unknown}: use {', '.join(SIZE_KEYS)}, dtype"
            )
        for key in SIZE_KEYS:
            if not isinstance(merged[key], int) or merged[key] < 1:
                raise StageError(
                    f"gdr_sizes[{position}].{key} must be a positive integer, got {merged[key]!r}"
                )
        if merged["v_heads"] % merged["k_heads"]:
            raise StageError(
                f"gdr_sizes[{position}]: v_heads {merged['v_heads']} must be a multiple of k_heads "
                f"{merged['k_heads']} (grouped value heads)"
            )
        if merged["dtype"] not in GDR_TOLERANCE:
            raise StageError(
                f"gdr_sizes[{position}].dtype {merged['dtype']!r} is not one of {sorted(GDR_TOLERANCE)}"
            )
        normalized.append(merged)
    return normalized


def gdr_inputs(size: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """fp32 CPU inputs shaped and scaled like a Qwen3.5 Gated DeltaNet layer's (reproducible)."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(seed)
    b, t, h, hv = size["batch"], size["seq_len"], size["k_heads"], size["v_heads"]
    dk, dv = size["head_k_dim"], size["head_v_dim"]
    # The layer's decay is -exp(A_log) * softplus(a + dt_bias) with exp(A_log) drawn from (0, 16).
    rate = torch.rand(hv, generator=generator) * 16
    return {
        "q": torch.randn(b, t, h, dk, generator=generator),
        "k": torch.randn(b, t, h, dk, generator=generator),
        "v": torch.randn(b, t, hv, dv, generator=generator),
        "g": -rate * F.softplus(torch.randn(b, t, hv, generator=generator)),
        "beta": torch.sigmoid(torch.randn(b, t, hv, generator=generator)),
    }


def _errors(got: Any, want: Any) -> tuple[float, float]:
    diff = got.float() - want
    return float(diff.abs().max()), float(diff.norm() / want.norm().clamp_min(1e-30))


def compare_gdr(
    kernel: Any, reference: Any, size: dict[str, Any], device: str, seed: int = 0
) -> dict[str, Any]:
    """Run `kernel` and the fp32 `reference` on the same inputs; return the errors and the verdict.

    The kernel gets q, k, v and beta in `size['dtype']` and g in fp32, as the Qwen3.5 layer passes
    them; the reference gets exactly those values upcast to fp32.
    """
    import torch

    dtype = getattr(torch, size["dtype"])
    raw = gdr_inputs(size, seed)
    inputs = {
        name: value.to(device=device, dtype=torch.float32 if name == "g" else dtype)
        for name, value in raw.items()
    }
    options = {"output_final_state": True, "use_qk_l2norm_in_kernel": True}
    with torch.no_grad():
        started = time.perf_counter()
        out, state = kernel(
            inputs["q"], inputs["k"], inputs["v"], g=inputs["g"], beta=inputs["beta"], **options
        )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        # The first call at a shape includes triton's compilation and autotuning.
        kernel_seconds = time.perf_counter() - started
        ref_inputs = {name: value.float() for name, value in inputs.items()}
        ref_out, ref_state = reference(
            ref_inputs["q"],
            ref_inputs["k"],
            ref_inputs["v"],
            g=ref_inputs["g"],
            beta=ref_inputs["beta"],
            **options,
        )
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    if tuple(out.shape) != tuple(ref_out.shape) or tuple(state.shape) != tuple(ref_state.shape):
        raise StageError(
            f"the kernel's output shapes {tuple(out.shape)}/{tuple(state.shape)} differ from the reference's "
            f"{tuple(ref_out.shape)}/{tuple(ref_state.shape)}: fla and transformers disagree on the layout"
        )
    out_abs, out_rel = _errors(out, ref_out)
    state_abs, state_rel = _errors(state, ref_state)
    finite = all(math.isfinite(value) for value in (out_abs, out_rel, state_abs, state_rel))
    tolerance = GDR_TOLERANCE[size["dtype"]]
    return {
        **size,
        "device": device,
        "output_max_abs_error": out_abs,
        "output_rel_error": out_rel,
        "state_max_abs_error": state_abs,
        "state_rel_error": state_rel,
        "tolerance": tolerance,
        "kernel_seconds": round(kernel_seconds, 3),
        "ok": finite and max(out_rel, state_rel) <= tolerance,
    }


def run_gdr_checks(sizes: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """fla's chunk_gated_delta_rule on cuda:0 against the torch reference, at every size."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    reference, reference_name = torch_reference()
    checks = []
    try:
        for size in sizes:
            log(f"envcheck: gated delta rule {size} on cuda:0")
            checks.append(compare_gdr(chunk_gated_delta_rule, reference, size, "cuda:0", seed))
    finally:
        torch.cuda.empty_cache()
    return summarize_checks(checks, reference_name)


def summarize_checks(checks: list[dict[str, Any]], reference_name: str) -> dict[str, Any]:
    return {
        "ran": True,
        "error": None,
        "reference": reference_name,
        "kernel": "fla.ops.gated_delta_rule.chunk_gated_delta_rule",
        "checks": checks,
        "max_abs_error": max(max(c["output_max_abs_error"], c["state_max_abs_error"]) for c in checks),
        "rel_error": max(max(c["output_rel_error"], c["state_rel_error"]) for c in checks),
        "ok": all(c["ok"] for c in checks),
    }


# ----------------------------------------------------------------------------------------------
# The decision: which backend, which warnings, which errors (pure: facts in, verdict out)
# ----------------------------------------------------------------------------------------------


def decide(
    facts: dict[str, Any], gdr: dict[str, Any] | None, require_backend: str = "any", planning: bool = False
) -> dict[str, Any]:
    """Turn facts (and the kernel check, when it ran) into a backend, notes, warnings and an error.

    `error` is None or the message a StageError should carry. In planning mode no kernel ran, so
    the backend is only `backend_expected`.
    """
    versions = facts.get("versions", {})
    cuda = bool(facts.get("cuda_available"))
    driver = facts.get("driver", {}).get("present", False)
    fla = bool(facts.get("fla_importable"))
    triton = bool(facts.get("triton_importable"))
    chosen = facts.get("transformers_gdr_impl")
    notes: list[str] = []
    warnings: list[str] = []
    error = None

    torch_cuda = versions.get("torch_cuda")
    if torch_cuda and not cuda and not driver:
        error = (
            f"torch {versions.get('torch')} is a CUDA {torch_cuda} build but this host has no NVIDIA driver "
            "(/proc/driver/nvidia is absent) and CUDA is unavailable: install a CPU build of torch "
            "(e.g. torch==2.13.0 from https://download.pytorch.org/whl/cpu or a wheelhouse holding the "
            "+cpu wheel) or run this environment on a GPU host"
        )
    elif torch_cuda and not cuda:
        warnings.append(
            f"an NVIDIA driver is present ({facts.get('driver', {}).get('version') or 'version unknown'}) "
            f"but torch {versions.get('torch')} (CUDA {torch_cuda}) cannot use it: the driver may be older "
            "than the CUDA runtime torch was built for, or no device is visible to this process "
            "(CUDA_VISIBLE_DEVICES); extraction here would run on the CPU"
        )

    if not cuda:
        backend = "torch-cpu"
        notes.append(FLA_NOT_USABLE_NOTE)
        transformers_picks_fla = chosen not in (None, "torch") or (chosen is None and fla and triton)
        if transformers_picks_fla:
            warnings.append(FLA_CRASH_WARNING)
    elif not fla:
        backend = "torch-cuda"
        reason = facts.get("fla_import_error") or "not installed"
        notes.append(
            f"fla does not import here ({reason}): transformers will run its torch reference implementation "
            "of the gated delta rule on the GPU (correct, about 2.6x slower than fla's kernels)"
        )
    elif planning or gdr is None:
        backend = None
        notes.append("check mode: fla's kernel was not run; the backend is what a run would verify")
    elif gdr.get("error"):
        backend = "torch-cuda"
        warnings.append(
            f"fla imports but its chunk_gated_delta_rule failed on the GPU ({gdr['error']}); transformers "
            "would call it and fail the same way: reinstall fla-core for this torch/triton, or uninstall fla"
        )
    elif not gdr.get("ok"):
        backend = "torch-cuda"
        warnings.append(
            f"fla's chunk_gated_delta_rule differs from the torch reference by a relative error of "
            f"{gdr.get('rel_error'):.3g} (tolerances {GDR_TOLERANCE}); transformers would use it and "
            "extraction would be wrong: install an fla-core that matches this torch/triton, or uninstall fla"
        )
    else:
        backend = "fla-cuda"

    expected = backend
    if backend is None:
        expected = "fla-cuda"
    if error is None and require_backend == "fla-cuda" and expected != "fla-cuda":
        why = (warnings + notes)[0] if (warnings or notes) else f"the backend is {expected}"
        error = f"require_backend is fla-cuda but this environment's backend is {expected}: {why}"

    return {
        "backend": backend,
        "backend_expected": expected,
        "notes": notes,
        "warnings": warnings,
        "error": error,
    }


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------


def _options(request: dict[str, Any]) -> tuple[str, list[dict[str, Any]], int]:
    require = request.get("require_backend", "any")
    if require not in REQUIRE_CHOICES:
        raise StageError(f"require_backend {require!r} is not one of {', '.join(REQUIRE_CHOICES)}")
    seed = request.get("gdr_seed", 0)
    if not isinstance(seed, int):
        raise StageError(f"gdr_seed must be an integer, got {seed!r}")
    return require, normalize_sizes(request.get("gdr_sizes")), seed


def report(facts: dict[str, Any], gdr: dict[str, Any] | None, verdict: dict[str, Any]) -> dict[str, Any]:
    gdr = gdr or {"ran": False}
    return {
        "changed": False,
        **facts,
        "backend": verdict["backend"],
        "backend_expected": verdict["backend_expected"],
        "gdr_max_abs_error": gdr.get("max_abs_error"),
        "gdr_rel_error": gdr.get("rel_error"),
        "gdr": gdr,
        "notes": verdict["notes"],
        "warnings": verdict["warnings"],
    }


def _check(request: dict[str, Any], planning: bool) -> dict[str, Any]:
    require, sizes, seed = _options(request)
    facts = collect_facts()
    gdr = None
    if not planning and facts["cuda_available"] and facts["fla_importable"]:
        try:
            gdr = run_gdr_checks(sizes, seed)
        except StageError:
            raise
        except Exception as error:  # a kernel that cannot compile or launch here is a finding, not a crash
            gdr = {"ran": True, "ok": False, "error": f"{type(error).__name__}: {error}", "checks": []}
    verdict = decide(facts, gdr, require, planning=planning)
    if verdict["error"]:
        raise StageError(verdict["error"])
    result = report(facts, gdr, verdict)
    for line in verdict["warnings"]:
        log(f"envcheck: WARNING {line}")
    log(f"envcheck: backend {result['backend'] or result['backend_expected'] + ' (expected)'}")
    return result


def plan(request: dict[str, Any]) -> dict[str, Any]:
    return _check(request, planning=True)


def run(request: dict[str, Any]) -> dict[str, Any]:
    return _check(request, planning=False)


def main(argv: list[str] | None = None) -> int:
    return serve("envcheck", plan, run, argv)


if __name__ == "__main__":
    sys.exit(main())
