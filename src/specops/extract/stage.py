"""Stage extract_hidden_states: the target's hidden states at the drafter's layers, streamed to shards.

`python -m specops.extract --plan|--run` with a JSON request on stdin (docs/architecture.md).
Only the captured layers run: forward hooks record them and the hook of the last one stops the
forward, so later layers and the lm_head never run. Records are sorted by length and packed into
right-padded batches (padding cannot reach earlier tokens: every layer is causal). Shards are planned
up front from the lengths alone, written atomically by writer threads while the GPU computes, and
recorded in a resume file, so a killed run continues where it stopped.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specops import preflight
from specops.backend import NOT_USED, BackendMonitor, modeling_module_for, planned_backends
from specops.extract_devices import first_device, plan_for, validate_request
from specops.hidden_states import FORMAT_VERSION, ShardFile, shard_name
from specops.manifest import (
    MANIFEST_NAME,
    atomic_write_json,
    fingerprint,
    is_up_to_date,
    load_manifest,
    matches,
    remove_stale_temporaries,
    sha256_file,
    staleness,
    write_manifest,
)
from specops.stage import StageError, log, serve

STAGE = "extract_hidden_states"
STATE_NAME = ".extract-state.json"
DTYPES = ("bfloat16", "float16", "float32")
BACKENDS = ("auto", "fla", "torch", "any")
DEFAULTS: dict[str, Any] = {
    "drafter": None,
    "layer_ids": None,
    "capture_offsets": [0],
    "dtype": "auto",
    "device": "auto",
    # Devices to extract on (auto: every visible GPU when device is auto) and how (extract_devices).
    "devices": "auto",
    "parallel": "auto",
    "require_backend": "auto",
    "parity_samples": 0,
    # bf16 hidden states differ from an fp32 reference by 1.4-2.8% on a small model (FACTS.md);
    # the limit per layer is the larger of this and twice the noise floor measured in the same run.
    "parity_tolerance": 0.05,
    "batch_tokens": 16384,
    "shard_tokens": 32768,
    "progress_log": None,
    "writer_threads": 4,
    # Flush each shard to the device as it is written; off leaves the flushing to the OS (faster on a
    # disk slower than the extraction, but a power loss can then damage shards the manifest lists).
    "fsync": True,
    # Bytes that must stay free on the output's file system once the shards are written.
    "disk_reserve_bytes": 0,
}
REQUIRED = ("target", "completions", "out_dir")


# ----------------------------------------------------------------------------- inputs


@dataclass
class Record:
    index: int
    id: Any
    input_ids: Any  # numpy int64 [num_tokens]
    prompt_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class ShardPlan:
    number: int
    records: list[Record]
    batches: list[list[Record]]

    @property
    def name(self) -> str:
        return shard_name(self.number)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.records)


@dataclass
class TargetInfo:
    path: Path
    config: dict[str, Any]
    num_layers: int
    hidden_size: int
    vocab_size: int
    identity: dict[str, Any]


def parse_request(request: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(request) - set(DEFAULTS) - set(REQUIRED))
    if unknown:
        raise StageError(f"unknown request keys {unknown}: the keys are {sorted([*REQUIRED, *DEFAULTS])}")
    missing = [k for k in REQUIRED if not request.get(k)]
    if missing:
        raise StageError(f"missing {missing}: give the target model dir, the completions dir and out_dir")
    req = {**DEFAULTS, **{k: v for k, v in request.items() if v is not None}}
    if req["dtype"] not in ("auto", *DTYPES):
        raise StageError(f"dtype {req['dtype']!r} is not one of auto, {', '.join(DTYPES)}")
    if req["require_backend"] not in BACKENDS:
        raise StageError(f"require_backend {req['require_backend']!r} is not one of {', '.join(BACKENDS)}")
    for key in ("batch_tokens", "shard_tokens", "writer_threads"):
        if not isinstance(req[key], int) or req[key] < 1:
            raise StageError(f"{key} must be a positive integer, got {req[key]!r}")
    if not isinstance(req["disk_reserve_bytes"], int) or req["disk_reserve_bytes"] < 0:
        raise StageError(f"disk_reserve_bytes must be 0 or a positive integer, got "
                         f"{req['disk_reserve_bytes']!r}")
    if not isinstance(req["parity_samples"], int) or req["parity_samples"] < 0:
        raise StageError(f"parity_samples must be 0 (off) or a positive integer, got "
                         f"{req['parity_samples']!r}")
    offsets = req["capture_offsets"]
    if not isinstance(offsets, list) or not offsets or not all(isinstance(o, int) for o in offsets):
        raise StageError(f"capture_offsets must be a non-empty list of integers such as [0] or [-1, 0, 1], "
                         f"got {offsets!r}")
    validate_request(req)
    return req


def inspect_target(path: str | os.PathLike[str]) -> TargetInfo:
    """Read the target's config and a cheap weights fingerprint; loads no weights."""
    path = Path(path)
    if not path.is_dir():
        raise StageError(f"target model directory {path} does not exist: set target to the model directory "
                         "(config.json + *.safetensors)")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise StageError(f"{path} has no config.json: target must be a transformers model directory")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise StageError(f"{config_path} is not valid JSON ({error}): the model directory is "
                         f"damaged") from error
    text = config.get("text_config") or config
    try:
        num_layers, hidden, vocab = (int(text[k]) for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    except (KeyError, TypeError, ValueError) as error:
        raise StageError(f"{config_path} lacks num_hidden_layers/hidden_size/vocab_size: not a decoder model "
                         "config") from error
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise StageError(f"{path} has no *.safetensors weights: save the model with safe_serialization")
    identity = {
        "config_sha256": sha256_file(config_path),
        "weights": [{"name": w.name, "size": w.stat().st_size, "header_sha256": _safetensors_header_sha(w)}
                    for w in weights],
    }
    index = path / "model.safetensors.index.json"
    if index.is_file():
        identity["index_sha256"] = sha256_file(index)
    return TargetInfo(path.resolve(), config, num_layers, hidden, vocab, identity)


def _safetensors_header_sha(path: Path) -> str:
    """The header names every tensor with its dtype, shape and offsets: a cheap, strong fingerprint."""
    import hashlib
    import struct

    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise StageError(f"{path} is not a safetensors file (too short): the download is incomplete")
        (length,) = struct.unpack("<Q", raw)
        if length > path.stat().st_size:
            raise StageError(f"{path} is truncated (header says {length} bytes): download it again")
        return hashlib.sha256(raw + handle.read(length)).hexdigest()


def read_completions(directory: str | os.PathLike[str], vocab_size: int) -> list[Record]:
    directory = Path(directory)
    path = directory / "completions.jsonl" if directory.is_dir() else directory
    if not path.is_file():
        raise StageError(f"{path} does not exist: run sglang_completions first or point completions at its "
                         "output directory")
    import numpy as np

    records = []
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise StageError(f"{where} is not JSON ({error}): rerun sglang_completions, which fetches a "
                                 f"damaged file again") from error
            if not isinstance(item, dict):
                raise StageError(f"{where} is not a JSON object: regenerate the completions")
            ids = []
            for key in ("prompt_ids", "output_ids"):
                value = item.get(key)
                if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in value):
                    raise StageError(f"{where}: '{key}' must be a list of token ids: regenerate the "
                                     f"completions")
                ids.append(value)
            tokens = ids[0] + ids[1]
            if not tokens:
                raise StageError(f"{where} (id {item.get('id')!r}) has no tokens: drop it or regenerate")
            bad = [t for t in tokens if t < 0 or t >= vocab_size]
            if bad:
                raise StageError(f"{where} (id {item.get('id')!r}) has token id {bad[0]} outside the "
                                 f"target's "
                                 f"vocabulary (0-{vocab_size - 1}): the completions come from another model")
            records.append(Record(len(records), item.get("id", len(records)), np.asarray(tokens, np.int64),
                                  len(ids[0])))
    if not records:
        raise StageError(f"{path} holds no completions: run sglang_completions with some prompts")
    return records


