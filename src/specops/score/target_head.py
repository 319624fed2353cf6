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

from specops.model_files import EMBED_NAMES, LM_HEAD_NAMES
from specops.score import kernels

# Logits for this many bytes at most are alive at once in `argmax`.
DEFAULT_LOGITS_BUDGET = 1 << 30
# `argmax` can take the vocabulary this many tokens at a time, keeping a running maximum, so that a pass
# never writes float32 logits over the whole vocabulary. None: the whole vocabulary in one product,
# which measured fastest on the H200 (3.2-4.3 ms against 2.7 ms for 768 rows with chunks of 65,536 to
# 8,192 tokens: the smaller products run further from the matrix rate than the logits' traffic costs;
# benchmarks/score_real_h200_2026-12-04.json, kernels.head_vocab_chunks).
DEFAULT_VOCAB_CHUNK: int | None = None
# "torch": float32 logits from one product (or vocabulary chunks, above), then their argmax. "triton": the
# product with its argmax in one kernel that writes each tile's row maxima and first indices instead of
# logits (specops.score.kernels.head_argmax), where `kernels.applies` (CUDA, half precision, triton
# importable) and no softcap is set (tanh in the epilogue could round otherwise than torch's and turn a
# close call); the torch path elsewhere. Measured beside "torch" in benchmarks/score_real_h200.py.
ARGMAX_KERNEL = "torch"


class TargetHeadError(ValueError):
    """The target checkpoint does not hold a usable embedding / lm_head; the message says why."""


class TargetHead:
    """embed(ids) and argmax(hidden) with the target's matrices, the latter in row chunks."""

    def __init__(
        self,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET,
        vocab_chunk: int | None = None,
    ):
        if embed_weight.shape[1] != lm_head_weight.shape[1]:
            raise TargetHeadError(
                f"embed_tokens is {tuple(embed_weight.shape)} but lm_head is "
                f"{tuple(lm_head_weight.shape)}: their hidden sizes differ"
            )
        self.embed_weight = embed_weight
        self.lm_head_weight = lm_head_weight
        self.logits_budget_bytes = logits_budget_bytes
        # None: DEFAULT_VOCAB_CHUNK, read at call time.
        self.vocab_chunk = vocab_chunk

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
        return self._finish(_fp32_linear(hidden, self.lm_head_weight), multiplier, softcap)

    @staticmethod
    def _finish(logits: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
        if multiplier != 1.0:
            logits = logits * multiplier
        if softcap is not None:
            logits = torch.tanh(logits.float() / softcap) * softcap
        return logits

    def argmax(
        self, hidden: torch.Tensor, multiplier: float = 1.0, softcap: float | None = None
    ) -> torch.Tensor:
        """Greedy tokens for hidden [..., hidden] -> [...], a chunk of rows and of the vocabulary at a time.

        Every logit is the float32 value `logits` gives; ties go to the lowest token id, as
        torch.argmax over the whole vocabulary gives them: within a chunk torch.argmax returns the
        first maximum, and a later chunk replaces the running best only when strictly greater (or
        NaN, which torch.argmax also takes as the maximum). Chunking over rows never changes a row.
        The Triton kernel (ARGMAX_KERNEL) follows the same order, but its float32 sums run in another
        order than cuBLAS's: a token can differ only where two logits are within that rounding.
        """
        flat = hidden.reshape(-1, hidden.shape[-1])
        vocab = self.vocab_size
        fused = self.fused_argmax_applies(flat, softcap)
        chunk = vocab if fused else min(self.vocab_chunk or DEFAULT_VOCAB_CHUNK or vocab, vocab)
        # The fused kernel's partials are far smaller than logits; the same row chunks keep it simple.
        rows = max(1, self.logits_budget_bytes // (chunk * 4))
        if flat.shape[0] <= rows and not fused and chunk == vocab:
            # One product over the whole vocabulary: its argmax is the answer (no running best to keep).
            logits = self._finish(_fp32_linear(flat, self.lm_head_weight), multiplier, softcap)
            return logits.argmax(dim=-1).view(hidden.shape[:-1])
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        for i in range(0, flat.shape[0], rows):
            if fused:
                from specops.score.kernels.head_argmax import head_argmax

                out[i : i + rows] = head_argmax(flat[i : i + rows], self.lm_head_weight, multiplier)
            else:
                out[i : i + rows] = self._chunked_argmax(flat[i : i + rows], chunk, multiplier, softcap)
        return out.view(hidden.shape[:-1])

    def fused_argmax_applies(self, rows: torch.Tensor, softcap: float | None) -> bool:
        """Whether `argmax` runs the Triton kernel on these rows (see ARGMAX_KERNEL)."""
        return ARGMAX_KERNEL == "triton" and softcap is None and kernels.applies(rows, self.lm_head_weight)

    def _chunked_argmax(
        self, rows: torch.Tensor, chunk: int, multiplier: float, softcap: float | None
    ) -> torch.Tensor:
        best_value = best_index = None
        for first in range(0, self.vocab_size, chunk):
            weight = self.lm_head_weight[first : first + chunk]
            logits = self._finish(_fp32_linear(rows, weight), multiplier, softcap)
            index = logits.argmax(dim=-1, keepdim=True)
            value = logits.gather(-1, index).squeeze(-1)
            index = index.squeeze(-1) + first
            if best_value is None or best_index is None:
                best_value, best_index = value, index
                continue
            better = (value > best_value) | (value.isnan() & ~best_value.isnan())
            best_value = torch.where(better, value, best_value)
            best_index = torch.where(better, index, best_index)
        assert best_index is not None
        return best_index


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
