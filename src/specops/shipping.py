"""What a scoring host needs from the GPU host, listed with checksums, and checked where it arrives:
`python -m specops.shipping --run` with {action: list | verify, ...} on stdin.

list (on the GPU host): {hidden_states, completions, target, drafters: [...], reference_drafter}
  -> {files: [{path, size, sha256}], bytes}. Every file of the hidden-state and completions outputs
  and of each drafter; of the target, its small files (config, tokenizer, the safetensors index: what
  the score stage's fingerprint and checks read) and only the weight files that hold the token
  embedding or the output head, which is all the scoring multiplies by. A shard's checksum comes from
  its stage's manifest where one lists it (hashed once, when it was written), else it is hashed here.
verify (on the scoring host): {root, files} -> {verified, bytes}. Each file must be at root + its path
  with its size and sha256; the first mismatches are named and nothing is scored.
pack: {archive, files: [paths]} or {archive, directory} -> {archive, files, bytes}: the files in one
  uncompressed tar, written atomically (by their absolute paths, or relative to the directory). Small
  files travel so, one transfer for all, instead of a transfer each; large ones travel alone, so that a
  rerun sends only those that changed.
unpack: {archive, root, directories, files} -> {unpacked, verified}: the tar's regular files written
  below root (nothing outside it), the directories (absolute paths, below root too) created for the files
  sent alone, the files verified when listed; the archive removed.
"""

from __future__ import annotations

import json
import os
import tarfile
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from specops.manifest import MANIFEST_NAME, sha256_file
from specops.model_files import EMBED_NAMES, LM_HEAD_NAMES
from specops.stage import StageError, serve

STAGE = "shipping"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Mismatches named in one error; the rest are counted.
NAMED = 5


