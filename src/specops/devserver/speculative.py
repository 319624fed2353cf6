"""Greedy speculative decoding with a DFlash drafter, counted the way SGLang's DFLASH worker counts.

One request at a time, temperature 0:

1. Prefill: one target forward over the prompt; the argmax of its last logits is the first output
   token. No verify step produces it, so it is in `completion_tokens` but not in `spec_verify_ct`.
2. Until the request finishes (max_new_tokens reached or a stop token produced):
   - s = position of the last verified token. The drafter drafts the block [ids[s], MASK x (N-1)]
     at positions s..s+N-1 from the target's features at positions 0..s-1 (layer k is HF
     `hidden_states[k + 1]`), N = --speculative-num-draft-tokens (default: the drafter's block_size).
   - One target forward over the sequence plus the N-1 drafts verifies them: k = leading drafts equal
     to the target's greedy tokens; d_1..d_k and then the target's own next token (the bonus) are
     appended one at a time, stopping at the first one that finishes the request.
   - spec_verify_ct += 1; accepted drafts += appended - 1; the verified positions' features (the
     block's first token and the accepted drafts) join the context.

What the response reports (SGLang's tokenizer_manager, `_calculate_spec_decoding_metrics`):
  completion_tokens   = len(output_ids), the prefill's token included
  spec_verify_ct      = verify steps
  spec_accept_length  = completion_tokens / spec_verify_ct
  spec_accept_rate    = accepted drafts / (spec_verify_ct * (N - 1))
  spec_accept_token_num, spec_draft_token_num = the numerator and denominator of that rate
With no verify step (the prefill's token ended the request) length and rate are 0, as in SGLang.

The target recomputes the whole sequence at every verify (no KV cache): the models served here are
tiny, and a full forward is the plainest way to get logits and features at every position.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("specops.devserver")

ALGORITHM = "DFLASH"


class SpeculativeError(RuntimeError):
    """The drafter cannot serve with this target; the message names the problem and the fix."""


@dataclass
class SpecOutcome:
    """One request's speculative decode: its tokens and SGLang's counters."""

    output_ids: list[int]
    num_draft_tokens: int
    verify_ct: int = 0
    accepted_drafts: int = 0
    appended_per_step: list[int] = field(default_factory=list)

    def meta_info(self) -> dict[str, Any]:
        """SGLang's per-request speculative figures, from the counters kept while decoding."""
        meta: dict[str, Any] = {
            "spec_verify_ct": self.verify_ct,
            "spec_accept_length": 0,
            "spec_accept_rate": 0.0,
        }
        proposed = self.verify_ct * (self.num_draft_tokens - 1)
        if self.verify_ct > 0 and proposed > 0:
            meta.update(
                spec_accept_length=len(self.output_ids) / self.verify_ct,
                spec_accept_rate=self.accepted_drafts / proposed,
                spec_accept_token_num=self.accepted_drafts,
                spec_draft_token_num=proposed,
            )
        return meta


def _block_size_view(drafter: Any, block_size: int) -> Any:
    """The drafter drafting blocks of `block_size` (shares its weights); itself when that is its own."""
    if block_size == drafter.block_size:
        return drafter
    view = copy.copy(drafter)
    view.block_size = block_size
    return view