def drafter_layer_ids(drafter: str | os.PathLike[str], num_layers: int) -> list[int]:
    path = Path(drafter) / "config.json"
    if not path.is_file():
        raise StageError(f"drafter config {path} does not exist: set drafter to the DFlash drafter directory "
                         "or give layer_ids")
    config = preflight.read_config(path, "drafter config")
    ids = (config.get("dflash_config") or {}).get("target_layer_ids")
    if not isinstance(ids, list) or not ids:
        raise StageError(f"{path} has no dflash_config.target_layer_ids: not a DFlash drafter; give "
                         f"layer_ids")
    trained_for = config.get("num_target_layers")
    if trained_for is not None and int(trained_for) != num_layers:
        raise StageError(f"the drafter was trained on a {trained_for}-layer target but the target has "
                         f"{num_layers} layers: check that target and drafter belong together")
    return [int(k) for k in ids]


def captured_layers(target_ids: Sequence[int], offsets: Sequence[int], num_layers: int) -> tuple[list[int],
                                                                                              list[int]]:
    """(captured ids, neighbours skipped as out of range); target ids themselves must be in range."""
    for k in target_ids:
        if not isinstance(k, int) or not 0 <= k < num_layers:
            raise StageError(f"target layer {k} out of range: the model has {num_layers} layers "
                             f"(0-{num_layers - 1})")
    wanted = {k + o for k in target_ids for o in offsets}
    captured = sorted(k for k in wanted if 0 <= k < num_layers)
    return captured, sorted(k for k in wanted if not 0 <= k < num_layers)


def plan_shards(records: Sequence[Record], shard_tokens: int, batch_tokens: int) -> list[ShardPlan]:
    """Longest first (an out-of-memory shows at once); shards from lengths alone, batches inside shards.

    The shard layout depends only on the records and shard_tokens, so a resumed run with another
    batch_tokens still finds its finished shards valid.
    """
    ordered = sorted(records, key=lambda r: (-r.num_tokens, r.index))
    groups: list[list[Record]] = []
    current: list[Record] = []
    tokens = 0
    for record in ordered:
        current.append(record)
        tokens += record.num_tokens
        if tokens >= shard_tokens:
            groups.append(current)
            current, tokens = [], 0
    if current:
        groups.append(current)
    shards = []
    for number, group in enumerate(groups):
        batches: list[list[Record]] = []
        for record in group:
            # Sorted longest first, so a batch's padded size is its first record's length times its size.
            if batches and (len(batches[-1]) + 1) * batches[-1][0].num_tokens <= batch_tokens:
                batches[-1].append(record)
            else:
                batches.append([record])
        shards.append(ShardPlan(number, group, batches))
    if shards and len(shards[-1].batches[-1]) > 1:
        # The last batch's write cannot overlap with compute: split it into single records so the
        # run ends on the smallest possible write.
        shards[-1].batches[-1:] = [[record] for record in shards[-1].batches[-1]]
    return shards


def resolve_device_dtype(device: str, dtype: str) -> tuple[Any, Any]:
    import torch

    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise StageError(f"device {device!r} is not a torch device: use auto, cpu, cuda or cuda:N") from error
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise StageError(f"device {device} asked for but CUDA is not available to torch "
                             f"{torch.__version__}: "
                             "install a CUDA build of torch (fla_env) or use device cpu")
        index = 0 if resolved.index is None else resolved.index
        if index >= torch.cuda.device_count():
            raise StageError(f"device {device} does not exist: this host has {torch.cuda.device_count()} "
                             f"GPUs")
        resolved = torch.device("cuda", index)
    elif resolved.type != "cpu":
        raise StageError(f"device {device!r} is not supported: use auto, cpu, cuda or cuda:N")
    if dtype == "auto":
        dtype = "bfloat16" if resolved.type == "cuda" else "float32"
    return resolved, getattr(torch, dtype)


def resolve_require(require: str, device: Any) -> str:
    if require == "auto":
        return "fla" if device.type == "cuda" else "any"
    return require


