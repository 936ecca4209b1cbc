"""A quantized weight as int8 codes with a float32 scale (and optionally an offset) per group of inputs.

`GroupedInt8Weight` is the one in-memory form the shard computes quantized linear layers and embeddings from:
W[o, k] = scales[o, k // group] * codes[o, k] - offsets[o, k // group]. Every block type this package reads (a GGUF
file's Q8_0, Q5_0, Q4_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K; quantization/gguf_blocks.py) is exactly this form, so
`dequantize` gives, bit for bit, the float32 values the format defines (the gguf package's de-quantization, which
transformers uses, computes the same products in the same order). Codes take a byte each as loaded; where the
native kernel computes the layer (layers/linear/grouped.py), codes of 4 or 5 bits are then held packed
(`PackedCodes`, quantization/packed_codes.py). Bytes per 32 weights against the file's: Q5_0 24 (16 nibble bytes, a
high-bit word, a float32 scale) instead of 36, the file 22: 1.09x instead of 1.64x; Q4_K 24 (with the offsets)
instead of 40, the file 18: 1.33x instead of 2.22x; Q8_0 and Q6_K stay int8 (1.06x, 1.52x). One kernel serves every type (kernels/cpu/csrc/grouped_linear.c).

A GPTQ checkpoint quantized in activation order (`desc_act`) groups inputs that are not neighbours (its `g_idx` names
each input's group). Such a weight keeps its columns sorted by group (`input_order`: stored column j is the layer's
input `input_order[j]`), so every group is contiguous again, and its kernel gathers x's columns in the same order
(x[:, order] @ W[:, order]^T = x @ W^T: a permutation of the sum's terms, exact up to the sum's rounding order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgi_vlm.quantization.packed_codes import PackedCodes


@dataclass(eq=False)
class GroupedInt8Weight:
    codes: torch.Tensor | PackedCodes  # [out, in] int8, or packed (`store_packed`)
    scales: torch.Tensor  # [out, in // group] float32
    offsets: torch.Tensor | None  # [out, in // group] float32, subtracted; None: symmetric codes
    group: int  # inputs per scale: 16 or 32 (GGUF blocks), the whole row (--quantize eetq); the native kernel: x16
    source: str  # where it came from, for the plan's log: "gguf Q5_0"
    input_order: torch.Tensor | None = None  # [in] int64: stored column j is the layer's input input_order[j]

    def __post_init__(self):
        out, in_features = self.codes.shape
        groups = (out, in_features // self.group)
        packed = isinstance(self.codes, PackedCodes)
        if ((not packed and self.codes.dtype != torch.int8) or in_features % self.group or tuple(self.scales.shape) != groups
                or (self.offsets is not None and tuple(self.offsets.shape) != groups)
                or (self.input_order is not None and tuple(self.input_order.shape) != (in_features,))):
            raise ValueError(f"{self.source}: codes {tuple(self.codes.shape)} "
                             f"{'packed' if packed else self.codes.dtype}, scales "
                             f"{tuple(self.scales.shape)}, group {self.group} do not describe one weight")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor it holds (the codes' own when packed)."""
        codes = self.codes.tensors if isinstance(self.codes, PackedCodes) else (self.codes,)
        return tuple(t for t in (*codes, self.scales, self.offsets, self.input_order) if t is not None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors if t is not self.input_order)

    def int8_codes(self) -> torch.Tensor:
        """The codes `[out, in]` as int8 (unpacked when held packed)."""
        return self.codes.unpack() if isinstance(self.codes, PackedCodes) else self.codes

    def store_packed(self) -> bool:
        """Hold the codes packed from now on where they fit 4 or 5 bits (every holder of this weight, an embedding
        sharing it included, reads them through `int8_codes` / `dequantize`). Returns whether they are packed."""
        if not isinstance(self.codes, PackedCodes):
            packed = PackedCodes.pack(self.codes)
            if packed is None:
                return False
            self.codes = packed
        return True

    def to(self, device: torch.device | str) -> GroupedInt8Weight:
        """The same weight on `device` (itself where it is there already)."""
        if self.codes.device == torch.device(device):
            return self
        return GroupedInt8Weight(self.codes.to(device), self.scales.to(device),
                                 None if self.offsets is None else self.offsets.to(device), self.group, self.source,
                                 None if self.input_order is None else self.input_order.to(device))

    def rows_in_order(self, order: torch.Tensor) -> GroupedInt8Weight:
        """The same weight with its output rows taken in `order` (a permutation of the rows)."""
        codes = self.codes.rows(order) if isinstance(self.codes, PackedCodes) else self.codes[order].contiguous()
        return GroupedInt8Weight(codes, self.scales[order].contiguous(),
                                 None if self.offsets is None else self.offsets[order].contiguous(), self.group,
                                 self.source, self.input_order)

    def dequantize(self, rows: torch.Tensor | slice | None = None, *, stored_order: bool = False) -> torch.Tensor:
        """The float32 weight `[out, in]` (or only `rows`: a 1-D index tensor or a slice of the outputs), its columns
        in the layer's input order (`stored_order`: as stored, for a product with x's columns gathered)."""
        codes, scales, offsets = self.codes, self.scales, self.offsets
        if rows is not None:
            codes, scales = codes.rows(rows) if isinstance(codes, PackedCodes) else codes[rows], scales[rows]
            offsets = offsets[rows] if offsets is not None else None
        if isinstance(codes, PackedCodes):
            codes = codes.unpack()
        n, in_features = codes.shape
        values = codes.view(n, -1, self.group).float() * scales.unsqueeze(-1)  # scale * code, then - offset
        if offsets is not None:
            values = values - offsets.unsqueeze(-1)
        values = values.view(n, in_features)
        if self.input_order is None or stored_order:
            return values
        return torch.empty_like(values).index_copy_(1, self.input_order, values)