class DFlashSpeculator:
    """A DFlash drafter plus the target's embedding and lm_head, drafting for the served target."""

    def __init__(self, drafter: Any, head: Any, num_draft_tokens: int, draft_path: str = ""):
        self.drafter = drafter
        self.head = head
        self.num_draft_tokens = num_draft_tokens
        self.draft_path = draft_path
        self._drafting = _block_size_view(drafter, num_draft_tokens)

    @classmethod
    def load(
        cls,
        draft_path: str | Path,
        target_path: str | Path,
        target_config: Any,
        num_draft_tokens: int | None = None,
        device: str = "cpu",
    ) -> DFlashSpeculator:
        """Load and check the drafter against the target; SpeculativeError says what does not fit."""
        import torch

        from specops.score.drafter import DrafterError, load_drafter
        from specops.score.target_head import TargetHeadError, load_target_head

        where = f"the DFlash drafter {draft_path}"
        try:
            drafter = load_drafter(draft_path, device=device, dtype=torch.float32)
            head = load_target_head(target_path, device=device, dtype=torch.float32)
        except (DrafterError, TargetHeadError, OSError) as error:
            raise SpeculativeError(f"cannot load {where}: {error}") from error
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        layers = int(text.num_hidden_layers)
        out_of_range = [k for k in drafter.target_layer_ids if not 0 <= k < layers]
        if out_of_range:
            raise SpeculativeError(
                f"{where}: target layer {out_of_range[0]} out of range: the target has {layers} layers "
                f"(0-{layers - 1}); the drafter was built for another target"
            )
        if drafter.hidden_size != head.hidden_size:
            raise SpeculativeError(
                f"{where}: hidden_size {drafter.hidden_size} differs from the target's {head.hidden_size}: "
                "the drafter was built for another target"
            )
        if not 0 <= drafter.mask_token_id < head.vocab_size:
            raise SpeculativeError(
                f"{where}: mask_token_id {drafter.mask_token_id} is outside the target's vocabulary "
                f"(0-{head.vocab_size - 1}); set dflash_config.mask_token_id to the drafter's mask token"
            )
        if num_draft_tokens is None:
            num_draft_tokens = drafter.block_size
        if num_draft_tokens < 2:
            raise SpeculativeError(
                f"--speculative-num-draft-tokens {num_draft_tokens}: a DFlash block needs at least 2 tokens "
                f"(the verified token and one draft); the drafter's block_size is {drafter.block_size}"
            )
        if num_draft_tokens != drafter.block_size:
            # SGLang's rule: the flag wins over the checkpoint's block_size, with a warning.
            logger.warning(
                "DFLASH block size mismatch: using --speculative-num-draft-tokens=%d but the "
                "drafter's block_size is %d",
                num_draft_tokens,
                drafter.block_size,
            )
        logger.info(
            "DFLASH drafter %s loaded: block size %d, target layers %s",
            draft_path,
            num_draft_tokens,
            drafter.target_layer_ids,
        )
        return cls(drafter, head, num_draft_tokens, str(draft_path))

    # -- one request ---------------------------------------------------------------------------
    def _target(self, model: Any, ids: list[int]):
        """Greedy next tokens [T] and the drafter's features [T, n, hidden] for every position of ids."""
        import torch

        from specops.score.drafter import select_target_features

        device = self.head.device
        out = model(torch.tensor([ids], device=device), output_hidden_states=True, use_cache=False)
        # float32 argmax, as transformers' greedy search takes it.
        greedy = out.logits[0].float().argmax(dim=-1)
        features = select_target_features([h[0] for h in out.hidden_states], self.drafter.target_layer_ids)
        return greedy.tolist(), features

    def _drafts(self, features: Any, token: int, start: int) -> list[int]:
        """The N-1 drafts of the block [token, MASK...] at start, from the context features 0..start-1."""
        from specops.score.sequential_acceptance import SequentialDrafter

        return SequentialDrafter(self._drafting, self.head, features[:start]).drafts(token, start)

    def generate(
        self,
        model: Any,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop_ids: Iterable[int],
        progress: Callable[[list[int]], None] | None = None,
        interrupted: Callable[[], bool] | None = None,
    ) -> SpecOutcome:
        """Decode greedily by drafting and verifying (see the module docstring).

        `progress` sees the output after each step; `interrupted` stops the decode between two steps
        (a pause), leaving what was verified so far.
        """
        import torch

        stop = set(stop_ids)
        outcome = SpecOutcome(output_ids=[], num_draft_tokens=self.num_draft_tokens)
        if max_new_tokens <= 0:
            return outcome
        output = outcome.output_ids

        def finished() -> bool:
            return len(output) >= max_new_tokens or output[-1] in stop

        with torch.inference_mode():
            greedy, features = self._target(model, prompt_ids)
            output.append(greedy[-1])
            if progress is not None:
                progress(output)
            sequence = list(prompt_ids) + output
            while not finished() and not (interrupted is not None and interrupted()):
                start = len(sequence) - 1
                drafts = self._drafts(features, sequence[start], start)
                greedy, verified = self._target(model, sequence + drafts)
                # predicted[j] is the target's token at start + j + 1, given the block up to j.
                predicted = greedy[start : start + self.num_draft_tokens]
                k = 0
                while k < len(drafts) and drafts[k] == predicted[k]:
                    k += 1
                appended = 0
                for token in drafts[:k] + [predicted[k]]:
                    output.append(token)
                    sequence.append(token)
                    appended += 1
                    if finished():
                        break
                outcome.verify_ct += 1
                outcome.accepted_drafts += appended - 1
                outcome.appended_per_step.append(appended)
                # Verified now: positions up to the last accepted draft; the bonus token's come next step.
                features = verified[: start + appended]
                if progress is not None:
                    progress(output)
        return outcome