def describe_device(device: Any) -> str:
    if device.type == "cuda":
        import torch

        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"


def library_versions() -> dict[str, str | None]:
    from importlib import metadata

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "safetensors", "triton", "fla-core", "flash-linear-attention",
                 "causal-conv1d", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@dataclass
class Prepared:
    req: dict[str, Any]
    target: TargetInfo
    records: list[Record]
    target_layer_ids: list[int]
    layer_ids: list[int]
    skipped_layer_ids: list[int]
    device: Any
    dtype: Any
    require: str
    out_dir: Path
    shards: list[ShardPlan]
    inputs: dict[str, Any]
    completions_path: Path = field(default_factory=Path)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def bytes_per_token(self) -> int:
        return len(self.layer_ids) * self.target.hidden_size * self.dtype.itemsize + 8


def drafter_list(value: Any) -> list[str]:
    """The request's drafter: one path, a list of them, or none."""
    if not value:
        return []
    return [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]


def prepare(request: dict[str, Any]) -> Prepared:
    """Validate everything and fingerprint the inputs; loads no model."""
    req = parse_request(request)
    target = inspect_target(req["target"])
    completions_dir = Path(req["completions"])
    records = read_completions(completions_dir, target.vocab_size)
    completions_path = completions_dir / "completions.jsonl" if completions_dir.is_dir() else completions_dir
    preflight.check_completions_file(completions_path)
    if req["layer_ids"] is not None:
        if not isinstance(req["layer_ids"], list) or not req["layer_ids"]:
            raise StageError(f"layer_ids must be a non-empty list of layer ids, got {req['layer_ids']!r}")
        target_ids = list(req["layer_ids"])
    elif req["drafter"]:
        # Several drafters (checkpoints, rivals) share one window: capture the union of their layers.
        target_ids = list(dict.fromkeys(k for d in drafter_list(req["drafter"])
                                        for k in drafter_layer_ids(d, target.num_layers)))
    else:
        raise StageError("no layer ids: give drafter (its dflash_config.target_layer_ids are used) or "
                         "layer_ids")
    layer_ids, skipped = captured_layers(target_ids, req["capture_offsets"], target.num_layers)
    device, dtype = resolve_device_dtype(first_device(req), req["dtype"])
    require = resolve_require(req["require_backend"], device)
    for drafter in drafter_list(req["drafter"]):
        preflight.check_drafter(drafter, target.path, target.vocab_size)
    inputs = {
        "format_version": FORMAT_VERSION,
        "target": target.identity,
        # What the extraction reads, not the file: a refetch with the same tokens changes nothing.
        "completions": {"tokens_sha256": tokens_fingerprint(records)},
        "layer_ids": layer_ids,
        "dtype": str(dtype).removeprefix("torch."),
        "device_type": device.type,
        "require_backend": require,
        "shard_tokens": req["shard_tokens"],
    }
    shards = plan_shards(records, req["shard_tokens"], req["batch_tokens"])
    return Prepared(req, target, records, target_ids, layer_ids, skipped, device, dtype, require,
                    Path(req["out_dir"]), shards, inputs, completions_path)


