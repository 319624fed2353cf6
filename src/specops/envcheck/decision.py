"""The decision: which backend the environment gives, with its notes, warnings and error. Pure: facts
in, verdict out, so the control node tests it with injected facts and no torch.
"""

from __future__ import annotations

from typing import Any

from specops.backend import resolve_require_backend
from specops.envcheck.kernel import GDR_TOLERANCE

# What the environment gives; require_backend fla (auto where torch sees a CUDA GPU) needs fla-cuda.
BACKENDS = ("fla-cuda", "torch-cuda", "torch-cpu")

FLA_CRASH_WARNING = (
    "fla and triton import on a host without a GPU: transformers would choose fla's kernels and "
    "crash ('0 active drivers'); uninstall fla here (fla-core, flash-linear-attention) or run on a GPU host"
)
FLA_NOT_USABLE_NOTE = (
    "fla is not usable here: no CUDA GPU is visible and fla's kernels run only on a GPU (triton); "
    "transformers will use its torch reference implementation of the gated delta rule on the CPU"
)


def decide(
    facts: dict[str, Any], gdr: dict[str, Any] | None, require_backend: str = "any", planning: bool = False
) -> dict[str, Any]:
    """Turn facts (and the kernel check, when it ran) into a backend, notes, warnings and an error.

    `error` is None or the message a StageError should carry. In planning mode no kernel ran, so
    the backend is only `backend_expected`. require_backend is one of specops.backend.REQUIRE_BACKENDS:
    fla (and auto where torch sees a CUDA GPU) fails unless the backend is fla-cuda; torch and any
    (and auto elsewhere) accept what there is, since the torch reference runs wherever torch does.
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
    required = resolve_require_backend(require_backend, cuda)
    if error is None and required == "fla" and expected != "fla-cuda":
        why = (warnings + notes)[0] if (warnings or notes) else f"the backend is {expected}"
        asked = "fla" if require_backend == "fla" else f"{require_backend} (fla where torch sees a CUDA GPU)"
        error = (
            f"require_backend is {asked} but this environment's backend is {expected}, not fla-cuda: {why}"
        )

    return {
        "backend": backend,
        "backend_expected": expected,
        "require_backend": required,
        "notes": notes,
        "warnings": warnings,
        "error": error,
    }
