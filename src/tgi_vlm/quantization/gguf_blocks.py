"""A GGUF tensor's quantized blocks -> `GroupedInt8Weight` (codes, a scale and an offset per group), exactly.

Each ggml block type stores, per block of 32 (or 256: the "K" types) inputs, small integer codes and the float16
numbers that scale them. Written as codes with a float32 scale (and offset) per group, every type below is exact:
a float16 times a code of at most 8 bits is exact in float32, and `GroupedInt8Weight.dequantize` forms
scale * code - offset in the order the gguf package (transformers' GGUF reader) does, so its values are bit for bit
the gguf package's (tests/unit/test_gguf_blocks.py checks every type against `gguf.quants.dequantize`).

| type | block: inputs, bytes | code | group | W = |
|---|---|---|---:|---|
| Q8_0 | 32, 34: d, 32 x int8 | int8 | 32 | d * q |
| Q4_0 | 32, 18: d, 16 nibble pairs | nibble - 8 | 32 | d * q |
| Q4_1 | 32, 20: d, m, 16 nibble pairs | nibble | 32 | d * q + m |
| Q5_0 | 32, 22: d, 32 high bits, 16 nibble pairs | 5 bits - 16 | 32 | d * q |
| Q5_1 | 32, 24: d, m, high bits, nibbles | 5 bits | 32 | d * q + m |
| Q4_K | 256, 144: d, dmin, 12 bytes of 6-bit scales/mins, 128 nibble pairs | nibble | 32 | (d * sc) * q - dmin * mn |
| Q5_K | 256, 176: as Q4_K plus 32 bytes of high bits | 5 bits | 32 | (d * sc) * q - dmin * mn |
| Q6_K | 256, 210: 128 low nibbles, 64 of 2-bit highs, 16 int8 scales, d | 6 bits - 32 | 16 | (d * sc) * q |

A type not in this table (Q2_K, Q3_K, the IQ types, ...) is refused, naming the tensor and the types read.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tgi_vlm.quantization.grouped import GroupedInt8Weight

# type name -> (inputs per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # codes [n, block] int8, scales [n, g], offsets or None


def _half(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes `[n, 2]` -> float32 `[n, 1]`."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes `[n, ..., 16k]` -> `[n, ..., 2, 16k]`: low nibbles (the first half of the values), then high."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """A little-endian bit field `[n, count // 8]` -> `[n, count]` of 0/1: value i's bit is bit i."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")[:, :count]


def _q8_0(b: np.ndarray) -> Decoded:
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _half(b[:, :2]), None


def _q4_0(b: np.ndarray) -> Decoded:
    codes = _nibbles(b[:, 2:]).reshape(len(b), 32).astype(np.int8) - 8
    return codes, _half(b[:, :2]), None


def _q4_1(b: np.ndarray) -> Decoded:
    codes = _nibbles(b[:, 4:]).reshape(len(b), 32).astype(np.int8)
    return codes, _half(b[:, :2]), -_half(b[:, 2:4])


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    return (_nibbles(qs).reshape(len(qs), 32) | (_high_bits(qh, 32) << 4)).astype(np.int8)


def _q5_0(b: np.ndarray) -> Decoded:
    return _five_bits(b[:, 2:6], b[:, 6:]) - 16, _half(b[:, :2]), None


def _q5_1(b: np.ndarray) -> Decoded:
    return _five_bits(b[:, 4:8], b[:, 8:]), _half(b[:, :2]), -_half(b[:, 2:4])


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per block (sub-blocks 0-3 in the low six bits
    of bytes 0-3 / 4-7; 4-7 in the nibbles of bytes 8-11 with their top two bits in the top bits of bytes 0-7)."""
    low, high, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k(b: np.ndarray) -> Decoded:
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    scales, mins = _k_scales(b[:, 4:16])
    codes = _nibbles(b[:, 16:].reshape(len(b), 4, 32)).reshape(len(b), 256).astype(np.int8)  # 64 per 32 bytes
    return codes, d * scales, dmin * mins


def _q5_k(b: np.ndarray) -> Decoded:
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    scales, mins = _k_scales(b[:, 4:16])
    low = _nibbles(b[:, 48:].reshape(len(b), 4, 32)).reshape(len(b), 8, 32)
    bits = np.unpackbits(np.ascontiguousarray(b[:, 16:48]).reshape(len(b), 32, 1), axis=-1, bitorder="little")
    codes = (low | (bits.transpose(0, 2, 1) << 4)).reshape(len(b), 256).astype(np.int8)  # sub-block i: bit i
    return codes, d * scales, dmin * mins


def _q6_k(b: np.ndarray) -> Decoded:
    n = len(b)
    low = _nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 2, 2, 2, 32)  # [half, nibble, 32-byte part, 32]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 2, 2, 2, 32)  # [half, nib, part, 32]
    # A half's 128 values: [ql[0:32] low, ql[32:64] low, ql[0:32] high, ql[32:64] high] with qh's bit pairs 0,1,2,3.
    codes = ((low | (high << 4)).astype(np.int8) - 32).reshape(n, 256)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return codes, _half(b[:, 208:210]) * scales, None


_DECODERS: dict[str, Callable[[np.ndarray], Decoded]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


class UnsupportedBlocks(ValueError):
    pass


def decode_blocks(raw: np.ndarray, type_name: str, out_features: int, in_features: int, *,
                  tensor: str) -> GroupedInt8Weight:
    """`raw`, a tensor's bytes (any shape, `out_features * in_features` values of `type_name` blocks, rows of
    `in_features` inputs), -> its `GroupedInt8Weight`. Refuses a type without a decoder, and bytes that are not
    whole blocks of whole rows, naming `tensor`."""
    if type_name not in _DECODERS:
        raise UnsupportedBlocks(f"tensor {tensor}: GGUF type {type_name} is not supported (supported: "
                                f"{', '.join(BLOCKS)}, F32, F16, BF16)")
    block, size = BLOCKS[type_name]
    raw = np.asarray(raw).reshape(-1).view(np.uint8)
    if in_features % block or raw.size != out_features * in_features // block * size:
        raise UnsupportedBlocks(f"tensor {tensor}: {raw.size} bytes of {type_name} do not hold {out_features} rows "
                                f"of {in_features} inputs (blocks of {block} inputs, {size} bytes)")
    codes, scales, offsets = _DECODERS[type_name](raw.reshape(-1, size))
    group = block // scales.shape[1]

    def rows(values: np.ndarray, width: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=values.dtype).reshape(out_features, width))

    return GroupedInt8Weight(
        codes=rows(codes, in_features), scales=rows(scales.astype(np.float32), in_features // group),
        offsets=None if offsets is None else rows(offsets.astype(np.float32), in_features // group),
        group=group, source=f"gguf {type_name}")