def tokens_fingerprint(records: Sequence[Record]) -> str:
    """sha256 of every record's id, prompt length and token ids, in file order."""
    import hashlib

    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps([record.id, record.prompt_tokens, record.num_tokens]).encode())
        digest.update(record.input_ids.tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------- resume state


class ResumeState:
    """Which shards of this exact input set are already on disk; updated after every shard."""

    def __init__(self, out_dir: Path, inputs_fingerprint: str):
        self.path = out_dir / STATE_NAME
        self.fingerprint = inputs_fingerprint
        self.shards: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, out_dir: Path, inputs_fingerprint: str, planned: Sequence[str]) -> ResumeState:
        """Keep finished shards of the same inputs; delete everything else a previous run left."""
        state = cls(out_dir, inputs_fingerprint)
        try:
            saved = json.loads(state.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            saved = {}
        finished = load_manifest(out_dir) or {}
        for source in (finished, saved):
            if source.get("inputs_fingerprint") != inputs_fingerprint:
                continue
            for name, digest in (source.get("files") or source.get("shards") or {}).items():
                path = out_dir / name
                if name in planned and name not in state.shards and path.is_file():
                    if matches(path, digest):
                        state.shards[name] = digest
                    else:
                        log(f"{path} does not match its recorded sha256: extracting it again")
        remove_stale_temporaries(out_dir)
        (out_dir / MANIFEST_NAME).unlink(missing_ok=True)  # it describes older outputs now
        for stale in out_dir.glob("shard-*.safetensors"):
            if stale.name not in state.shards:
                stale.unlink()
        state.save()
        return state

    def add(self, name: str, digest: dict[str, Any]) -> None:
        with self._lock:
            self.shards[name] = digest
            self.save()

    def save(self) -> None:
        atomic_write_json(self.path, {"inputs_fingerprint": self.fingerprint, "shards": self.shards})

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- progress


class Progress:
    """tokens done / total and tokens per second, to a log file and stderr, at most every `interval` s."""

    def __init__(self, path: Path | None, total: int, done: int = 0, interval: float = 2.0,
                 echo: Callable[[str], None] | None = log):
        self.path, self.total, self.done, self.resumed = path, total, done, done
        self.interval, self.echo = interval, echo
        self.start = time.monotonic()
        self._last = 0.0
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{_now()} start: {total} tokens to extract, {done} already done\n")

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self.start
        return (self.done - self.resumed) / elapsed if elapsed > 0 else 0.0

    def advance(self, tokens: int, force: bool = False) -> None:
        self.done += tokens
        now = time.monotonic()
        if force or now - self._last >= self.interval or self.done >= self.total:
            self._last = now
            self.write(self.line())

    def line(self) -> str:
        rate = self.rate
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        percent = 100.0 * self.done / self.total if self.total else 100.0
        return (f"tokens {self.done}/{self.total} ({percent:.1f}%) {rate:.0f} tok/s "
                f"elapsed {time.monotonic() - self.start:.1f}s eta {eta:.0f}s")

    def write(self, message: str) -> None:
        if self.path:
            with open(self.path, "a") as handle:
                handle.write(f"{_now()} {message}\n")
        if self.echo:
            self.echo(message)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


# ----------------------------------------------------------------------------- capture


class _StopForward(Exception):
    """Raised by the hook of the last captured layer: nothing after it needs to run."""


def decoder_body(model: Any) -> tuple[Any, Any]:
    """(the module whose forward runs the decoder layers, its ModuleList of layers)."""
    import torch

    inner = getattr(model, "model", None)
    for body in (getattr(inner, "language_model", None), inner, model):
        if body is not None and isinstance(getattr(body, "layers", None), torch.nn.ModuleList):
            return body, body.layers
    raise StageError(f"cannot find the decoder layers of {type(model).__name__}: not a decoder-only model")


# Layer types for which "no mask" is exactly what transformers builds for a batch without padding: causal
# attention (sdpa's is_causal) and linear attention without a padding mask. Sliding windows need theirs.
_MASK_FREE_LAYER_TYPES = frozenset({"full_attention", "linear_attention"})


def unpadded_mask_mapping(body: Any) -> dict[str, None] | None:
    """The per-layer-type masks of an unpadded batch, {type: None}, when the body accepts such a mapping.

    Given a 2D mask or none, transformers builds the masks itself and, looking for packed sequences in
    the position ids, reads a device value back (`.all()` in masking_utils): the host then waits for the
    device at every forward, and the device for the host while the next kernels are launched. For an
    unpadded batch those masks are all None anyway; handing them over skips the read-back.
    """
    import inspect

    layer_types = getattr(body.config, "layer_types", None)
    if not layer_types or not set(layer_types) <= _MASK_FREE_LAYER_TYPES:
        return None
    try:
        source = inspect.getsource(type(body).forward)
    except (OSError, TypeError):
        return None
    if "isinstance(causal_mask_mapping := attention_mask, dict)" not in source:
        return None
    return {layer_type: None for layer_type in sorted(set(layer_types))}


class LayerCapture:
    """Forward hooks on the captured layers; returns their outputs in layer_ids order.

    `skip_mask_creation` hands unpadded batches their (empty) masks directly where the model allows it
    (`unpadded_mask_mapping`); the states are the same either way.
    """

    def __init__(self, model: Any, layer_ids: Sequence[int], skip_mask_creation: bool = True):
        self.body, layers = decoder_body(model)
        if max(layer_ids) >= len(layers):
            raise StageError(f"target layer {max(layer_ids)} out of range: the model has {len(layers)} "
                             f"layers "
                             f"(0-{len(layers) - 1})")
        self.layer_ids = list(layer_ids)
        self.last = max(layer_ids)
        # The residual stream, hence every captured state, has the embeddings' dtype.
        self.dtype = self.body.get_input_embeddings().weight.dtype
        self.hidden_size = int(self.body.config.hidden_size)
        self._outputs: dict[int, Any] = {}
        self._no_padding_masks = unpadded_mask_mapping(self.body) if skip_mask_creation else None
        self._handles = [layers[k].register_forward_hook(self._hook(k)) for k in sorted(set(layer_ids))]

    def _hook(self, k: int) -> Callable:
        def hook(module, args, output):
            self._outputs[k] = output[0] if isinstance(output, tuple) else output
            if k == self.last:
                raise _StopForward

        return hook

    def __call__(self, input_ids: Any, attention_mask: Any = None) -> list[Any]:
        import torch

        self._outputs = {}
        if attention_mask is None and self._no_padding_masks is not None:
            attention_mask = dict(self._no_padding_masks)
        try:
            with torch.inference_mode():
                self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        outputs, self._outputs = self._outputs, {}
        return [outputs[k] for k in self.layer_ids]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> LayerCapture:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def pad_batch(batch: Sequence[Record]) -> tuple[Any, Any]:
    """Right-padded int64 ids [B, T] and a mask, or None for the mask when every record is as long."""
    import torch

    width = max(r.num_tokens for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.int64)
    mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, record in enumerate(batch):
        ids[row, : record.num_tokens] = torch.from_numpy(record.input_ids)
        mask[row, : record.num_tokens] = 1
    return ids, (None if bool(mask.all()) else mask)


# ----------------------------------------------------------------------------- writing


@dataclass
class BatchResult:
    records: list[Record]
    ids: Any  # int64 [B, T] on the host
    states: Any  # [B, T, n_layers, hidden] on the host (pinned on CUDA)
    ready: Any  # a CUDA event the writer waits on, or None
    release: Callable[[], None] = lambda: None  # gives the pinned buffer back once written


class ShardWriter:
    """Writes batches into their shards on writer threads while the device computes the next ones.

    Each shard belongs to one lane (a single thread), so its pieces land in order; lanes run in
    parallel. At most `pending` batches wait in host memory: the device only waits for the disk
    when the disk is slower than the device.
    """

    def __init__(self, out_dir: Path, threads: int, on_written: Callable[[str, dict], None],
                 metadata: dict[str, str], layout: Callable[[ShardPlan], list], fsync: bool = True,
                 pending: int | None = None):
        self.out_dir, self.on_written, self.metadata, self.layout = out_dir, on_written, metadata, layout
        self.fsync = fsync
        self.lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shard-writer-{n}")
                      for n in range(threads)]
        self.hashers = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shard-hasher-{n}")
                        for n in range(threads)]
        self.slots = threading.BoundedSemaphore(pending or 2 * threads + 2)
        self.futures: list[Future] = []
        self.files: dict[str, ShardFile] = {}
        self.times = {"blocked_s": 0.0, "event_wait_s": 0.0, "write_s": 0.0, "finish_s": 0.0}
        self._lock = threading.Lock()

    def submit(self, shard: ShardPlan, part: BatchResult, last: bool) -> None:
        self.raise_failures()
        started = time.perf_counter()
        self.slots.acquire()
        self.times["blocked_s"] += time.perf_counter() - started
        lane = shard.number % len(self.lanes)
        future = self.lanes[lane].submit(self._append, shard, part, last, self.hashers[lane])
        future.add_done_callback(lambda _: self.slots.release())
        self.futures.append(future)

    def _append(self, shard: ShardPlan, part: BatchResult, last: bool, hasher: ThreadPoolExecutor) -> None:
        started = time.perf_counter()
        if part.ready is not None:
            part.ready.synchronize()
        waited = time.perf_counter()
        try:
            if shard.name not in self.files:
                self.files[shard.name] = ShardFile(self.out_dir / shard.name, self.layout(shard),
                                                   self.metadata, self.fsync)
            handle = self.files[shard.name]
            items = []
            for row, record in enumerate(part.records):
                items.append((f"{record.index}.input_ids", part.ids[row, : record.num_tokens]))
                items.append((f"{record.index}.hidden_states", part.states[row, : record.num_tokens]))
            handle.write_many(items, hasher)
            if not last:
                handle.flush()
            written = time.perf_counter()
            if last:
                digest = self.files.pop(shard.name).finish()
                self.on_written(shard.name, digest)
        except BaseException:
            broken = self.files.pop(shard.name, None)
            if broken is not None:
                broken.abort()
            raise
        finally:
            part.release()
        done = time.perf_counter()
        with self._lock:
            self.times["event_wait_s"] += waited - started
            self.times["write_s"] += written - waited
            self.times["finish_s"] += done - written

    def raise_failures(self) -> None:
        """Raise the first failed write; forget the finished ones, so a long run does not rescan them."""
        pending = []
        for future in self.futures:
            if not future.done():
                pending.append(future)
            elif future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        self.futures = pending

    def finish(self) -> None:
        for future in self.futures:
            future.result()

    def close(self) -> None:
        for lane in self.lanes:
            lane.shutdown(wait=True, cancel_futures=True)
        for hasher in self.hashers:
            hasher.shutdown(wait=True)
        for handle in self.files.values():  # shards a failure left half written
            handle.abort()
        self.files.clear()


