"""The order the head's argmax follows, and the combine of the tiles' partials (torch only).

torch.argmax over a row returns the first index of its maximum, a NaN counting above every number
(the first NaN, if any). The fused head reduces each tile of the vocabulary to one (value, index) per
row with `takes_first`, the same order written with operators alone, so that one text serves the
kernel (which compiles it with triton.jit) and the CPU tests (which fold it over torch tensors).
"""

from __future__ import annotations

import torch


def takes_first(value_a, index_a, value_b, index_b):
    """Whether (value_a, index_a) comes before (value_b, index_b): NaN first, then the larger value,
    then the lower index. A total order, so any reduction tree gives torch.argmax's answer."""
    nan_a = value_a != value_a
    nan_b = value_b != value_b
    level = (value_a == value_b) | (nan_a & nan_b)
    return (nan_a & ~nan_b) | (value_a > value_b) | (level & (index_a < index_b))


def combine_partials(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the best tile's partial: values/indices [rows, tiles], tiles in vocabulary
    order, each holding its tile's maximum and first index of it -> token ids [rows] (long).

    torch.argmax over the tiles picks the first tile holding the maximum (or the first NaN); as the tiles
    are in order, that tile's index is the lowest among equal maxima over the whole vocabulary."""
    best_tile = values.argmax(dim=-1, keepdim=True)
    return indices.gather(-1, best_tile).squeeze(-1).long()
