"""`--quantize eetq`: a float checkpoint's language-model linears as int8 weight-only, one scale per output channel.

TGI's `eetq` is int8 weight-only with a scale per output channel, quantized at load. Here each weight becomes a
`GroupedInt8Weight` whose one group is the whole row (codes = round(w / s), s = max |w| / 127 per row), computed by the
same kernels as a GGUF file's tensors (layers/linear/grouped.py). The vision tower and projector stay in the model's
dtype (only `language_model`'s linears), and so does a weight another module shares (a tied lm-head's embedding) and a
layer whose width is not a multiple of 16 (the native product's unit).
"""

from __future__ import annotations

import torch

from tgi_vlm.quantization.grouped import GroupedInt8Weight

SOURCE = "int8 per channel"


def quantize_per_channel(weight: torch.Tensor) -> GroupedInt8Weight:
    """`weight` `[out, in]` -> int8 codes and one float32 scale per row (a zero row: scale 1, codes 0)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return GroupedInt8Weight(codes.contiguous(), scale.contiguous(), None, w.shape[1], SOURCE)


def attach_int8_weights(language_model: torch.nn.Module) -> int:
    """Give every plain `nn.Linear` of `language_model` (not shared, width a multiple of 16) its int8 weight for
    the plan (`quantized_weight`), its float parameter replaced by a meta-device placeholder. Returns how many."""
    owners: dict[int, int] = {}
    for module in language_model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    count = 0
    for module in language_model.modules():
        if (type(module) is not torch.nn.Linear or owners[id(module.weight)] != 1 or module.in_features % 16
                or module.weight.is_meta or hasattr(module, "quantized_weight")):  # already quantized (a GGUF file)
            continue
        module.quantized_weight = quantize_per_channel(module.weight)
        module.weight = torch.nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype,
                                                       device="meta"), requires_grad=False)
        count += 1
    return count
