"""require_backend enforced: refused before any weights load (backend_plan), checked on what ran."""

from __future__ import annotations

import sys
from typing import Any

from specops.backend import NOT_USED, planned_backends
from specops.extract.prepared import Prepared
from specops.stage import StageError


def backend_plan(prep: Prepared, modeling: Any) -> bool:
    """Fail before loading weights when the run cannot satisfy require_backend; returns force_torch."""
    planned = planned_backends(modeling) if modeling is not None else {}
    force_torch = prep.require == "torch"
    kernels = sorted({label for label in planned.values() if label not in ("torch", NOT_USED)})
    if prep.device.type == "cpu" and kernels and not force_torch:
        raise StageError(
            f"{', '.join(kernels)} is installed in {sys.executable}, whose kernels need a CUDA GPU, and the "
            "device is cpu: transformers would call them and crash. Run on a GPU host, or set "
            "require_backend: torch to use the PyTorch reference implementation on the CPU (slow)"
        )
    if prep.require == "fla" and planned.get("gated_delta_rule", NOT_USED) not in ("fla", NOT_USED):
        raise StageError(
            f"require_backend is fla but transformers will use the torch fallback for the gated delta "
            f"rule: fla "
            f"does not import in {sys.executable}; install flash-linear-attention and fla-core (fla_env), or "
            "set require_backend: any"
        )
    return force_torch


def check_backend(require: str, used: dict[str, str]) -> None:
    ran = used.get("gated_delta_rule", NOT_USED)
    if ran == NOT_USED or require == "any" or ran == require:
        return
    if require == "fla":
        raise StageError(
            f"the gated-delta-rule ran with the {ran} implementation, but require_backend is fla: install "
            f"flash-linear-attention (fla-core) with triton in the ML environment ({sys.executable}) on a "
            f"GPU "
            "host (fla_env), or set require_backend: any to accept the slow reference path"
        )
    raise StageError(f"the gated-delta-rule ran with {ran}, but require_backend is {require}")