class HostCopier:
    """Device -> pinned host copies on a side stream, so they overlap with the next batch's compute.

    Pinned buffers come from a pool of `buffers`, allocated once: allocating pinned memory
    synchronises the device, and a batch waits here when every buffer is still being written.
    """

    def __init__(self, device: Any, buffers: int, batch_bytes: int = 0):
        import torch

        self.device, self.limit, self.batch_bytes = device, buffers, batch_bytes
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.free: queue.Queue = queue.Queue()
        self.allocated = 0
        self.waited_s = 0.0

    def __call__(self, states: Any) -> tuple[Any, Any, Callable[[], None]]:
        import torch

        if self.stream is None:
            return states, None, lambda: None
        nbytes = states.numel() * states.element_size()
        buffer = self._take(nbytes)
        host = buffer[:nbytes].view(states.dtype).view(states.shape)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(states, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        states.record_stream(self.stream)  # keep the device buffer alive until the copy has run
        return host, ready, lambda: self.free.put(buffer)

    def _take(self, nbytes: int) -> Any:
        import torch

        while True:
            try:
                buffer = self.free.get_nowait()
            except queue.Empty:
                if self.allocated < self.limit:
                    self.allocated += 1
                    return torch.empty(max(nbytes, self.batch_bytes), dtype=torch.uint8, pin_memory=True)
                started = time.perf_counter()
                buffer = self.free.get()
                self.waited_s += time.perf_counter() - started
            if buffer.numel() >= nbytes:
                return buffer
            self.allocated -= 1  # too small for this batch: let it go and allocate a larger one


class DeviceTimer:
    """CUDA events around each batch's forward: device busy time against the span, i.e. the bubbles.

    Recording events costs microseconds and never waits; finished pairs are read as the run goes (a
    non-blocking query), so a long run keeps only the events still in flight.
    """

    def __init__(self, device: Any):
        self.device = device if device.type == "cuda" else None
        self.pending: deque[tuple[Any, Any]] = deque()
        self.first: Any = None
        self.last: Any = None
        self.busy_ms = 0.0

    def _record(self) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def begin(self) -> None:
        if self.device is not None:
            self.pending.append((self._record(), None))
            if self.first is None:
                self.first = self.pending[-1][0]

    def end(self) -> None:
        if self.device is None:
            return
        self.last = self._record()
        self.pending[-1] = (self.pending[-1][0], self.last)
        while self.pending and self.pending[0][1] is not None and self.pending[0][1].query():
            self._count(self.pending.popleft())

    def _count(self, pair: tuple[Any, Any]) -> None:
        self.busy_ms += pair[0].elapsed_time(pair[1])

    def synchronize(self) -> None:
        if self.device is not None:
            import torch

            torch.cuda.synchronize(self.device)

    def summary(self) -> dict[str, float]:
        """device_busy_s (sum of the forwards) and device_span_s (first start to last end); {} on CPU."""
        if self.first is None or self.last is None:
            return {}
        self.synchronize()
        while self.pending:
            self._count(self.pending.popleft())
        span_ms = self.first.elapsed_time(self.last)
        return {"device_busy_s": self.busy_ms / 1e3, "device_span_s": span_ms / 1e3}


# ----------------------------------------------------------------------------- extraction


@dataclass
class ExtractionSettings:
    layer_ids: list[int]
    device: Any
    require: str = "any"  # fla | torch | any: checked on what actually ran
    writer_threads: int = 4
    fsync: bool = True
    progress_log: Path | None = None
    echo: Callable[[str], None] | None = log
    copier: HostCopier | None = None  # reuse one across runs to keep its pinned buffers


def check_backend(require: str, used: dict[str, str]) -> None:
    ran = used.get("gated_delta_rule", NOT_USED)
    if ran == NOT_USED or require == "any" or ran == require:
        return
    if require == "fla":
        raise StageError(
            f"the gated-delta-rule ran with the {ran} implementation, but require_backend is fla: install "
            f"flash-linear-attention (fla-core) with triton in the ML environment ({sys.executable}) on a "
            f"GPU "
            "host (fla_env), or set require_backend: any to accept the slow reference path")
    raise StageError(f"the gated-delta-rule ran with {ran}, but require_backend is {require}")


def extract_shards(capture: LayerCapture, shards: Sequence[ShardPlan], out_dir: Path, state: ResumeState,
                   settings: ExtractionSettings, monitor: BackendMonitor | None = None) -> dict[str, Any]:
    """Run every shard not already in `state`; returns timings. The model must already be loaded."""
    import torch

    todo = [s for s in shards if s.name not in state.shards]
    total = sum(s.num_tokens for s in shards)
    progress = Progress(settings.progress_log, total, total - sum(s.num_tokens for s in todo),
                        echo=settings.echo)
    pending = 2 * settings.writer_threads + 2
    batch_bytes = max(len(b) * max(r.num_tokens for r in b) for s in todo for b in s.batches) if todo else 0
    copier = settings.copier or HostCopier(settings.device, pending,
                                           batch_bytes * len(settings.layer_ids) * capture.hidden_size
                                           * capture.dtype.itemsize)
    metadata = {"format": "specops.hidden_states", "format_version": str(FORMAT_VERSION),
                "layer_ids": json.dumps(settings.layer_ids)}
    dtype_name = str(capture.dtype).removeprefix("torch.")
    n_layers, hidden = len(settings.layer_ids), capture.hidden_size

    def layout(shard: ShardPlan) -> list:
        return [entry for batch in shard.batches for r in batch
                for entry in ((f"{r.index}.input_ids", "int64", (r.num_tokens,)),
                              (f"{r.index}.hidden_states", dtype_name, (r.num_tokens, n_layers, hidden)))]

    writer = ShardWriter(out_dir, settings.writer_threads, state.add, metadata, layout, settings.fsync,
                         pending)
    times = {"forward_s": 0.0, "copy_issue_s": 0.0}
    checked = monitor is None
    waited_before = copier.waited_s
    device_timer = DeviceTimer(settings.device)
    started = time.perf_counter()
    try:
        for shard in todo:
            for number, batch in enumerate(shard.batches):
                ids, mask = pad_batch(batch)
                if settings.device.type == "cuda":
                    # From pageable memory the copy would wait for the device to drain: a bubble per batch.
                    ids, mask = ids.pin_memory(), (None if mask is None else mask.pin_memory())
                t0 = time.perf_counter()
                device_timer.begin()
                device_ids = ids.to(settings.device, non_blocking=True)
                device_mask = None if mask is None else mask.to(settings.device, non_blocking=True)
                outputs = capture(device_ids, device_mask)
                stacked = torch.stack(outputs, dim=2).to(capture.dtype)  # [B, T, n_layers, hidden]
                del outputs
                device_timer.end()
                t1 = time.perf_counter()
                host, ready, release = copier(stacked)
                del stacked
                times["forward_s"] += t1 - t0
                times["copy_issue_s"] += time.perf_counter() - t1
                if not checked:  # after the first forward, before anything reaches the disk
                    check_backend(settings.require, monitor.summary())
                    checked = True
                writer.submit(shard, BatchResult(batch, ids, host, ready, release),
                              last=number == len(shard.batches) - 1)
                progress.advance(sum(r.num_tokens for r in batch))
        device_timer.synchronize()  # what is left after this is the writers' alone
        loop_done = time.perf_counter()
        writer.finish()
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise StageError(f"no space left on the device of {out_dir}: free space or choose another "
                             f"out_dir; "
                             "finished shards are kept and a rerun resumes") from error
        raise
    finally:
        writer.close()
    finished = time.perf_counter()
    progress.write(progress.line() + " done")
    return {
        **times,
        **writer.times,
        **device_timer.summary(),
        "blocked_on_host_buffers_s": copier.waited_s - waited_before,
        "loop_s": loop_done - started,
        "drain_s": finished - loop_done,
        "total_s": finished - started,
        "tokens": sum(s.num_tokens for s in todo),
        "tokens_resumed": progress.resumed,
        "shards_written": len(todo),
        "shards_resumed": len(shards) - len(todo),
        "tokens_per_second": sum(s.num_tokens for s in todo) / (finished - started) if todo else 0.0,
    }


# ----------------------------------------------------------------------------- parity


@contextmanager
def parameters_as(module: Any, dtype: Any,
                  skip: Callable[[str], bool] = lambda name: False) -> Iterator[None]:
    """Temporarily cast floating parameters; bf16/fp16 -> fp32 -> back is exact, so nothing is lost."""
    changed = []
    try:
        for name, parameter in module.named_parameters():
            if parameter.is_floating_point() and parameter.dtype != dtype and not skip(name):
                changed.append((parameter, parameter.dtype))
                parameter.data = parameter.data.to(dtype)
        yield
    finally:
        for parameter, original in changed:
            parameter.data = parameter.data.to(original)


def _errors(candidate: Any, reference: Any) -> tuple[float, float]:
    """(cosine similarity, relative error ||a-b||/||b||) over all tokens and features, in float64."""
    a, b = candidate.double().flatten(), reference.double().flatten()
    cosine = float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))
    return cosine, float((a - b).norm() / b.norm().clamp_min(1e-300))


