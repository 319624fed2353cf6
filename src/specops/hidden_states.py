"""The on-disk hidden-state format: safetensors shards plus a manifest, and the reader the scorer uses.

A shard holds, per record r (its index in completions.jsonl): `"{r}.input_ids"` int64 [seq_len] and
`"{r}.hidden_states"` [seq_len, n_layers, hidden]. The writer streams tensors straight from memory
into the file while hashing them, so a shard costs one pass over its bytes and no extra copies.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from specops.manifest import MANIFEST_NAME, sha256_file

SHARD_PATTERN = "shard-{:05d}.safetensors"
FORMAT_VERSION = 1

_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "int64": "I64"}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8}


class HiddenStatesError(Exception):
    """A hidden-state directory that cannot be used as it is; the message says what to rerun."""


def shard_name(number: int) -> str:
    return SHARD_PATTERN.format(number)


class ShardFile:
    """A safetensors shard written in pieces, in the order its header lists the tensors.

    The header is written first from the shapes alone, then each piece's bytes go from tensor memory
    to the file (no serialisation copy), hashed on the way, and optionally flushed to the device
    (`fsync`), so finishing the shard costs only its last piece. The file appears under its name
    only when complete (temporary name, fsync, rename).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layout: Sequence[tuple[str, str, Sequence[int]]],
        metadata: dict[str, str] | None = None,
        fsync: bool = True,
    ):
        self.path, self.fsync = Path(path), fsync
        header: dict[str, Any] = {}
        offset = 0
        self._expected: list[tuple[str, int]] = []
        for name, dtype, shape in layout:
            nbytes = _ITEMSIZE[dtype] * _numel(shape)
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._expected.append((name, nbytes))
            offset += nbytes
        if metadata:
            header["__metadata__"] = metadata
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        prefix = struct.pack("<Q", len(encoded)) + encoded
        self.size = len(prefix) + offset
        self._next = 0
        self._digest = hashlib.sha256(prefix)
        fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            self._handle = os.fdopen(fd, "wb", buffering=0)
            self._write(prefix)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: Any) -> None:
        """Append the next tensor of the layout (torch, contiguous or not)."""
        self.write_many([(name, tensor)])

    def write_many(self, items: Sequence[tuple[str, Any]], hasher: Any = None) -> None:
        """Append the next tensors of the layout; with `hasher` (a one-thread executor) the checksum is
        computed beside the write instead of before it, which nearly halves the time per byte."""
        views = []
        for name, tensor in items:
            expected, nbytes = self._expected[self._next]
            got = tensor.numel() * tensor.element_size()
            if name != expected or got != nbytes:
                raise ValueError(
                    f"{self.path.name}: got {name} ({got} bytes), the layout expects {expected} "
                    f"({nbytes} bytes) next"
                )
            self._next += 1
            if nbytes:
                views.append(memoryview(_byte_view(tensor)))
        if hasher is None:
            for view in views:
                self._digest.update(view)
                self._write(view)
            return

        def digest() -> None:
            for view in views:
                self._digest.update(view)

        hashed = hasher.submit(digest)
        try:
            for view in views:
                self._write(view)
        finally:
            hashed.result()

    def flush(self) -> None:
        """Push what is written so far to the device, so the final fsync has little left to do."""
        if self.fsync:
            os.fdatasync(self._handle.fileno())

    def finish(self) -> dict[str, Any]:
        if self._next != len(self._expected):
            raise ValueError(
                f"{self.path.name}: {len(self._expected) - self._next} tensors were never written"
            )
        try:
            if self.fsync:
                os.fsync(self._handle.fileno())
            self._handle.close()
            os.chmod(self._tmp, 0o644)  # mkstemp makes it private; the scorer may run as another user
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return {"size": self.size, "sha256": self._digest.hexdigest()}

    def abort(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.close()
        Path(self._tmp).unlink(missing_ok=True)

    def _write(self, data: Any) -> None:
        view = memoryview(data)
        while view:  # a raw write may be short
            written = self._handle.write(view)
            view = view[written:]


def write_shard(
    path: str | os.PathLike[str],
    tensors: Sequence[tuple[str, Any]],
    metadata: dict[str, str] | None = None,
    fsync: bool = True,
) -> dict[str, Any]:
    """Write torch tensors as one safetensors file, atomically; returns {"size", "sha256"}."""
    layout = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors]
    shard = ShardFile(path, layout, metadata, fsync)
    try:
        for name, tensor in tensors:
            shard.write(name, tensor)
    except BaseException:
        shard.abort()
        raise
    return shard.finish()


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _byte_view(tensor):
    import torch

    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


