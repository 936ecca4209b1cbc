"""The shipped GGUF file itself (Gemma 3 270M, Q4_K_M: Q8_0 embedding / lm-head, Q5_0, Q4_K, Q6_K tensors), served
by the engine from the `.gguf` file with its quantized tensors kept quantized, against independent references:

- every quantized tensor of the file, decoded by the loader (quantization/gguf_blocks.py), equals the gguf package's
  own de-quantization (`gguf.quants.dequantize`, what transformers' GGUF reader uses) bit for bit;
- served in float32, greedy tokens equal transformers' float32 greedy on the de-quantized model for 16 tokens of
  each prompt, and the perplexity of a fixed text (tests/real/perplexity_text.md, through prefill logprobs as TGI's
  `decoder_input_details` asks for them) is within 0.5% of transformers' on the de-quantized weights;
- the weights the shard keeps are at most 1.3x the file's size.

Marked `real_model` (make test-real), like test_gemma3_270m.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.reference import hf_greedy
from tests.real.test_gemma3_270m import PROMPTS, N, hf_model
from tgi_vlm.config import EngineConfig
from tgi_vlm.models import get_model
from tgi_vlm.testing.harness import Runner, make_request

pytestmark = pytest.mark.real_model

TEXT = Path(__file__).with_name("perplexity_text.md")


@pytest.fixture(scope="module")
def gguf_path():
    real_models = pytest.importorskip("tgi_vlm.testing.real_models")
    try:
        return real_models.gemma3_270m_gguf()
    except real_models.RealModelUnavailable as exc:
        pytest.fail(f"the real-model tests need the real-models extra: {exc}")


@pytest.fixture(scope="module")
def dequantized_dir(gguf_path):
    from tgi_vlm.testing import real_models

    return real_models.gemma3_270m_dir()


@pytest.fixture(scope="module")
def engine_f32(gguf_path):
    return get_model(str(gguf_path), EngineConfig(device="cpu", dtype="float32", cpu_kv_cache_bytes=256 << 20))


def test_every_quantized_tensor_decodes_to_the_gguf_packages_values_bit_for_bit(gguf_path):
    import gguf

    from tgi_vlm.quantization.gguf_blocks import decode_blocks

    reader = gguf.GGUFReader(gguf_path)
    seen = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind in ("F32", "F16", "BF16"):
            continue
        seen.add(kind)
        rows, width = int(np.prod(tensor.shape[1:])), int(tensor.shape[0])  # GGUF lists the inner dimension first
        reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(rows, width)
        ours = decode_blocks(tensor.data, kind, rows, width, tensor=tensor.name).dequantize().numpy()
        assert np.array_equal(reference.view(np.uint32), ours.view(np.uint32)), tensor.name
    assert seen == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}


def test_the_kept_weights_are_at_most_1_3x_the_file(engine_f32, gguf_path):
    from tgi_vlm.layers.weight_memory import weight_bytes

    kept = weight_bytes(engine_f32.model)
    print(f"weights kept: {kept / 1e6:.1f} MB for a {gguf_path.stat().st_size / 1e6:.1f} MB file")
    assert kept <= 1.3 * gguf_path.stat().st_size


def test_float32_greedy_tokens_from_the_file_are_transformers_on_the_dequantized_model(engine_f32, dequantized_dir):
    runner = Runner(engine_f32)
    runner.prefill([make_request(i, p, max_new_tokens=N) for i, p in enumerate(PROMPTS)])
    runner.run()
    assert engine_f32.kv_blocks_in_use == 0
    model = hf_model(dequantized_dir, torch.float32)
    tokenizer = engine_f32.tokenizer
    for i, prompt in enumerate(PROMPTS):
        ref = hf_greedy(model, dict(tokenizer(prompt, return_tensors="pt")), N)
        assert runner.tokens[i] == ref.ids, (prompt, tokenizer.decode(runner.tokens[i]), tokenizer.decode(ref.ids))


def test_perplexity_through_prefill_logprobs_is_within_half_a_percent_of_transformers(engine_f32, dequantized_dir):
    text = TEXT.read_text()
    runner = Runner(engine_f32)
    runner.prefill([make_request(0, text, max_new_tokens=1, prefill_logprobs=True, chunk_len=512)])
    while 0 not in runner.generations:
        runner.step()
    runner.run()
    prefill = runner.generations[0][0].prefill_tokens
    ids, ours = list(prefill.ids), list(prefill.logprobs)[1:]  # the first token has no logprob
    assert len(ids) > 2000
    model = hf_model(dequantized_dir, torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    theirs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    ppl_ours, ppl_theirs = math.exp(-sum(ours) / len(ours)), math.exp(-float(theirs.mean()))
    print(f"perplexity over {len(ids)} tokens: served from the GGUF file {ppl_ours:.4f}, transformers on the "
          f"de-quantized weights {ppl_theirs:.4f} ({(ppl_ours / ppl_theirs - 1) * 100:+.3f}%)")
    assert abs(ppl_ours / ppl_theirs - 1) <= 0.005