def parity_probe(capture: LayerCapture, records: Sequence[Record], samples: int, device: Any, dtype: Any,
                 modeling: Any, tolerance: float) -> dict[str, Any]:
    """Compare the running backend with the torch reference in fp32 on a few records, layer by layer.

    The bf16 noise floor (the torch reference in the run's dtype against fp32) is measured on the same
    records; a layer fails when its error exceeds max(tolerance, 2 x floor).
    """
    import torch

    step = max(1, len(records) // samples)
    chosen = list(records)[::step][:samples]
    last = capture.last
    beyond_last = lambda name: name.startswith("layers.") and int(name.split(".")[1]) > last  # noqa: E731
    sums: dict[str, list[list[float]]] = {"primary": [], "floor": []}
    started = time.perf_counter()
    for record in chosen:
        ids = torch.from_numpy(record.input_ids)[None].to(device)
        primary = [t.float() for t in capture(ids)]
        floor = None
        if dtype != torch.float32:
            with BackendMonitor(modeling, force_torch=True):
                floor = [t.float() for t in capture(ids)]
        with BackendMonitor(modeling, force_torch=True), \
                parameters_as(capture.body, torch.float32, beyond_last):
            reference = capture(ids)
        sums["primary"].append([_errors(p, r) for p, r in zip(primary, reference, strict=True)])
        if floor is not None:
            sums["floor"].append([_errors(f, r) for f, r in zip(floor, reference, strict=True)])
        del primary, floor, reference
    layers = []
    for column, layer in enumerate(capture.layer_ids):
        cosine = min(s[column][0] for s in sums["primary"])
        error = max(s[column][1] for s in sums["primary"])
        floor_error = max((s[column][1] for s in sums["floor"]), default=0.0)
        limit = max(tolerance, 2.0 * floor_error)
        layers.append({"layer": layer, "cosine": cosine, "rel_error": error,
                       "noise_floor_rel_error": floor_error, "limit": limit, "passed": error <= limit})
    return {
        "samples": len(chosen),
        "tokens": sum(r.num_tokens for r in chosen),
        "reference": "torch fallback, float32",
        "noise_floor": f"torch fallback, {str(dtype).removeprefix('torch.')}" if sums["floor"] else None,
        "tolerance": tolerance,
        "layers": layers,
        "passed": all(layer["passed"] for layer in layers),
        "seconds": time.perf_counter() - started,
    }


# ----------------------------------------------------------------------------- stage


def disk_check(prep: Prepared, todo: Sequence[ShardPlan]) -> int:
    """Refuse an extraction whose shards would not fit; returns the bytes they need."""
    needed = preflight.shard_bytes(sum(s.num_tokens for s in todo), sum(len(s.records) for s in todo),
                                   len(todo), prep.bytes_per_token)
    preflight.check_disk(prep.out_dir, needed, prep.req["disk_reserve_bytes"])
    return needed


def backend_plan(prep: Prepared, modeling: Any) -> bool:
    """Fail before loading weights when the run cannot satisfy require_backend; returns force_torch."""
    planned = planned_backends(modeling) if modeling is not None else {}
    force_torch = prep.require == "torch"
    kernels = sorted({label for label in planned.values() if label not in ("torch", NOT_USED)})
    if prep.device.type == "cpu" and kernels and not force_torch:
        raise StageError(
            f"{', '.join(kernels)} is installed in {sys.executable}, whose kernels need a CUDA GPU, and the "
            "device is cpu: transformers would call them and crash. Run on a GPU host, or set "
            "require_backend: torch to use the PyTorch reference implementation on the CPU (slow)")
    if prep.require == "fla" and planned.get("gated_delta_rule", NOT_USED) not in ("fla", NOT_USED):
        raise StageError(
            f"require_backend is fla but transformers will use the torch fallback for the gated delta "
            f"rule: fla "
            f"does not import in {sys.executable}; install flash-linear-attention and fla-core (fla_env), or "
            "set require_backend: any")
    return force_torch


def load_model(prep: Prepared) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(prep.target.path), dtype=prep.dtype,
            device_map=str(prep.device) if prep.device.type == "cuda" else None)
    except (OSError, ValueError) as error:
        raise StageError(f"cannot load the target from {prep.target.path}: {error}") from error
    return model.eval()


