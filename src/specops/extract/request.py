"""The extraction request: its options, their defaults and their validation."""

from __future__ import annotations

from typing import Any

from specops.backend import REQUIRE_BACKENDS, check_require_backend
from specops.extract.devices import MODES, validate_request
from specops.schema import Option, Schema
from specops.stage import StageError

STAGE = "extract_hidden_states"
DTYPES = ("bfloat16", "float16", "float32")
REQUEST = Schema(
    STAGE,
    (
        Option("target", "path", "Target model directory (config.json and *.safetensors).", required=True),
        Option("completions", "path", "The sglang_completions output directory.", required=True),
        Option("out_dir", "path", "Directory for the shards and the manifest.", required=True),
        Option(
            "drafter",
            "list",
            "DFlash drafter directory, or a list of them: the union of their target_layer_ids is captured.",
            elements="path",
        ),
        Option("layer_ids", "list", "Layer ids to capture instead of the drafter's.", elements="int"),
        Option(
            "capture_offsets",
            "list",
            "Offsets around each target layer to capture too.",
            default=[0],
            elements="int",
        ),
        Option(
            "dtype",
            "str",
            "Compute and storage dtype; auto is bfloat16 on CUDA, float32 on the CPU.",
            default="auto",
            choices=("auto", *DTYPES),
        ),
        Option(
            "device",
            "str",
            "auto, cpu, cuda or cuda:N; the device when no devices are listed.",
            default="auto",
        ),
        # Unset: every visible GPU when device is auto (devices.py).
        Option("devices", "list", "Devices to extract on, such as [cuda:0, cuda:1].", elements="str"),
        Option(
            "parallel",
            "str",
            "One model copy per device (data), its layers spread over them (split), one "
            "device (single), or auto from free memory.",
            default="auto",
            choices=MODES,
        ),
        Option(
            "require_backend",
            "str",
            "Gated-delta-rule implementation required; auto is fla on CUDA, else any.",
            default="auto",
            choices=REQUIRE_BACKENDS,
        ),
        Option(
            "parity_samples", "int", "Records compared with the fp32 torch reference; 0 is off.", default=0
        ),
        # bf16 hidden states differ from an fp32 reference by 1.4-2.8% on a small model (FACTS.md);
        # the limit per layer is the larger of this and twice the noise floor measured in the same run.
        Option(
            "parity_tolerance",
            "float",
            "Relative error per layer above which the parity probe fails.",
            default=0.05,
        ),
        Option("batch_tokens", "int", "Most tokens (padding included) in one forward.", default=16384),
        Option("shard_tokens", "int", "Tokens per shard file.", default=32768),
        Option("writer_threads", "int", "Threads writing shards while the GPU computes.", default=4),
        # Off leaves the flushing to the OS (faster on a disk slower than the extraction, but a power loss
        # can then damage shards the manifest lists).
        Option("fsync", "bool", "Flush each shard to the device as it is written.", default=True),
        Option("progress_log", "path", "Progress log path; unset is <out_dir>/progress.log."),
        Option(
            "disk_reserve_bytes",
            "int",
            "Bytes that must stay free on the output's file system once the shards are written.",
            default=64 * 2**20,
        ),
        # The play writes "go" into it once the GPUs are free: prepare now, extract then.
        Option("start_signal", "path", "A file to wait on for go before extracting; unset starts at once."),
        # The host memory plan (host_memory.py): what the window makes the host hold beside the weights.
        Option(
            "window_mode",
            "str",
            "The window the extraction runs in: stop, or memory_saver (the server keeps a CPU backup).",
            default="stop",
            choices=("stop", "memory_saver"),
        ),
        Option(
            "host_weights",
            "str",
            "Weights held ahead of the window: pinned, pageable, or auto (pinned where the host has room).",
            default="auto",
            choices=("auto", "pinned", "pageable"),
        ),
        Option(
            "server_weights_bytes",
            "int",
            "Bytes of the served model's weights (its CPU backup); 0 is the target's weights.",
            default=0,
        ),
        Option(
            "host_memory_reserve_bytes",
            "int",
            "Host memory left to everything else; 0 is the larger of 4 GiB and 5% of the host's.",
            default=0,
        ),
        Option(
            "meminfo",
            "path",
            "The host's memory figures, in /proc/meminfo's format.",
            default="/proc/meminfo",
        ),
    ),
)


def parse_request(request: dict[str, Any]) -> dict[str, Any]:
    req = REQUEST.merged(request, "give the target model dir, the completions dir and out_dir")
    # No devices listed: "auto", every visible GPU when device is auto (devices.py).
    if req["devices"] is None:
        req["devices"] = "auto"
    if req["dtype"] not in ("auto", *DTYPES):
        raise StageError(f"dtype {req['dtype']!r} is not one of auto, {', '.join(DTYPES)}")
    check_require_backend(req["require_backend"])
    for key in ("server_weights_bytes", "host_memory_reserve_bytes"):
        if not isinstance(req[key], int) or req[key] < 0:
            raise StageError(f"{key} must be 0 or a positive integer, got {req[key]!r}")
    for key in ("batch_tokens", "shard_tokens", "writer_threads"):
        if not isinstance(req[key], int) or req[key] < 1:
            raise StageError(f"{key} must be a positive integer, got {req[key]!r}")
    if not isinstance(req["disk_reserve_bytes"], int) or req["disk_reserve_bytes"] < 0:
        raise StageError(
            f"disk_reserve_bytes must be 0 or a positive integer, got {req['disk_reserve_bytes']!r}"
        )
    if not isinstance(req["parity_samples"], int) or req["parity_samples"] < 0:
        raise StageError(
            f"parity_samples must be 0 (off) or a positive integer, got {req['parity_samples']!r}"
        )
    offsets = req["capture_offsets"]
    if not isinstance(offsets, list) or not offsets or not all(isinstance(o, int) for o in offsets):
        raise StageError(
            f"capture_offsets must be a non-empty list of integers such as [0] or [-1, 0, 1], got {offsets!r}"
        )
    validate_request(req)
    return req


def drafter_list(value: Any) -> list[str]:
    """The request's drafter: one path, a list of them, or none."""
    if not value:
        return []
    return [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]
