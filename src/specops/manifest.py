"""Atomic writes, checksums and stage manifests: how a rerun knows it has nothing to do."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
# Reports, plots and manifests are read by others (AWX's view, a team's web server): mkstemp's
# private 0600 is widened to this mode (octal), or to what the umask allows when it is unset.
OUTPUT_MODE_VARIABLE = "SPECOPS_OUTPUT_MODE"


def output_mode() -> int:
    """The mode new outputs get: SPECOPS_OUTPUT_MODE, else 0666 less the process's umask."""
    configured = os.environ.get(OUTPUT_MODE_VARIABLE, "").strip()
    if configured:
        try:
            return int(configured, 8) & 0o7777
        except ValueError:
            raise ValueError(
                f"{OUTPUT_MODE_VARIABLE}={configured!r} is not an octal file mode such as 0644"
            ) from None
    return 0o666 & ~_umask()


def _umask() -> int:
    # Read, not set: os.umask(0) would open a moment in which other threads create files world-writable.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), output_mode())
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as error:
        Path(tmp).unlink(missing_ok=True)
        if error.filename is None:
            # A failed write names no file: name the one being written (a full disk says where).
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def remove_stale_temporaries(directory: str | os.PathLike[str]) -> list[str]:
    """Delete leftovers of writes that a crash interrupted (`.name.XXXX.tmp`)."""
    removed = []
    directory = Path(directory)
    if directory.is_dir():
        for tmp in directory.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
            removed.append(tmp.name)
    return removed


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(obj: Any) -> str:
    """A stable digest of JSON-able inputs (key order does not matter)."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def file_identity(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Cheap identity of a file for input fingerprints: size and content hash."""
    path = Path(path)
    return {"path": str(path.resolve()), "size": path.stat().st_size, "sha256": sha256_file(path)}


def load_manifest(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    path = Path(directory) / MANIFEST_NAME
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_up_to_date(directory: str | os.PathLike[str], inputs_fingerprint: str) -> bool:
    """True when the directory holds a complete output made from exactly these inputs."""
    return staleness(directory, inputs_fingerprint) is None


def staleness(directory: str | os.PathLike[str], inputs_fingerprint: str) -> str | None:
    """Why the directory's output cannot be reused (None: it can): the files are checked by content."""
    manifest = load_manifest(directory)
    if not manifest:
        return f"{Path(directory) / MANIFEST_NAME} does not exist or is not JSON"
    if manifest.get("inputs_fingerprint") != inputs_fingerprint:
        return "it was made from other inputs"
    return first_damaged_file(directory, manifest.get("files", {}))


def first_damaged_file(directory: str | os.PathLike[str], files: dict[str, Any]) -> str | None:
    """The first file that is missing or whose sha256 differs from the manifest's, said in words."""
    for name, digest in sorted(files.items()):
        path = Path(directory) / name
        if not path.is_file():
            return f"{path} is missing"
        if not matches(path, digest):
            return f"{path} does not match the sha256 its manifest records (damaged or edited)"
    return None


def matches(path: str | os.PathLike[str], digest: dict[str, Any]) -> bool:
    """The file exists with the recorded size and sha256 (size first: cheap, and tells most apart)."""
    path = Path(path)
    return (
        path.is_file()
        and path.stat().st_size == digest.get("size")
        and sha256_file(path) == digest.get("sha256")
    )


def write_manifest(
    directory: str | os.PathLike[str],
    stage: str,
    inputs: dict[str, Any],
    files: list[str],
    digests: dict[str, dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Record what a stage made and from what; written last, so its presence means complete.

    `digests` gives {"size", "sha256"} for files the stage hashed while writing them (no second read).
    """
    digests = digests or {}
    from specops import __version__

    directory = Path(directory)
    manifest = {
        "stage": stage,
        "specops_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "inputs": inputs,
        "inputs_fingerprint": fingerprint(inputs),
        "files": {
            name: digests.get(name)
            or {"size": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
            for name in files
        },
        **extra,
    }
    atomic_write_json(directory / MANIFEST_NAME, manifest)
    return manifest
