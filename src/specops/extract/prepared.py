"""A request made ready to run: validated, inputs fingerprinted, shards planned; no model loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specops import preflight
from specops.backend import resolve_require_backend
from specops.extract.devices import first_device, resolve_device_dtype
from specops.extract.request import drafter_list, parse_request
from specops.extract.shards import ShardPlan, plan_shards
from specops.extract.target import (
    Record,
    TargetInfo,
    captured_layers,
    drafter_layer_ids,
    inspect_target,
    read_completions,
    tokens_fingerprint,
)
from specops.hidden_states import FORMAT_VERSION
from specops.stage import StageError, log

if TYPE_CHECKING:
    from collections.abc import Callable

    from specops.extract.extraction import ExtractionSettings


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

    def settings(
        self,
        device: Any,
        progress_log: Path | None = None,
        echo: Callable[[str], None] | None = log,
    ) -> ExtractionSettings:
        """The extraction's settings for this request on `device`."""
        # Imported here: extraction.py imports this module (through backend_guard).
        from specops.extract.extraction import ExtractionSettings

        return ExtractionSettings(
            self.layer_ids,
            device,
            self.require,
            self.req["writer_threads"],
            fsync=bool(self.req["fsync"]),
            progress_log=progress_log,
            echo=echo,
        )


def prepare(request: dict[str, Any], problems: list[str] | None = None) -> Prepared:
    """Validate everything and fingerprint the inputs; loads no model. The drafters' problems are added to
    `problems` where it is given (the plan names them with its own), else refused here."""
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
        target_ids = list(
            dict.fromkeys(
                k for d in drafter_list(req["drafter"]) for k in drafter_layer_ids(d, target.num_layers)
            )
        )
    else:
        raise StageError(
            "no layer ids: give drafter (its dflash_config.target_layer_ids are used) or layer_ids"
        )
    layer_ids, skipped = captured_layers(target_ids, req["capture_offsets"], target.num_layers)
    device, dtype = resolve_device_dtype(first_device(req), req["dtype"])
    require = resolve_require_backend(req["require_backend"], cuda=device.type == "cuda")
    found = [
        problem
        for drafter in drafter_list(req["drafter"])
        for problem in preflight.drafter_problems(drafter, target.path, target.vocab_size)
    ]
    if problems is None:
        preflight.refuse(found)
    else:
        problems.extend(found)
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
    return Prepared(
        req,
        target,
        records,
        target_ids,
        layer_ids,
        skipped,
        device,
        dtype,
        require,
        Path(req["out_dir"]),
        shards,
        inputs,
        completions_path,
    )