def finish_manifest(out_dir: Path, shards: Sequence[ShardPlan], state: ResumeState, inputs: dict[str, Any],
                    **extra: Any) -> dict[str, Any]:
    records = sorted(
        ({"id": r.id, "index": r.index, "shard": s.name, "num_tokens": r.num_tokens,
          "prompt_tokens": r.prompt_tokens} for s in shards for r in s.records),
        key=lambda r: r["index"])
    names = [s.name for s in shards]
    manifest = write_manifest(
        out_dir, STAGE, inputs, names, digests={n: state.shards[n] for n in names if n in state.shards},
        records=records,
        num_records=len(records),
        num_tokens=sum(r["num_tokens"] for r in records),
        prompt_tokens=sum(r["prompt_tokens"] for r in records),
        output_tokens=sum(r["num_tokens"] - r["prompt_tokens"] for r in records),
        **extra)
    state.remove()
    return manifest


def _summary(manifest: dict[str, Any], out_dir: Path, changed: bool) -> dict[str, Any]:
    return {
        "changed": changed,
        "out_dir": str(out_dir),
        "manifest": str(out_dir / MANIFEST_NAME),
        "layer_ids": manifest.get("layer_ids"),
        "records": manifest.get("num_records"),
        "tokens": manifest.get("num_tokens"),
        "shards": sorted(manifest.get("files", {})),
        "backend": manifest.get("backend"),
        "parity": manifest.get("parity"),
        "progress": manifest.get("progress"),
        "parallel": manifest.get("parallel"),
    }


def plan(request: dict[str, Any]) -> dict[str, Any]:
    prep = prepare(request)
    fp = fingerprint(prep.inputs)
    reason = staleness(prep.out_dir, fp)
    if reason is None:
        return {**_summary(load_manifest(prep.out_dir) or {}, prep.out_dir, changed=False),
                "estimated_seconds": 0.0}
    resumable = resumable_shards(prep, fp)
    # What the run would refuse after the service is down, refused now.
    from transformers import AutoConfig

    backend_plan(prep, modeling_module_for(AutoConfig.from_pretrained(str(prep.target.path))))
    todo = [s for s in prep.shards if s.name not in resumable]
    needed = disk_check(prep, todo)
    return {
        "changed": True,
        "reason": reason,
        "out_dir": str(prep.out_dir),
        "layer_ids": prep.layer_ids,
        "records": len(prep.records),
        "tokens": sum(r.num_tokens for r in prep.records),
        "shards": [s.name for s in prep.shards],
        "resumable_shards": resumable,
        "device": str(prep.device),
        "dtype": prep.dtype_name,
        "require_backend": prep.require,
        "parallel": plan_for(prep, free=False).describe(),  # at run time the choice uses free memory
        "estimated_bytes": needed,
        "estimated_seconds": round(estimated_seconds(prep, todo, needed), 1),
    }


