"""How close each offline greedy draft came to flipping: the logit margin that decided it.

For a verify step at block start s with k leading drafts accepted, draft j (1 <= j <= k) would flip
if its runner-up overtook it (margin = top logit - second), and the first rejected draft k + 1 would
have been accepted if the target's token overtook it (margin = its logit - the target token's).
Drafts after k + 1 decide nothing. A step's margin is the smallest of these; a prompt's, the
smallest over its steps. Used only for the few prompts whose online and offline tau differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specops.score.acceptance import SequenceGroup, SequenceInput
from specops.score.drafter import DFlashDrafter
from specops.score.target_head import TargetHead

STEPS_PER_FORWARD = 8


@torch.inference_mode()
def closest_call(
    drafter: DFlashDrafter,
    head: TargetHead,
    sequence: SequenceInput,
    block_starts: Sequence[int],
    accept_lengths: Sequence[int],
) -> dict[str, Any]:
    """{"closest": smallest deciding margin or None, "block_start", "position"} of one walked sequence."""
    group = SequenceGroup(drafter, head, [sequence])
    length = sequence.input_ids.shape[0]
    bs = drafter.block_size
    best: dict[str, Any] = {"closest": None, "block_start": None, "position": None}
    for first in range(0, len(block_starts), STEPS_PER_FORWARD):
        starts = torch.tensor([list(block_starts[first : first + STEPS_PER_FORWARD])], device=head.device)
        anchors = group.ids.gather(1, starts)
        embeds = drafter.block_embeddings(head.embed, anchors.clamp_min(0))
        group.context.ensure(length)
        hidden = drafter(embeds, starts, group.context.buffers)[:, :, 1:]
        logits = head.logits(hidden, drafter.output_multiplier, drafter.logit_softcap)[0].float()
        for row, s in enumerate(starts[0].tolist()):
            accepted = accept_lengths[first + row] - 1
            deciding = min(accepted + 1, bs - 1, length - 1 - s)
            for j in range(1, deciding + 1):
                scores = logits[row, j - 1]
                top2 = scores.topk(2).values
                if j <= accepted:
                    margin = float(top2[0] - top2[1])
                else:
                    target = int(group.ids[0, s + j])
                    margin = float(top2[0] - scores[target])
                if best["closest"] is None or margin < best["closest"]:
                    best = {"closest": margin, "block_start": s, "position": j}
    return best
