"""What the host imports before it forks stages, and how it notices that a file it imported changed."""

from __future__ import annotations

import importlib
import os
import sys

# Imported once here instead of in every stage process; nothing here touches CUDA (a forked child
# could not use a CUDA context made before the fork) or starts a thread (forking copies one thread).
MODULES = (
    "torch",
    "transformers",
    # What every model class imports (modeling_utils alone pulls torch.distributed.tensor and dynamo),
    # short of the model's own module: a model using fla would import triton's driver with it.
    "transformers.modeling_utils",
    "transformers.modeling_layers",
    "transformers.activations",
    "transformers.generation",
    "safetensors.torch",
    "jinja2",
    "specops.stage",
    "specops.extract.stage",
    "specops.score.stage",
    "specops.completions.stage",
    "specops.envcheck.stage",
    "specops.prewarm",
)
# transformers imports these lazily on first use: the model loading stack is most of its cost.
TRANSFORMERS_NAMES = ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM")


def preload() -> None:
    # transformers asks torch.cuda.is_available() while importing; by default that initializes the CUDA
    # driver (cuInit), which no forked child can use, and the host then refuses to serve (seen on an H100,
    # 2026-12-05). torch's NVML-based check answers the same without it and is safe across a fork; a
    # forked stage runs with its caller's environment, which decides for its own checks.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    for name in MODULES:
        importlib.import_module(name)
    transformers = sys.modules["transformers"]
    for name in TRANSFORMERS_NAMES:
        getattr(transformers, name)
    torch = sys.modules["torch"]
    if torch.cuda.is_initialized() or cuda_driver_loaded():
        raise RuntimeError("CUDA was initialized while preloading: a forked stage could not use the GPU")


def cuda_driver_loaded(maps: str = "/proc/self/maps") -> bool:
    """The CUDA driver library is mapped: the runtime was initialized (a device count asked of it, say),
    which a forked child cannot use. NVML (libnvidia-ml) does not count: it is safe across a fork."""
    try:
        with open(maps) as handle:
            return any("/libcuda.so" in line for line in handle)
    except OSError:
        return False


def loaded_files() -> dict[str, int]:
    """Each imported module's file and its modification time (ns): a fork must not run code older
    than what is on disk (a reinstalled environment, an edited checkout)."""
    seen: dict[str, int] = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or path in seen:
            continue
        try:
            seen[path] = os.stat(path).st_mtime_ns
        except OSError:
            seen[path] = -1
    return seen


def changed_since(snapshot: dict[str, int]) -> str | None:
    """The first imported file whose modification time differs from the snapshot, or None."""
    for path, mtime in snapshot.items():
        try:
            now = os.stat(path).st_mtime_ns
        except OSError:
            now = -1
        if now != mtime:
            return path
    return None