def resumable_shards(prep: Prepared, fp: str) -> list[str]:
    """Shards a run would keep: recorded for these inputs (resume state or manifest) and intact."""
    kept = []
    for source in (load_manifest(prep.out_dir) or {}, _read_json(prep.out_dir / STATE_NAME)):
        if source.get("inputs_fingerprint") != fp:
            continue
        for name, digest in (source.get("files") or source.get("shards") or {}).items():
            path = prep.out_dir / name
            if name not in kept and matches(path, digest):
                kept.append(name)
    return sorted(kept)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def estimated_seconds(prep: Prepared, todo: Sequence[ShardPlan], write_bytes: int) -> float:
    """A pessimistic duration of the run (preflight.estimate_seconds), for the window's guard."""
    weights = sum(w["size"] for w in prep.target.identity["weights"])
    text = prep.target.config.get("text_config") or prep.target.config
    stored = str(text.get("dtype") or text.get("torch_dtype") or prep.target.config.get("dtype")
                 or prep.target.config.get("torch_dtype") or "bfloat16")
    itemsize = 4 if stored == "float32" else 2
    samples = prep.records[:: max(1, len(prep.records) // max(prep.req["parity_samples"], 1))]
    parity_tokens = sum(r.num_tokens for r in samples[: prep.req["parity_samples"]])
    return preflight.estimate_seconds(
        prep.device.type, weights, itemsize, max(prep.layer_ids) + 1, prep.target.num_layers,
        sum(s.num_tokens for s in todo), sum(len(s.batches) for s in todo), parity_tokens, write_bytes)


def run(request: dict[str, Any]) -> dict[str, Any]:
    prep = prepare(request)
    fp = fingerprint(prep.inputs)
    if is_up_to_date(prep.out_dir, fp):
        log(f"{prep.out_dir} is up to date: nothing to extract")
        return _summary(load_manifest(prep.out_dir) or {}, prep.out_dir, changed=False)
    from transformers import AutoConfig

    modeling = modeling_module_for(AutoConfig.from_pretrained(str(prep.target.path)))
    force_torch = backend_plan(prep, modeling)
    prep.out_dir.mkdir(parents=True, exist_ok=True)
    state = ResumeState.open(prep.out_dir, fp, [s.name for s in prep.shards])
    disk_check(prep, [s for s in prep.shards if s.name not in state.shards])
    progress_log = Path(prep.req["progress_log"] or prep.out_dir / "progress.log")
    devices = plan_for(prep)
    if devices.mode != "single":
        from specops.extract_parallel import run_on_devices

        return run_on_devices(prep, devices, state, progress_log, force_torch)
    prep.device = resolve_device_dtype(devices.devices[0], prep.dtype_name)[0]
    started = time.perf_counter()
    model = load_model(prep)
    load_s = time.perf_counter() - started
    log(f"loaded {prep.target.path} in {load_s:.1f}s on {prep.device} ({prep.dtype_name}); "
        f"capturing layers {prep.layer_ids}")
    modeling = sys.modules.get(type(decoder_body(model)[1][0]).__module__, modeling)
    settings = ExtractionSettings(prep.layer_ids, prep.device, prep.require, prep.req["writer_threads"],
                                  fsync=bool(prep.req["fsync"]), progress_log=progress_log)
    parity = None
    with BackendMonitor(modeling, force_torch=force_torch) as monitor, \
            LayerCapture(model, prep.layer_ids) as cap:
        if prep.req["parity_samples"]:
            parity = parity_probe(cap, prep.records, prep.req["parity_samples"], prep.device, prep.dtype,
                                  modeling, prep.req["parity_tolerance"])
            check_backend(prep.require, monitor.summary())
            worst = max(parity["layers"], key=lambda layer: layer["rel_error"] / layer["limit"])
            log(f"parity: worst layer {worst['layer']} rel error {worst['rel_error']:.4f} "
                f"(limit {worst['limit']:.4f}), cosine {worst['cosine']:.5f}")
            if not parity["passed"]:
                raise StageError(
                    f"parity probe failed: layer {worst['layer']} differs from the fp32 torch reference by "
                    f"{worst['rel_error']:.1%} (limit {worst['limit']:.1%}, bf16 noise floor "
                    f"{worst['noise_floor_rel_error']:.1%}): the {monitor.summary()['gated_delta_rule']} "
                    "implementation gives wrong hidden states; check the fla/transformers versions")
        stats = extract_shards(cap, prep.shards, prep.out_dir, state, settings, monitor)
        used = monitor.summary()
    check_backend(prep.require, used)
    backend = {**used, "device": describe_device(prep.device), "dtype": prep.dtype_name,
               "required": prep.require, "forced_torch": force_torch}
    manifest = finish_manifest(
        prep.out_dir, prep.shards, state, prep.inputs,
        layer_ids=prep.layer_ids, target_layer_ids=prep.target_layer_ids,
        capture_offsets=prep.req["capture_offsets"], skipped_layer_ids=prep.skipped_layer_ids,
        dtype=prep.dtype_name, hidden_size=prep.target.hidden_size, num_layers=prep.target.num_layers,
        target={"path": str(prep.target.path), **prep.target.identity},
        completions={"path": str(prep.completions_path.resolve()), **prep.inputs["completions"]},
        backend=backend, versions=library_versions(), parity=parity,
        progress={**{k: round(v, 3) if isinstance(v, float) else v for k, v in stats.items()},
                  "load_s": round(load_s, 3)},
        parallel=devices.describe())
    log(f"wrote {len(prep.shards)} shards to {prep.out_dir} ({stats['tokens_per_second']:.0f} tok/s)")
    return _summary(manifest, prep.out_dir, changed=True)


def main(argv: list[str] | None = None) -> int:
    return serve("extract", plan, run, argv)


if __name__ == "__main__":
    sys.exit(main())
