"""Which implementation of the linear-attention kernels a transformers model actually runs.

transformers (>= 5.x) picks the implementation once, at import of the modeling module
(`use_kernel_func_from_hub_with_fallback`): fla's kernel if `fla` imports, else the reference torch
function, which the wrapper keeps in `__wrapped__`. The forward looks the wrapped function up as a
module global, so replacing that global with a shim lets us record what ran and, when asked, call
the torch reference directly.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

from specops.stage import StageError

# Kernel family -> the module globals of a modeling file that dispatch to it.
KERNEL_FUNCTIONS = {
    "gated_delta_rule": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "causal_conv1d": ("causal_conv1d_fn", "causal_conv1d_update"),
}
NOT_USED = "not used"

# What a run requires of the gated delta rule's implementation, one vocabulary for the environment
# check (specops.envcheck, the fla_env module) and the extraction: fla (fla's kernels on a CUDA GPU,
# else fail), torch (the PyTorch reference, forced where the extraction runs; fla not needed), any
# (whatever transformers picks) and auto (fla where the work runs on a CUDA GPU, else any).
REQUIRE_BACKENDS = ("auto", "fla", "torch", "any")


def check_require_backend(require: Any) -> str:
    """The value itself when it is one of REQUIRE_BACKENDS; otherwise a StageError naming the choices."""
    if require not in REQUIRE_BACKENDS:
        # The fla_env module still takes fla-cuda (deprecated) and passes fla; here it is an error.
        hint = ": fla requires fla's kernels on the GPU" if require == "fla-cuda" else ""
        raise StageError(f"require_backend {require!r} is not one of {', '.join(REQUIRE_BACKENDS)}{hint}")
    return require


def resolve_require_backend(require: str, cuda: bool) -> str:
    """auto is fla where the work runs on a CUDA GPU, else any; fla, torch and any stand as they are."""
    if require == "auto":
        return "fla" if cuda else "any"
    return require


def implementation_of(function: Callable) -> tuple[str, Callable]:
    """('fla' | 'causal_conv1d' | 'torch' | ..., the callable the wrapper dispatches to)."""
    torch_function = getattr(function, "__wrapped__", None)
    if torch_function is None:
        return _package_of(function), function
    try:
        chosen = inspect.getclosurevars(function).nonlocals.get("implementation")
    except (TypeError, ValueError):
        chosen = None
    if chosen is None or chosen is torch_function:
        return "torch", torch_function
    return _package_of(chosen), chosen


def _package_of(function: Callable) -> str:
    module = getattr(function, "__module__", "") or ""
    return "torch" if module.startswith("transformers") else module.split(".")[0] or "unknown"


def planned_backends(modeling: ModuleType) -> dict[str, str]:
    """What each kernel family would run with, read from the wrappers without running anything."""
    plan = {}
    for family, names in KERNEL_FUNCTIONS.items():
        labels = [implementation_of(getattr(modeling, n))[0] for n in names if hasattr(modeling, n)]
        plan[family] = labels[0] if labels else NOT_USED
    return plan


def modeling_module_for(config: Any) -> ModuleType | None:
    """The modeling module AutoModelForCausalLM would use for this config (imports it, loads nothing)."""
    from transformers import AutoModelForCausalLM

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None
    return sys.modules.get(model_class.__module__)


class BackendMonitor:
    """Patch a modeling module's kernel dispatchers: count what runs, optionally force the torch path.

    Use as a context manager around forwards; `used` maps family -> {label: calls}.
    """

    def __init__(self, modeling: ModuleType, force_torch: bool = False):
        self.modeling = modeling
        self.force_torch = force_torch
        self.used: dict[str, Counter] = {family: Counter() for family in KERNEL_FUNCTIONS}
        self._originals: dict[str, Callable] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> BackendMonitor:
        for family, names in KERNEL_FUNCTIONS.items():
            for name in names:
                original = getattr(self.modeling, name, None)
                if original is None:
                    continue
                self._originals[name] = original
                setattr(self.modeling, name, self._shim(family, original))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for name, original in self._originals.items():
            setattr(self.modeling, name, original)
        self._originals.clear()

    def _shim(self, family: str, original: Callable) -> Callable:
        label, _ = implementation_of(original)
        torch_function = getattr(original, "__wrapped__", original)
        if self.force_torch and torch_function is not original:
            label = "torch"
            accepted = inspect.signature(torch_function).parameters
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())

            def call(*args, **kwargs):
                # The transformers wrapper drops keywords the chosen function does not take; so do we.
                if not takes_any:
                    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
                return torch_function(*args, **kwargs)
        else:
            call = original

        def shim(*args, **kwargs):
            with self._lock:
                self.used[family][label] += 1
            return call(*args, **kwargs)

        shim.__wrapped__ = torch_function  # type: ignore[attr-defined]
        return shim

    def summary(self) -> dict[str, str]:
        """family -> the label that ran ('fla', 'torch', ...), 'mixed: a, b' or 'not used'."""
        result = {}
        for family, counts in self.used.items():
            labels = sorted(label for label, n in counts.items() if n)
            result[family] = (
                labels[0] if len(labels) == 1 else ("mixed: " + ", ".join(labels) if labels else NOT_USED)
            )
        return result
