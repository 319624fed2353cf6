"""The head's greedy tokens from half-precision logits, settled in float32 where the rounding could hide them.

A head pass's float32 logits ([768, 248,320] at the real shape, 763 MB) are written by the product and read
back by the argmax: the argmax alone took 0.29-0.65 ms of a 3.0-3.2 ms pass on H100s. Logits rounded to the
weights' half precision are half of those bytes, and the argmax survives the rounding: rounding is
monotonic, so a token whose rounded logit lies two steps or more below the rounded maximum has a float32
logit below the maximum's by at least a step, far more than the float32 roundings by which two products'
sums of the same terms differ. Per row:

- the maximum of its rounded logits (`chunk_maxima`: one read of them) and the floor, one rounding step
  below it (`step_below`);
- the tokens at or above the floor (`near_max`: only the chunks that hold the row's top are read again),
  among which the float32 argmax lies. A token alone there is the answer;
- otherwise those tokens' float32 logits, each from a gathered row of lm_head, and the lowest token of their
  maximum, as torch.argmax breaks ties.

Where a row holds more than CANDIDATES such tokens, or none (a NaN among its logits), it is not settled:
the call returns a flag on the device (`unsettled`), read at the caller's next synchronization, and the
caller takes `TargetHead.argmax` for that pass. As with the fused head, a token can differ from the float32
product's argmax only where two float32 logits lie within their sums' rounding of one another.
"""

from __future__ import annotations

import torch

# Tokens per row whose float32 logits settle a close call. Each costs a gathered row of lm_head per row of
# the pass (10 kB at the real hidden size), so a few.
CANDIDATES = 4


def step_below(values: torch.Tensor) -> torch.Tensor:
    """The next representable value below each of values (float16 or bfloat16): both are sign and
    magnitude in 16 bits, so the step is one unit of the bits' magnitude, away from zero below zero. Below
    zero (either sign) comes the negative value of least magnitude; below -inf and NaN, NaN (a floor that
    no logit reaches)."""
    bits = values.view(torch.int16)
    below = torch.where(values > 0, bits - 1, torch.where(values < 0, bits + 1, bits))
    below = torch.where(values == 0, torch.full_like(bits, -32767), below)
    return below.view(values.dtype)


def rounded_argmax(rows: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [n] long, unsettled [n] bool) for rows [n, hidden] and lm_head weight [vocab, hidden], both of
    one half-precision dtype on a device where the kernels apply (`kernels.applies`); an unsettled row's
    token is not to be used."""
    from specops.score.kernels.near_max import near_max
    from specops.score.kernels.row_argmax import chunk_maxima

    vocab = weight.shape[0]
    logits = torch.mm(rows, weight.T)
    chunk_values, _ = chunk_maxima(logits)
    top = chunk_values.max(dim=-1).values
    floor = step_below(top.to(logits.dtype)).float()
    found, count = near_max(logits, chunk_values, floor, CANDIDATES)
    tokens = torch.where(found >= 0, found.long(), vocab)
    exact = float32_logits(rows, weight, tokens.clamp_max(vocab - 1)).masked_fill(found < 0, float("-inf"))
    best = exact.max(dim=-1, keepdim=True).values
    token = torch.where(exact == best, tokens, vocab).min(dim=-1).values
    # No token found, more than there is room for, or a NaN among the float32 logits (no token equals it).
    return token, (count < 1) | (count > CANDIDATES) | (token >= vocab)


def float32_logits(rows: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[n, k] float32 logits of rows [n, hidden] at tokens [n, k]: each row's products with its tokens' rows
    of the weight, half-precision inputs accumulated and returned in float32."""
    gathered = weight[tokens]  # [n, k, hidden]
    column = rows[:, :, None]
    if rows.is_cuda:
        try:
            return torch.bmm(gathered, column, out_dtype=torch.float32).squeeze(-1)
        except (TypeError, RuntimeError, NotImplementedError):
            pass  # a torch without bmm(out_dtype=): upcast below
    return torch.bmm(gathered.float(), column.float()).squeeze(-1)
