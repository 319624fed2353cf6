"""The scoring engine: the device's memory limit and precision, the Scorer that holds the target head
and the hidden states and walks any drafter over them, and the engine's errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specops import speedup as spd
from specops.score.request import Options
from specops.stage import StageError, log
from specops.versions import installed_versions

# dtype auto keeps float32 on a GPU while the head and drafters take at most this share of free memory.
FLOAT32_MEMORY_SHARE = 0.25


def versions() -> dict[str, str]:
    from specops import __version__

    libraries = ("torch", "transformers", "fla-core", "flash-linear-attention", "safetensors")
    found = {name: version for name, version in installed_versions(libraries).items() if version}
    return {"specops": __version__, **found}


def limit_gpu_memory(device: str, gib: float) -> None:
    """Keep scoring within `gib` on its GPU, and refuse to start where that much is not free."""
    if not gib or not device.startswith("cuda"):
        return
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    if free < gib * 2**30:
        raise StageError(
            f"{device} has {free / 2**30:.1f} GiB free, less than gpu_memory_gib {gib}: the "
            "server holds the rest; lower gpu_memory_gib, choose another GPU, or score on cpu"
        )
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), torch.device(device))


def resolve_dtype(
    dtype: str, device: str, target: Path, drafters: Sequence[Path], in_window: bool = False
) -> str:
    """auto: float32 (exact argmax ties, no bf16 drift) on the CPU, and on a GPU where it fits, except
    inside a window: there the service is down while scoring runs, so bfloat16 products (the logits still
    float32), the precision the scoring benchmark and the placement's estimate are measured in and SGLang
    runs the drafter in; float32 without tensor cores would take several times the planned downtime."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    if in_window:
        return "bfloat16"
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    head = spd.weight_bytes(target, "lm_head.weight") + spd.weight_bytes(target, "embed_tokens.weight")
    # Weights are usually stored in 16 bits: float32 doubles them.
    need = 2 * (head + sum(spd.weight_bytes(path) for path in drafters))
    return "float32" if need <= FLOAT32_MEMORY_SHARE * free else "bfloat16"


class Scorer:
    """Holds the target head and the hidden states; scores any drafter at any captured layer ids."""

    # Host memory the features of the sequences handed to the engine at once may take: the engine
    # drafts one block per sequence per step, and the larger the batch of blocks, the better a GPU's
    # matrix products run (at hidden 5120, 8 GiB holds ~140 completions of 1,128 tokens).
    CHUNK_BYTES = 8 << 30

    def __init__(self, opts: Options, device: str, dtype: str):
        import torch

        from specops.hidden_states import open_hidden_states
        from specops.score.target_head import load_target_head

        self.device = device
        self.dtype = getattr(torch, dtype)
        self.hidden = open_hidden_states(opts.hidden_states)
        self.head = load_target_head(opts.target, device=device, dtype=self.dtype)

    def load(self, path: Path):
        from specops.score.drafter import load_drafter

        return load_drafter(path, device=self.device, dtype=self.dtype)

    def sequences(self, layer_ids: list[int]):
        selected = self.hidden.select_layers(layer_ids)
        for meta, input_ids, features in selected:
            yield {
                "id": str(meta["id"]),
                "input_ids": input_ids,
                "features": features,
                "prompt_len": int(meta["prompt_tokens"]),
            }

    def score(self, drafter, layer_ids: list[int]) -> dict[str, Any]:
        """{"block_size", "sequences": [{"id", "accept_lengths", "block_starts"}]} for one drafter and
        layer choice."""
        from specops.score.acceptance import offline_acceptance

        scored: list[dict[str, Any]] = []
        chunk: list[dict[str, Any]] = []
        total = len(self.hidden)

        def flush() -> None:
            for result in offline_acceptance(drafter, self.head, chunk):
                scored.append(
                    {
                        "id": result.id,
                        "accept_lengths": list(result.accept_lengths),
                        "block_starts": list(result.block_starts),
                    }
                )
            log(f"score: {len(scored)}/{total} sequences")
            chunk.clear()

        held = 0
        for sequence in self.sequences(layer_ids):
            chunk.append(sequence)
            held += sequence["features"].numel() * sequence["features"].element_size()
            if held >= self.CHUNK_BYTES:
                flush()
                held = 0
        if chunk:
            flush()
        return {"block_size": drafter.block_size, "sequences": scored}

    def margins(
        self, drafter, layer_ids: list[int], scores: Mapping[str, Any], ids: Sequence[str]
    ) -> dict[str, dict[str, Any]]:
        """The closest call of every draft of the given prompts (specops.score.margins)."""
        from specops.score.acceptance import as_input
        from specops.score.margins import closest_call

        walked = {seq["id"]: seq for seq in scores["sequences"]}
        found = {}
        for sequence in self.sequences(layer_ids):
            if sequence["id"] in ids and sequence["id"] in walked:
                seq = walked[sequence["id"]]
                found[sequence["id"]] = closest_call(
                    drafter, self.head, as_input(sequence), seq["block_starts"], seq["accept_lengths"]
                )
        return found


def model_errors() -> tuple[type[Exception], ...]:
    """The engine's errors that name a fix; anything else is a crash with a traceback."""
    from specops.hidden_states import HiddenStatesError
    from specops.score.drafter import DrafterError
    from specops.score.target_head import TargetHeadError

    return DrafterError, HiddenStatesError, TargetHeadError
