"""`argmax_order.takes_first` compiled for Triton, and the combine a kernel's argmax reduction runs with it:
of two (value, index) pairs, the one torch.argmax would pick. Imports triton: import it only where
`specops.score.kernels.applies` says yes."""

from __future__ import annotations

import triton
import triton.language as tl

from specops.score.kernels.argmax_order import takes_first

_takes_first = triton.jit(takes_first)


@triton.jit
def first_max(value_a, index_a, value_b, index_b):
    first = _takes_first(value_a, index_a, value_b, index_b)
    return tl.where(first, value_a, value_b), tl.where(first, index_a, index_b)
