"""The drafter's elementwise steps and its fused projections, written for fewer passes over memory.

`RMSNorm` and `apply_rope` compute what transformers' Qwen3 modules compute in fewer kernels;
`norm_rope` and `silu_mul` are the chains the drafter runs on every block, which `ELEMENTWISE =
"triton"` runs as one Triton kernel each where they apply (`specops.score.kernels`);
`fuse_linears` concatenates projections that read the same input into one matrix (q/k/v, gate/up) with
the separate linears left as views of it, and `fused_linears` hands the matrix out only while it is
still theirs.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from specops.score import kernels

# "eager": torch's kernels, a few passes over memory per chain; "triton": `norm_rope` and `silu_mul` as
# one Triton kernel each where `kernels.applies` (CUDA, half precision, triton importable), eager
# elsewhere (the CPU always). At the real shape they took 3.7-5.4% less time than eager on the H200 and
# 2.6% less on the H100, accept lengths identical, for about 1.4 s of compilation the first time a host
# runs them (Triton caches them on disk); torch.compile of the same chains measured no gain
# (benchmarks/README.md). benchmarks/score_real_h200.py measures them against eager ("engine,
# no_triton").
ELEMENTWISE = "triton"
# True: a residual's sum with a projection (o_proj, down_proj) is taken in the product's epilogue (addmm with
# beta 1, in the residual's memory where the caller gives it up), not as a separate pass over both; at the
# full batch that pass reads and writes 126 MB each time. Measured beside separate sums in
# benchmarks/score_real_h200.py ("sums_apart").
SUM_IN_PRODUCT = True


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


def add_linear(x: torch.Tensor, linear: nn.Linear, h: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """x + linear(h) for x [..., out], h [..., in]: one product whose epilogue adds x (SUM_IN_PRODUCT, no
    gradient wanted, no bias), into x's memory where in_place (x is the caller's to give up) and x allows;
    the product and a separate sum otherwise."""
    if not SUM_IN_PRODUCT or torch.is_grad_enabled() or linear.bias is not None or x.dtype != h.dtype:
        return x + linear(h)
    weight = linear.weight.T
    rows = h.reshape(-1, h.shape[-1])
    if in_place and x.is_contiguous():
        x.view(-1, x.shape[-1]).addmm_(rows, weight)
        return x
    return torch.addmm(x.reshape(-1, x.shape[-1]), rows, weight).view(x.shape)


def lay_out(linear: nn.Linear, columns: bool) -> None:
    """Store the linear's weight [out, in] column-major (columns: a transposed view of a contiguous
    [in, out] matrix) or row-major, the same values either way; a no-op where it already is so."""
    weight = linear.weight
    if columns == (weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) == weight.shape[0]):
        return
    data = weight.detach().T.contiguous().T if columns else weight.detach().contiguous()
    linear.weight = nn.Parameter(data, requires_grad=weight.requires_grad)


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


# Why a Triton kernel failed here (its compilation, most often: no C compiler, an old driver), or None;
# after a failure every chain runs eager for the rest of the process.
TRITON_FAILED: str | None = None


def _triton_applies(*tensors: torch.Tensor) -> bool:
    return ELEMENTWISE == "triton" and TRITON_FAILED is None and kernels.applies(*tensors)


def _triton_failed(error: Exception) -> None:
    global TRITON_FAILED
    TRITON_FAILED = kernels.failure(
        error, "the drafter's Triton kernels failed ({}); its elementwise chains run in torch"
    )


def norm_rope(
    x: torch.Tensor, norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RoPE of norm(x) for x [..., heads, head_dim] (the queries' and keys' q_norm/k_norm, then the
    rotation); cos/sin [..., head_dim] per token, broadcasting over x's leading token dimensions.

    out: where to write it, a view [..., heads_outer, heads_inner, head_dim] of any layout (the folded
    queries, `block_attention.query_buffer`), returned then; the Triton kernel writes it directly."""
    if _triton_applies(x, norm.weight, cos, sin):
        heads, d = x.shape[-2:]
        tokens = x.shape[:-2]
        try:
            from specops.score.kernels.norm_rope import norm_rope as kernel

            args = (x.reshape(-1, heads, d), norm.weight, norm.variance_epsilon, *per_token(cos, sin, tokens))
            target = _kernel_view(out, tokens)
            if target is not None:
                kernel(*args, out=target)
                return cast(torch.Tensor, out)
            rows = kernel(*args)
            return rows.view(x.shape) if out is None else out.copy_(rows.view(out.shape))
        except Exception as error:  # noqa: BLE001 (any failure to build the kernel: torch's path instead)
            _triton_failed(error)
    rotated = apply_rope(norm(x), cos.unsqueeze(-2), sin.unsqueeze(-2))
    return rotated if out is None else out.copy_(rotated.view(out.shape))


def _kernel_view(out: torch.Tensor | None, tokens: tuple[int, ...]) -> torch.Tensor | None:
    """out [*tokens, heads_outer, heads_inner, d] as the kernel's [tokens_outer, tokens_inner, heads_outer,
    heads_inner, d] view (the last token dimension inner), or None where out is None or will not view so."""
    if out is None or not tokens:
        return None
    try:
        return out.view(-1, tokens[-1], *out.shape[-3:])
    except RuntimeError:
        return None


def per_token(
    cos: torch.Tensor, sin: torch.Tensor, tokens: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as [rows, head_dim] for x's tokens flattened, token t reading row t % rows: a view where
    their token dimensions are the last of x's (the context's [T] against x's [B, T]), expanded else."""
    d = cos.shape[-1]
    lead = tuple(cos.shape[:-1])
    while lead and lead[0] == 1:
        lead = lead[1:]
    if len(lead) > len(tokens) or tuple(tokens[len(tokens) - len(lead) :]) != lead:
        cos, sin = cos.expand(*tokens, d), sin.expand(*tokens, d)
    return cos.reshape(-1, d), sin.reshape(-1, d)


def silu_mul(act_fn: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act_fn(gate) * up, the MLP's product with up; gate is overwritten on the eager path."""
    if isinstance(act_fn, (SiLUActivation, nn.SiLU)) and _triton_applies(gate, up):
        n = gate.shape[-1]
        try:
            from specops.score.kernels.silu_mul import silu_mul as kernel

            return kernel(gate.reshape(-1, n), up.reshape(-1, n)).view(gate.shape)
        except Exception as error:  # noqa: BLE001 (as in norm_rope)
            _triton_failed(error)
    return act_fn(gate).mul_(up)
