"""The target's token embedding and lm_head, read alone from its safetensors (never the whole model).

A DFlash drafter embeds its block and turns its outputs into tokens with the target's own
`embed_tokens` and `lm_head`. For a 27 B target these two matrices are ~5 GB of ~54 GB, so only
they are read, tensor by tensor, from the (possibly sharded) safetensors files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "embed_tokens.weight",
)
LM_HEAD_NAMES = (
    "lm_head.weight",
    "model.lm_head.weight",
    "language_model.lm_head.weight",
)
# Logits for this many bytes at most are alive at once in `argmax`.
DEFAULT_LOGITS_BUDGET = 1 << 30


class TargetHeadError(ValueError):
    """The target checkpoint does not hold a usable embedding / lm_head; the message says why."""


class TargetHead:
    """embed(ids) and argmax(hidden) with the target's matrices, the latter in row chunks."""

    def __init__(
        self,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET,
    ):
        if embed_weight.shape[1] != lm_head_weight.shape[1]:
            raise TargetHeadError(
                f"embed_tokens is {tuple(embed_weight.shape)} but lm_head is "
                f"{tuple(lm_head_weight.shape)}: their hidden sizes differ"
            )
        self.embed_weight = embed_weight
        self.lm_head_weight = lm_head_weight
        self.logits_budget_bytes = logits_budget_bytes

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.lm_head_weight.shape[1]

    @property
    def device(self) -> torch.device:
        return self.lm_head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., hidden]; a gather, so its memory is that of the output alone."""
        return F.embedding(ids.to(self.embed_weight.device), self.embed_weight)

    def logits(
        self, hidden: torch.Tensor, multiplier: float = 1.0, softcap: float | None = None
    ) -> torch.Tensor:
        """Float32 logits [..., vocab] (for training and small inputs; argmax never builds them all).

        bf16 inputs, fp32 output: rounding logits to bf16 (1 ulp = 0.03 near 5) would turn close
        calls into exact ties and make the argmax hinge on rounding.
        """
        logits = _fp32_linear(hidden, self.lm_head_weight)
        if multiplier != 1.0:
            logits = logits * multiplier
        if softcap is not None:
            logits = torch.tanh(logits.float() / softcap) * softcap
        return logits

    def argmax(
        self, hidden: torch.Tensor, multiplier: float = 1.0, softcap: float | None = None
    ) -> torch.Tensor:
        """Greedy tokens for hidden [..., hidden] -> [...], a chunk of rows at a time.

        Ties go to the lowest token id (torch.argmax returns the first maximum), and chunking over
        rows never changes a row's result.
        """
        flat = hidden.reshape(-1, hidden.shape[-1])
        rows = max(1, self.logits_budget_bytes // (self.vocab_size * 4))
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        for i in range(0, flat.shape[0], rows):
            out[i : i + rows] = self.logits(flat[i : i + rows], multiplier, softcap).argmax(dim=-1)
        return out.view(hidden.shape[:-1])


def _fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T with a float32 result; on CUDA half inputs stay half (fp32 accumulate and output)."""
    if weight.dtype == torch.float32:
        return F.linear(x.float(), weight)
    if x.is_cuda:
        try:
            flat = torch.mm(x.reshape(-1, x.shape[-1]), weight.T, out_dtype=torch.float32)
            return flat.view(*x.shape[:-1], weight.shape[0])
        except (TypeError, RuntimeError, NotImplementedError):
            pass  # older torch without mm(out_dtype=): upcast below
    return F.linear(x.float(), weight.float())


def _weight_files(target_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index when sharded."""
    from safetensors import safe_open

    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_dir / file for name, file in weight_map.items()}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise TargetHeadError(
            f"{target_dir} holds no .safetensors files: point target at a checkpoint "
            "directory (model.safetensors or shards with model.safetensors.index.json)"
        )
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names.update({name: file for name in handle.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    return names


def _tied(target_dir: Path) -> bool:
    config_file = target_dir / "config.json"
    if not config_file.is_file():
        return False
    config = json.loads(config_file.read_text())
    text = config.get("text_config") or {}
    return bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


def _read(name: str, file: Path) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(name)


def load_target_head(
    target_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET,
) -> TargetHead:
    """Read embed_tokens and lm_head (or the tied embedding) from the target's safetensors."""
    target_dir = Path(target_dir)
    files = _weight_files(target_dir)
    embed_name = next((n for n in EMBED_NAMES if n in files), None)
    if embed_name is None:
        raise TargetHeadError(
            f"{target_dir}: no token embedding among {list(EMBED_NAMES)}; is this the "
            "target model's checkpoint?"
        )
    head_name = next((n for n in LM_HEAD_NAMES if n in files), None)
    if head_name is None and not _tied(target_dir):
        raise TargetHeadError(
            f"{target_dir}: no lm_head among {list(LM_HEAD_NAMES)} and config.json does "
            "not set tie_word_embeddings; the checkpoint lacks its output head"
        )
    embed = _read(embed_name, files[embed_name]).to(device=device, dtype=dtype)
    head = embed if head_name is None else _read(head_name, files[head_name]).to(device=device, dtype=dtype)
    return TargetHead(embed, head, logits_budget_bytes)
