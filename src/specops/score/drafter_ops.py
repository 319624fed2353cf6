"""The drafter's elementwise steps and its fused projections, written for fewer passes over memory.

`RMSNorm` and `apply_rope` compute what transformers' Qwen3 modules compute in fewer kernels;
`fuse_linears` concatenates projections that read the same input into one matrix (q/k/v, gate/up) with
the separate linears left as views of it, and `fused_linears` hands the matrix out only while it is
still theirs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, in three passes instead of five (no negated copy, no cat)."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out


class RMSNorm(Qwen3RMSNorm):
    """Qwen3's RMSNorm through torch's rms_norm: normalised and scaled by the weight in float32, rounded
    once, as SGLang's does (sglang 0.5.23 srt/layers/layernorm.py:872, `(x * self.weight).to(orig_dtype)`;
    transformers rounds before the weight); one kernel where torch has a fused one, not five passes."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)


def fuse_linears(linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) once; each linear's parameters become views of
    the result, so the model's memory does not grow and its state_dict keeps its names."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    biases = [linear.bias for linear in linears]
    with_bias = all(b is not None for b in biases)
    bias = torch.cat([b.detach() for b in biases if b is not None]) if with_bias else None
    first = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        # Trainable stays trainable: under autograd the separate linears run (`fused_linears`).
        trainable = linear.weight.requires_grad
        linear.weight = nn.Parameter(weight[first : first + rows], requires_grad=trainable)
        if bias is not None and linear.bias is not None:
            trainable = linear.bias.requires_grad
            linear.bias = nn.Parameter(bias[first : first + rows], requires_grad=trainable)
        first += rows
    return weight, bias


def fused_linears(
    fused: tuple[torch.Tensor, torch.Tensor | None] | None, linears: tuple[nn.Linear, ...]
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """fused where the linears' weights are still its views (an assignment breaks that: then the
    separate products run) and no gradient is wanted (the fused matrix has none)."""
    if fused is None or torch.is_grad_enabled():
        return None
    weight, bias = fused
    first = 0
    for linear in linears:
        if linear.weight.data_ptr() != weight[first].data_ptr() or (bias is None) != (linear.bias is None):
            return None
        first += linear.weight.shape[0]
    return fused
