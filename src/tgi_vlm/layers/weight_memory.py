"""The bytes a served model's weights occupy: parameters, buffers, and what the planned kernels own.

After the linear plan (layers/linear/plan.py), a layer's weight may live in its kernel (a packed copy, a quantized
`GroupedInt8Weight`) instead of its parameter (released, or a meta-device placeholder), and a quantized embedding
holds its table itself (layers/quantized_embedding.py). `weight_bytes` counts each storage once, wherever it hangs:
what README's memory table reports per format.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tgi_vlm.quantization.grouped import GroupedInt8Weight


def _tensors_of(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, GroupedInt8Weight):
        yield from value.tensors


def _kernel_tensors(kernel) -> Iterator[torch.Tensor]:
    group = getattr(kernel, "group", None)  # a fused member: its group's kernel owns the weights
    if group is not None and hasattr(group, "kernel"):
        kernel = group.kernel
    for value in vars(kernel).values():
        yield from _tensors_of(value)


def weight_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
    for module in model.modules():
        for name in ("linear_kernel", "patch_kernel"):
            kernel = getattr(module, name, None)
            if kernel is not None:
                yield from _kernel_tensors(kernel)
        yield from _tensors_of(getattr(module, "table", None))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct storage among `weight_tensors(model)` (meta placeholders count nothing)."""
    seen: set[int] = set()
    total = 0
    for tensor in weight_tensors(model):
        if tensor.is_meta:
            continue
        if tensor.layout != torch.strided or tensor.is_mkldnn:  # an opaque packed copy: its elements
            key, size = id(tensor), tensor.numel() * tensor.element_size()
        else:
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        if key not in seen:
            seen.add(key)
            total += size
    return total
