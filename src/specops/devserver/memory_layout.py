"""The server's GPU memory as SGLang lays it out, and its own accounting of it in /server_info.

SGLang loads the weights, then gives the KV pool what is free minus a slack of
`(1 - --mem-fraction-static)` of the device, so that weights + KV cache take about that fraction
(sglang 0.5.23 srt/mem_cache/kv_cache_configurator.py:2990-3007), then captures CUDA graphs in part
of the slack. Each part is a
tag of its own for release and resume (`weights`, `kv_cache`, `cuda_graph`; 0.5.4 has no
`cuda_graph` tag, its graphs stay). The scheduler reports the parts per rank in
`internal_states[].memory_usage`, in GB:
- 0.5.23 (srt/managers/scheduler_components/memory_usage.py:15-43): weight, kvcache,
  startup_available (free once serving), token_capacity, token_capacity_swa, graph {phase: GB};
- 0.5.4 (srt/managers/scheduler.py:2389-2399): weight, kvcache, token_capacity, graph (one number).
On the CPU there is no device: `--device-memory-gib` lays the same parts out on a simulated one,
so that a memory plan has SGLang's figures to read; without it the server reports what it holds
and no free memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specops.devserver.versions import SGLangVersion

GIB = 1 << 30
MIB = 1 << 20
# The KV cache of a server that knows no device size (CPU, not simulated).
UNSIZED_KV_CACHE_BYTES = 256 * MIB
# CUDA context, NCCL and allocator slack outside the static pool (what SGLang leaves besides
# mem-fraction-static and the graphs).
CONTEXT_BYTES = 512 * MIB
# Per-phase CUDA graph memory: a share of the device, as captured graphs take a few hundred MiB to
# a few GiB on large GPUs.
GRAPH_SHARE = 0.01
KV_BYTES_PER_TOKEN = 64 * 1024


@dataclass(frozen=True)
class MemoryLayout:
    total_bytes: int | None  # the device's size (None: not known, CPU without a simulated device)
    weights_bytes: int
    kv_cache_bytes: int
    cuda_graph_bytes: int

    @property
    def startup_available_bytes(self) -> int | None:
        """What the device has free once the server serves (SGLang's `startup_available`)."""
        if self.total_bytes is None:
            return None
        held = self.weights_bytes + self.kv_cache_bytes + self.cuda_graph_bytes + CONTEXT_BYTES
        return max(0, self.total_bytes - held)


def lay_out(total_bytes: int | None, weights_bytes: int, mem_fraction_static: float) -> MemoryLayout:
    """Weights, a KV pool filling mem-fraction-static of the device, then graphs in part of the rest."""
    if total_bytes is None:
        return MemoryLayout(None, weights_bytes, UNSIZED_KV_CACHE_BYTES, 0)
    static = int(total_bytes * mem_fraction_static)
    if static <= weights_bytes:
        raise ValueError(
            f"--mem-fraction-static {mem_fraction_static} leaves no room for the KV cache: the weights take "
            f"{weights_bytes / GIB:.2f} GiB of {static / GIB:.2f} GiB ({total_bytes / GIB:.1f} GiB device); "
            "raise it or use a larger device"
        )
    graphs = min(int(total_bytes * GRAPH_SHARE), max(0, total_bytes - static - CONTEXT_BYTES))
    return MemoryLayout(total_bytes, weights_bytes, static - weights_bytes, graphs)


def memory_usage(layout: MemoryLayout, version: SGLangVersion) -> dict[str, Any]:
    """`memory_usage` as the version's scheduler reports it (GB, rounded as SGLang rounds)."""
    tokens = layout.kv_cache_bytes // KV_BYTES_PER_TOKEN
    if "cuda_graph" not in version.all_tags:
        return {
            "weight": round(layout.weights_bytes / GIB, 2),
            "kvcache": round(layout.kv_cache_bytes / GIB, 2),
            "token_capacity": int(tokens),
            "graph": round(layout.cuda_graph_bytes / GIB, 2),
        }
    usage: dict[str, Any] = {
        "weight": round(layout.weights_bytes / GIB, 3),
        "kvcache": round(layout.kv_cache_bytes / GIB, 3),
        "token_capacity": int(tokens),
        "token_capacity_swa": None,
        "graph": {"decode": round(layout.cuda_graph_bytes / GIB, 3)},
    }
    available = layout.startup_available_bytes
    if available is not None:
        usage["startup_available"] = round(available / GIB, 3)
    return usage


def model_bytes(model: Any) -> int:
    """Bytes of a module's parameters and buffers (a tied tensor once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total
