"""GGUF blocks -> `GroupedInt8Weight`: every supported block type de-quantizes to exactly the gguf package's values
(the de-quantization transformers loads GGUF files with), for bytes written by the gguf package's own quantizer where
it has one and for arbitrary bytes (every code and scale pattern) for all; what it cannot read it refuses by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from tgi_vlm.quantization.gguf_blocks import BLOCKS, UnsupportedBlocks, decode_blocks

# Where each block type keeps float16 numbers (d, and m/dmin), byte offsets: random bytes there could be NaN or inf.
HALF_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
               "Q6_K": [208]}


def random_blocks(type_name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    block, size = BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, size), dtype=np.uint8)
    for offset in HALF_FIELDS[type_name]:
        halves = (rng.normal(size=len(raw)) * 0.05).astype(np.float16)
        raw[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks_per_row * size)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.astype(np.float32).view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("type_name", sorted(BLOCKS))
def test_every_block_type_dequantizes_bit_for_bit_as_the_gguf_package_does_on_arbitrary_bytes(type_name):
    block, _ = BLOCKS[type_name]
    for seed, (rows, per_row) in enumerate([(1, 1), (3, 2), (5, 4)]):
        raw = random_blocks(type_name, rows, per_row, seed)
        reference = gguf.quants.dequantize(raw, getattr(GGMLQuantizationType, type_name))
        weight = decode_blocks(raw, type_name, rows, block * per_row, tensor="blk.0.ffn_up.weight")
        assert weight.shape == (rows, block * per_row)
        assert weight.codes.dtype.is_floating_point is False and weight.group in (16, 32)
        assert same_bits(reference, weight.dequantize().numpy()), type_name
        # a few rows alone (the embedding's lookups) are the same rows of the whole
        picked = weight.dequantize(rows=torch.tensor([rows - 1, 0])).numpy()
        assert same_bits(reference[[rows - 1, 0]], picked)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_blocks_written_by_the_gguf_quantizer_read_back_to_its_dequantization_and_near_the_floats(type_name):
    qtype = getattr(GGMLQuantizationType, type_name)
    floats = np.random.default_rng(7).normal(size=(6, 128)).astype(np.float32)
    raw = gguf.quants.quantize(floats, qtype)
    weight = decode_blocks(raw, type_name, 6, 128, tensor="token_embd.weight")
    values = weight.dequantize().numpy()
    assert same_bits(gguf.quants.dequantize(raw, qtype), values)
    step = {"Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 1 / 15, "Q5_0": 1 / 16, "Q5_1": 1 / 31}[type_name]
    assert np.abs(values - floats).max() <= step * np.abs(floats).max() * 1.01  # within one code step of the input


def test_a_type_without_a_decoder_is_refused_naming_the_tensor_and_the_supported_types():
    with pytest.raises(UnsupportedBlocks, match=r"tensor blk\.3\.attn_q\.weight: GGUF type Q2_K is not supported "
                                                r"\(supported: Q8_0, .*Q6_K, F32, F16, BF16\)"):
        decode_blocks(np.zeros(84, dtype=np.uint8), "Q2_K", 1, 256, tensor="blk.3.attn_q.weight")


def test_bytes_that_are_not_whole_blocks_of_whole_rows_are_refused():
    raw = random_blocks("Q8_0", 2, 2, 0)
    with pytest.raises(UnsupportedBlocks, match=r"tensor t: 135 bytes of Q8_0 do not hold 2 rows of 64 inputs"):
        decode_blocks(raw.reshape(-1)[:-1], "Q8_0", 2, 64, tensor="t")
    with pytest.raises(UnsupportedBlocks, match="do not hold 2 rows of 48 inputs"):
        decode_blocks(raw, "Q8_0", 2, 48, tensor="t")  # 48 inputs is not whole blocks of 32