def _files_under(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise StageError(f"{directory} is not a directory: nothing can be shipped from it")
    # A writer's temporaries (a crashed write) are not part of the output.
    return sorted(p for p in directory.rglob("*") if p.is_file() and ".tmp" not in p.name)


def _manifest_digests(directory: Path) -> dict[Path, dict[str, Any]]:
    """Size and sha256 of each file a stage's manifest lists (relative names), by absolute path."""
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return {}
    listed = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(listed, dict):
        return {}
    return {
        directory / name: entry
        for name, entry in listed.items()
        if isinstance(entry, dict) and "sha256" in entry and "size" in entry
    }


def target_files(target: Path) -> list[Path]:
    """The target's files the scoring reads: everything but weights, and the weight files of the head."""
    files = [p for p in _files_under(target) if p.suffix not in WEIGHT_SUFFIXES]
    index = target / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        heads = {file for name, file in weight_map.items() if name in EMBED_NAMES + LM_HEAD_NAMES}
        if not heads:
            raise StageError(
                f"{index} maps no token embedding or output head: is it the target's checkpoint?"
            )
        files += [target / name for name in sorted(heads)]
    else:
        # One unsharded file holds the head with the rest.
        files += sorted(target.glob("*.safetensors"))
    return files


def listing(request: Mapping[str, Any]) -> dict[str, Any]:
    try:
        outputs = [Path(request["hidden_states"])]
        target = Path(request["target"])
        drafters = [Path(p) for p in request["drafters"]]
    except KeyError as error:
        raise StageError(f"the list request needs {error}") from None
    if request.get("completions"):
        outputs.append(Path(request["completions"]))
    if request.get("reference_drafter"):
        drafters.append(Path(request["reference_drafter"]))
    known: dict[Path, dict[str, Any]] = {}
    paths: list[Path] = []
    for directory in outputs:
        known.update(_manifest_digests(directory))
        paths += _files_under(directory)
    for directory in drafters:
        paths += _files_under(directory)
    paths += target_files(target)
    files, seen = [], set()
    for path in paths:
        path = path.absolute()
        if path in seen:
            continue
        seen.add(path)
        size = path.stat().st_size
        entry = known.get(path)
        digest = entry["sha256"] if entry and entry["size"] == size else sha256_file(path)
        files.append({"path": str(path), "size": size, "sha256": digest})
    return {"changed": False, "files": files, "bytes": sum(f["size"] for f in files)}


def arrived_at(root: Path, path: str) -> Path:
    """Where a shipped file lands: its absolute path from the GPU host, under the scoring host's root."""
    return root / path.lstrip("/")


def verify(request: Mapping[str, Any]) -> dict[str, Any]:
    try:
        root = Path(request["root"])
        files: Iterable[Mapping[str, Any]] = request["files"]
    except KeyError as error:
        raise StageError(f"the verify request needs {error}") from None
    problems, count, total = [], 0, 0
    for entry in files:
        count += 1
        where = arrived_at(root, str(entry["path"]))
        if not where.is_file():
            problems.append(f"{where} is missing")
            continue
        size = where.stat().st_size
        total += size
        if size != entry["size"]:
            problems.append(f"{where} has {size} bytes where {entry['size']} were sent")
        elif sha256_file(where) != entry["sha256"]:
            problems.append(f"{where} does not match the sha256 it was sent with ({entry['sha256'][:12]}...)")
    if problems:
        more = f" (and {len(problems) - NAMED} more)" if len(problems) > NAMED else ""
        raise StageError(
            f"{len(problems)} of {count} shipped file(s) did not arrive intact, so nothing is scored: "
            + "; ".join(problems[:NAMED])
            + more
            + ". Rerun to ship them again; if it repeats, check the scoring host's disk and the copy's path"
        )
    return {"changed": False, "verified": count, "bytes": total}


def pack(request: Mapping[str, Any]) -> dict[str, Any]:
    archive = Path(request["archive"])
    if request.get("directory"):
        base = Path(request["directory"])
        members = [(path, str(path.relative_to(base))) for path in _files_under(base)]
    else:
        members = [(Path(path), str(path).lstrip("/")) for path in request.get("files") or []]
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{archive.name}.", suffix=".tmp", dir=archive.parent)
    try:
        with os.fdopen(fd, "wb") as handle, tarfile.open(fileobj=handle, mode="w") as tar:
            for path, name in members:
                tar.add(str(path), arcname=name, recursive=False)
        os.replace(partial, archive)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    return {"changed": True, "archive": str(archive), "files": len(members), "bytes": archive.stat().st_size}


def unpack(request: Mapping[str, Any]) -> dict[str, Any]:
    archive, root = Path(request["archive"]), Path(request["root"])
    unpacked = 0
    for directory in request.get("directories") or []:  # where files sent alone will land
        where = arrived_at(root, str(directory)).resolve()
        if not where.is_relative_to(root.resolve()):
            raise StageError(f"{directory} is outside {root}: not created")
        where.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        # Regular files only (no links, no devices), each written by us below root: a name that would
        # leave it is refused.
        for member in tar:
            if not member.isfile():
                continue
            target = (root / member.name).resolve()
            if not target.is_relative_to(root.resolve()):
                raise StageError(f"{archive} holds {member.name}, outside {root}: not unpacked")
            source = tar.extractfile(member)
            assert source is not None  # a regular file's member always has its data
            target.parent.mkdir(parents=True, exist_ok=True)
            with source, open(target, "wb") as out:
                while block := source.read(1 << 20):
                    out.write(block)
            os.chmod(target, member.mode & 0o777)
            unpacked += 1
    archive.unlink()
    result: dict[str, Any] = {"changed": True, "unpacked": unpacked}
    if request.get("files"):
        result["verified"] = verify({"root": str(root), "files": request["files"]})["verified"]
    return result


ACTIONS = {"list": listing, "verify": verify, "pack": pack, "unpack": unpack}


def run(request: dict[str, Any]) -> dict[str, Any]:
    action = ACTIONS.get(str(request.get("action")))
    if action is None:
        raise StageError(f"action {request.get('action')!r} is not one of {', '.join(ACTIONS)}")
    try:
        return action(request)
    except KeyError as error:
        raise StageError(f"the {request['action']} request needs {error}") from None


def main() -> int:
    return serve(STAGE, run, run)


if __name__ == "__main__":
    raise SystemExit(main())