class HiddenStates:
    """A finished extraction: `.manifest`, `.layer_ids`, `.records`; iterate for (meta, ids, states)."""

    def __init__(
        self,
        directory: Path,
        manifest: dict[str, Any],
        columns: list[int] | None = None,
        verify: bool = True,
        _verified: set[str] | None = None,
    ):
        self.directory = directory
        self.manifest = manifest
        self.captured_layer_ids: list[int] = list(manifest["layer_ids"])
        self._columns = columns
        self.verify = verify
        self._verified = _verified if _verified is not None else set()
        self._handles: dict[str, Any] = {}

    @property
    def layer_ids(self) -> list[int]:
        if self._columns is None:
            return list(self.captured_layer_ids)
        return [self.captured_layer_ids[c] for c in self._columns]

    @property
    def records(self) -> list[dict[str, Any]]:
        return sorted(self.manifest["records"], key=lambda r: r["index"])

    def __len__(self) -> int:
        return len(self.manifest["records"])

    def select_layers(self, layer_ids: Sequence[int]) -> HiddenStates:
        """The same records with only these layers, in this order, on the layer axis."""
        missing = [k for k in layer_ids if k not in self.captured_layer_ids]
        if missing:
            raise HiddenStatesError(
                f"layers {missing} were not captured in {self.directory} (captured: "
                f"{self.captured_layer_ids}): "
                "rerun extract_hidden_states with layer_ids/capture_offsets that include them"
            )
        columns = [self.captured_layer_ids.index(k) for k in layer_ids]
        return HiddenStates(self.directory, self.manifest, columns, self.verify, self._verified)

    def __iter__(self) -> Iterator[tuple[dict[str, Any], Any, Any]]:
        for meta in self.records:
            yield (meta, *self.load(meta["index"]))

    def load(self, index: int) -> tuple[Any, Any]:
        """(input_ids int64 [seq], hidden_states [seq, n_layers, hidden]) of the record at this index."""
        meta = self._by_index().get(index)
        if meta is None:
            raise HiddenStatesError(f"record {index} is not in {self.directory} ({len(self)} records)")
        handle = self._open(meta["shard"])
        input_ids = handle.get_tensor(f"{index}.input_ids")
        states = handle.get_tensor(f"{index}.hidden_states")
        if self._columns is not None:
            states = states[:, self._columns]
        return input_ids, states

    def _by_index(self) -> dict[int, dict[str, Any]]:
        if not hasattr(self, "_index"):
            self._index = {r["index"]: r for r in self.manifest["records"]}
        return self._index

    def _open(self, name: str):
        if name not in self._handles:
            from safetensors import safe_open

            self._check(name)
            self._handles[name] = safe_open(str(self.directory / name), framework="pt")
        return self._handles[name]

    def _check(self, name: str) -> None:
        path = self.directory / name
        expected = self.manifest.get("files", {}).get(name)
        rerun = "rerun the extraction (extract_hidden_states) to rewrite it"
        if expected is None:
            raise HiddenStatesError(f"{path} is not listed in the manifest: {rerun}")
        if not path.is_file():
            raise HiddenStatesError(f"shard {path} is missing: {rerun}")
        size = path.stat().st_size
        if size != expected["size"]:
            raise HiddenStatesError(
                f"shard {path} is truncated or altered ({size} bytes, the manifest says "
                f"{expected['size']}): {rerun}"
            )
        if self.verify and name not in self._verified:
            if sha256_file(path) != expected["sha256"]:
                raise HiddenStatesError(f"shard {path} does not match its checksum in the manifest: {rerun}")
            self._verified.add(name)


def open_hidden_states(directory: str | os.PathLike[str], verify: bool = True) -> HiddenStates:
    """Open a finished extraction; shards are checked (size, and sha256 when `verify`) before use."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise HiddenStatesError(
            f"{path} does not exist: the extraction into {directory} did not finish; run "
            f"extract_hidden_states"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise HiddenStatesError(f"{path} is not valid JSON ({error}): rerun extract_hidden_states") from error
    if manifest.get("stage") != "extract_hidden_states":
        raise HiddenStatesError(f"{path} is not a hidden-state manifest (stage {manifest.get('stage')!r})")
    return HiddenStates(directory, manifest, verify=verify)
