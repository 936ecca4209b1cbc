"""`zero_padded` is `F.pad` at the end of one dimension, bit for bit, for every dtype and dimension it is used on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tgi_vlm.layers.padding import zero_padded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dim,size", [((140, 640), 0, 160), ((1, 4, 60, 256), 2, 64), ((3, 5), 1, 5),
                                            ((1, 2, 33, 8), 2, 64)])
def test_zero_padding_equals_f_pad(shape, dim, size, dtype):
    t = torch.randn(shape).to(dtype)
    pad = [0, 0] * (len(shape) - 1 - dim) + [0, size - shape[dim]]
    out = zero_padded(t, dim, size)
    assert out.shape == F.pad(t, pad).shape and torch.equal(out, F.pad(t, pad))
    assert out.is_contiguous()
