"""Codes of 4 or 5 bits stored two to a byte: what a `GroupedInt8Weight` holds instead of int8 codes where they fit.

A decode step reads every weight once, and its products are bound by memory: a GGUF Q5_0 weight held as int8 codes
is read at 1.125 bytes per weight (code and scale), 1.6x the file's 0.69. Packed, its codes take 0.625 bytes (a
nibble plus a bit), so Gemma 3 270M's Q4_K_M file is read at ~270 MB a token instead of ~306.

Layout (kernels/cpu/csrc/grouped_linear.c unpacks it in registers; a GGUF Q4_0 / Q5_0 block's quants are laid out
the same way): the stored value of a code is `code + zero` (0..15 for 4-bit codes, 0..31 for 5-bit ones). Per 32
inputs k0.. of an output, 16 bytes of `nibbles` whose byte j holds value k0 + j in its low nibble and value k0 + 16 + j
in its high one; for 5-bit codes one 32-bit word of `high` whose bit j is bit 4 of value k0 + j. `zero` is the
smallest range the codes fit, fixed by the bit width and sign (0 or 8 for 4 bits, 0 or 16 for 5), so sibling weights
of one format pack alike and fuse without unpacking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (bits, zero) in the order tried: codes in [-zero, 2**bits - zero)
_RANGES = ((4, 0), (4, 8), (5, 0), (5, 16))
_BIT_WEIGHTS = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)


@dataclass(eq=False)
class PackedCodes:
    nibbles: torch.Tensor  # [out, in // 2] uint8
    high: torch.Tensor | None  # [out, in // 32] int32 (bit j: bit 4 of value k0 + j); None: 4-bit codes
    zero: int  # code = stored value - zero

    def __post_init__(self):
        out, half = self.nibbles.shape
        if (self.nibbles.dtype != torch.uint8 or half % 16 or self.zero not in (0, 8, 16)
                or (self.high is not None and (self.high.dtype != torch.int32
                                               or tuple(self.high.shape) != (out, half // 16)))):
            raise ValueError(f"packed codes: nibbles {tuple(self.nibbles.shape)} {self.nibbles.dtype}, high "
                             f"{None if self.high is None else tuple(self.high.shape)}, zero {self.zero} are not "
                             f"one weight's codes")

    @property
    def shape(self) -> tuple[int, int]:
        return self.nibbles.shape[0], self.nibbles.shape[1] * 2

    @property
    def bits(self) -> int:
        return 4 if self.high is None else 5

    @property
    def device(self) -> torch.device:
        return self.nibbles.device

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.nibbles,) if self.high is None else (self.nibbles, self.high)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @classmethod
    def pack(cls, codes: torch.Tensor) -> PackedCodes | None:
        """`codes` `[out, in]` int8 packed in the fewest bits their range takes; None when they take more than 5 bits
        or `in` is not a multiple of 32."""
        if codes.dim() != 2 or codes.dtype != torch.int8 or codes.shape[1] % 32 or codes.numel() == 0:
            return None
        low, high = int(codes.min()), int(codes.max())
        fit = next(((bits, zero) for bits, zero in _RANGES if -zero <= low and high < (1 << bits) - zero), None)
        if fit is None:
            return None
        bits, zero = fit
        out, in_features = codes.shape
        values = (codes.to(torch.int16) + zero).view(out, in_features // 32, 32)  # [out, blocks, 32], 0..31
        low_nibbles = (values & 0x0F).to(torch.uint8)
        nibbles = low_nibbles[..., :16] | (low_nibbles[..., 16:] << 4)
        plane = None
        if bits == 5:
            words = (((values >> 4) & 1).to(torch.int64) * _BIT_WEIGHTS).sum(-1)  # [out, blocks] 0..2**32 - 1
            plane = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).contiguous()
        return cls(nibbles.reshape(out, in_features // 2).contiguous(), plane, zero)

    def unpack(self) -> torch.Tensor:
        """The int8 codes `[out, in]`."""
        out, in_features = self.shape
        packed = self.nibbles.view(out, in_features // 32, 16)
        values = torch.cat([packed & 0x0F, packed >> 4], dim=-1).to(torch.int16)  # [out, blocks, 32]
        if self.high is not None:
            words = self.high.to(torch.int64) & 0xFFFFFFFF
            bits = (words.unsqueeze(-1) >> torch.arange(32, device=words.device)) & 1
            values = values | (bits.to(torch.int16) << 4)
        return (values - self.zero).to(torch.int8).view(out, in_features)

    def rows(self, index: torch.Tensor | slice) -> PackedCodes:
        """The codes of the outputs `index` (a 1-D index tensor or a slice)."""
        return PackedCodes(self.nibbles[index].contiguous(),
                           None if self.high is None else self.high[index].contiguous(), self.zero)

    def to(self, device: torch.device | str) -> PackedCodes:
        return PackedCodes(self.nibbles.to(device), None if self.high is None else self.high.to(device), self.zero)

    @staticmethod
    def cat(parts: list[PackedCodes]) -> PackedCodes | None:
        """The parts' outputs one after another, when they pack alike (same bits and zero); else None."""
        if any(p.zero != parts[0].zero or p.bits != parts[0].bits for p in parts):
            return None
        return PackedCodes(torch.cat([p.nibbles for p in parts]),
                           None if parts[0].high is None else torch.cat([p.high for p in parts]), parts[0].zero)
