"""What the ML environment has, gathered without running a kernel: the installed versions, the NVIDIA
driver, CUDA, whether fla and triton import, and which gated delta rule transformers will call.
"""

from __future__ import annotations

import importlib
import inspect
import os
import platform
import sys
from typing import Any

from specops.stage import StageError
from specops.versions import distribution_version


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
