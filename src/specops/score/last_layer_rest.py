"""The drafter's last steps (its last layer's o_proj and MLP, the final norm) for the rows of one head pass,
with the weights and the choices among paths resolved once per group.

The walk runs them a few times a step (`specops.score.leading_matches`), each time right after the host
has read the last pass's surviving blocks back: the device waits while the host queues them, so their host
calls are the device's idle time. On an H100 at the real shape a pass started from an idle device took
0.5-0.7 ms longer than its device time, and the same pass written with these steps called directly about
0.2 ms less (benchmarks/score_pass_host.py, benchmarks/README.md). `DFlashDrafter.finish` states the same
steps through the modules; this runs the same kernels on the same operands where its fast path applies (no
gradient, gate and up fused, sums in the products, no biases, SiLU) and hands over to it elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

from specops.score import drafter_ops
from specops.score.drafter import DFlashDrafter, DFlashLayer

# False: every pass through `DFlashDrafter.finish`'s modules (benchmarks/score_real_h200.py measures both,
# "rest_through_modules").
DIRECT = True


@dataclass(frozen=True)
class _Weights:
    """What the fast path reads, looked up once."""

    o_proj: torch.Tensor  # [heads * head_dim, hidden]: o_proj's weight transposed (a view)
    post_norm: nn.Module
    gate_up: torch.Tensor  # [2 * intermediate, hidden], fused
    act_fn: nn.Module
    down: torch.Tensor  # [intermediate, hidden]: down_proj's weight transposed (a view)
    norm: nn.Module


def _weights(drafter: DFlashDrafter) -> _Weights | None:
    """The fast path's weights, or None where `DFlashDrafter.finish`'s own steps must run."""
    last = drafter.layers[-1]
    assert isinstance(last, DFlashLayer)
    attn, mlp = last.self_attn, last.mlp
    fused = drafter_ops.fused_linears(last._gate_up, (mlp.gate_proj, mlp.up_proj))
    if (
        not DIRECT
        or not drafter_ops.SUM_IN_PRODUCT
        or fused is None
        or fused[1] is not None
        or attn.o_proj.bias is not None
        or mlp.down_proj.bias is not None
        or not isinstance(mlp.act_fn, (SiLUActivation, nn.SiLU))
        or not isinstance(last.post_attention_layernorm, drafter_ops.RMSNorm)
        or not isinstance(drafter.norm, drafter_ops.RMSNorm)
    ):
        return None
    return _Weights(
        attn.o_proj.weight.T,
        last.post_attention_layernorm,
        fused[0],
        mlp.act_fn,
        mlp.down_proj.weight.T,
        drafter.norm,
    )


class LastLayerRest:
    """rest(residual, mixed) -> the draft states [..., hidden] of `DFlashDrafter.finish(residual, mixed,
    owned=True)`: residual is given up (the sums go into its memory)."""

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.weights = None if torch.is_grad_enabled() else _weights(drafter)

    def __call__(self, residual: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        w = self.weights
        if (
            w is None
            or torch.is_grad_enabled()
            or not residual.is_contiguous()
            or residual.dtype != mixed.dtype
        ):
            return self.drafter.finish(residual, mixed, owned=True)
        hidden = residual.shape[-1]
        x = residual.view(-1, hidden)
        x.addmm_(mixed.reshape(-1, mixed.shape[-1]), w.o_proj)
        post = w.post_norm
        gate, up = F.linear(F.rms_norm(x, (hidden,), post.weight, post.variance_epsilon), w.gate_up).chunk(
            2, dim=-1
        )
        x.addmm_(drafter_ops.silu_mul(w.act_fn, gate, up), w.down)
        norm = w.norm
        return F.rms_norm(x, (hidden,), norm.weight, norm.variance_epsilon).view(residual.shape)
