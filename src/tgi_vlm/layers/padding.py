"""Zero padding that writes only the zeros: `F.pad`'s result for padding at the end of one dimension.

`F.pad` fills the whole new tensor with zeros and then copies the input over it: on a prefill's activations (the
linears' rows padded to a bucket, an attention span padded to the flash kernel's blocks) that is twice the memory
traffic of the copy alone.
"""

from __future__ import annotations

import torch


def zero_padded(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`t` extended with zeros along `dim` to `size` (>= its length there)."""
    shape = list(t.shape)
    length, shape[dim] = shape[dim], size
    out = t.new_empty(shape)
    out.narrow(dim, 0, length).copy_(t)
    out.narrow(dim, length, size - length).zero_()
    return out
