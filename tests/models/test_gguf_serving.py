"""A GGUF file served by the engine with its quantized tensors kept quantized: the tiny LLaMA file of
tgi_vlm/testing/tiny_gguf.py (written offline by the gguf package the way llama.cpp's converter writes one; Q5_1
embedding, Q8_0 lm-head, Q5_0 / Q4_1 / Q4_0 layers, F32 norms, a GGUF "gpt2" tokenizer) against transformers' own
load of the same file (`from_pretrained(directory, gguf_file=name)`, which de-quantizes):

- in float32, one batch of three prompts served from the file, and again from the directory holding it, gives
  exactly transformers' greedy tokens (`generate`) for each prompt alone, with every step's logits within 1e-4;
- every quantized tensor of the file computes through an `int8-grouped(gguf <type>)` kernel (gate/up fused, the
  decoder layers on the lean CPU forward), the embedding is a `QuantizedEmbedding` of the file's blocks, and the
  layers keep no de-quantized copy (their parameters are meta-device placeholders);
- in bfloat16 the same batch runs to the requested number of tokens, every one a token of the vocabulary.

Two faults these tests found, fixed: a llama file's q/k projections are stored with their rows permuted per head
(llama.cpp's rotary layout; transformers reverses it on load): the loader takes the decoded rows in transformers'
order (`gguf_checkpoint.row_order`) and serves them quantized too; and the tokenizer transformers builds from the
file holds one id past the embedding's rows (GPT-2's `<|endoftext|>`): a prompt holding that text is refused by
name, the other requests of its batch unaffected.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.models.reference import assert_matches, hf_greedy
from tgi_vlm.config import EngineConfig
from tgi_vlm.layers.linear.grouped import grouped_native_available, packed_native_available
from tgi_vlm.layers.quantized_embedding import QuantizedEmbedding
from tgi_vlm.models import get_model
from tgi_vlm.testing.harness import Runner, make_request
from tgi_vlm.testing.tiny_gguf import DEFAULT_TYPES, write_tiny_gguf

PROMPTS = ["hello world this is", "the quick brown fox jumps over the lazy dog and then some more words", "a"]
N = 12
SERVED_TYPES: dict[str, str] = {}  # tiny_gguf's default mix, q/k/v quantized (Q8_0) too
LAYERS = 2
VOCAB = 659  # the tiny tokenizer's 3 special tokens, 256 bytes and 400 merges: the embedding's rows


def engine_for(model_path, dtype: str):
    return get_model(str(model_path), EngineConfig(device="cpu", dtype=dtype, cpu_kv_cache_bytes=64 << 20))


def serve(engine) -> Runner:
    """The three prompts in one batch, N new tokens each (EOS ignored), run to the end."""
    runner = Runner(engine)
    runner.prefill([make_request(i, p, max_new_tokens=N) for i, p in enumerate(PROMPTS)])
    runner.run()
    assert engine.kv_blocks_in_use == 0
    return runner


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", types=SERVED_TYPES)


@pytest.fixture(scope="module")
def reference(gguf_path):
    """transformers' float32 greedy (tokens and per-step logits) for each prompt alone, from the file."""
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return [hf_greedy(model.eval(), dict(tokenizer(p, return_tensors="pt")), N) for p in PROMPTS]


@pytest.fixture(scope="module")
def engine_f32(gguf_path):
    return engine_for(gguf_path, "float32")


# Codes the native layers hold packed (layers/linear/grouped.py): 4 / 5 bits per code.
PACKED = {"Q5_0": "+packed5", "Q4_0": "+packed4", "Q4_1": "+packed4", "Q5_1": "+packed5", "Q8_0": ""}


def expected_quantized_kernels() -> dict[str, str]:
    """Layer -> kernel name for every linear stored quantized in the served file."""
    native = "+native" if grouped_native_available() else ""
    packs = native and packed_native_available()
    kinds = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    packing = {kind: PACKED[block] if packs else "" for kind, block in DEFAULT_TYPES.items()}
    kernels = {"lm_head": f"int8-grouped(gguf {DEFAULT_TYPES['output']}){native}{packing['output']}"}
    for i in range(LAYERS):
        for layer, kind in kinds.items():
            kernel = f"int8-grouped(gguf {DEFAULT_TYPES[kind]}){native}{packing[kind]}"
            fused = kind in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")
            kernels[f"model.layers.{i}.{layer}"] = f"fused({kernel})" if fused else kernel
    return kernels


def test_the_served_file_holds_q8_0_q5_0_q4_0_q4_1_and_q5_1_tensors(gguf_path):
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(gguf_path).tensors}
    assert set(types.values()) == {"F32", "Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q5_1"}
    assert (types["token_embd.weight"], types["output.weight"]) == ("Q5_1", "Q8_0")


def test_the_files_tokenizer_as_transformers_builds_it_is_the_tiny_models_bpe_with_its_chat_template(gguf_path):
    from tgi_vlm.testing.tiny_gguf import CHAT_TEMPLATE, TOKENS
    from tgi_vlm.testing.tokenizer import build_tokenizer

    ours = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    trained = build_tokenizer(TOKENS, num_merges=400)
    for text in [*PROMPTS, "café naïve 你好 🙂 12345!", "  two  spaces\nand a new line"]:
        assert ours(text)["input_ids"] == trained(text)["input_ids"], text  # BOS first, as the file says
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (0, 1, 2)
    assert ours.chat_template == CHAT_TEMPLATE
    chat = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|begin_of_text|>user: hi\nassistant: "


def test_float32_tokens_served_from_the_file_are_transformers_greedy_with_logits_within_1e_4(engine_f32, reference):
    runner = serve(engine_f32)
    for i, ref in enumerate(reference):
        assert len(ref.ids) == N and len(set(ref.ids)) > 3, ref.ids  # varied output, not one token repeated
        assert_matches(runner, i, ref, atol=1e-4)


def test_every_quantized_tensor_is_kept_quantized_in_an_int8_grouped_kernel(engine_f32):
    plan = engine_f32.linear_plan
    quantized = {name: kernel for name, kernel in plan.kernels.items() if "int8-grouped" in kernel}
    assert quantized == expected_quantized_kernels()
    assert set(plan.kernels) == set(quantized)  # every linear of the file is quantized, q/k (rows permuted) too
    native = "+native" if grouped_native_available() else ""
    packed = PACKED["Q4_1"] if native and packed_native_available() else ""
    gate_up = {f"model.layers.{i}.mlp.gate_proj+up_proj": f"int8-grouped(gguf Q4_1){native}{packed}"
               for i in range(LAYERS)}
    assert {name: kernel for name, kernel in plan.groups.items() if "gate_proj" in name} == gate_up
    qkv = {f"model.layers.{i}.self_attn.q_proj+k_proj+v_proj": f"int8-grouped(gguf Q8_0){native}" for i in range(LAYERS)}
    assert {name: kernel for name, kernel in plan.groups.items() if "q_proj" in name} == qkv
    model = engine_f32.model
    # fused q/k/v and gate/up: the decoder layers run the lean CPU forward over the quantized kernels
    assert [type(layer).__name__ for layer in model.model.layers] == ["LeanLlamaDecoderLayer"] * LAYERS
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, QuantizedEmbedding) and embedding.table.source == "gguf Q5_1"
    assert embedding.table.shape == (VOCAB, 64)
    held = {name: module.weight.device.type for name, module in model.named_modules() if name in quantized}
    assert held == dict.fromkeys(quantized, "meta")  # no de-quantized copy kept


def test_a_directory_holding_the_one_gguf_file_serves_the_same_tokens(gguf_path, reference):
    engine = engine_for(gguf_path.parent, "float32")
    assert {n: k for n, k in engine.linear_plan.kernels.items() if "int8-grouped" in k} == expected_quantized_kernels()
    runner = serve(engine)
    for i, ref in enumerate(reference):
        assert_matches(runner, i, ref, atol=1e-4)


def test_bfloat16_serving_from_the_file_gives_the_requested_number_of_vocabulary_tokens(gguf_path):
    engine = engine_for(gguf_path, "bfloat16")
    assert {n: k for n, k in engine.linear_plan.kernels.items() if "int8-grouped" in k} == expected_quantized_kernels()
    runner = serve(engine)
    assert sorted(runner.tokens) == list(range(len(PROMPTS)))
    for i in range(len(PROMPTS)):
        assert len(runner.tokens[i]) == N
        assert all(0 <= t < VOCAB for t in runner.tokens[i]), runner.tokens[i]


def test_a_prompt_with_a_token_id_past_the_embedding_is_refused_naming_the_request(engine_f32):
    from tgi_vlm.errors import InvalidBatch
    from tgi_vlm.testing.harness import make_batch

    assert max(engine_f32.tokenizer.get_vocab().values()) == VOCAB  # transformers' GGUF tokenizer adds one id
    bad = make_request(7, "hello <|endoftext|> world", max_new_tokens=2)
    with pytest.raises(InvalidBatch, match=rf"request 7: token id {VOCAB} is outside the model's {VOCAB}-token "
                                           r"vocabulary") as refused:
        engine_f32.batch_from_pb(make_batch(3, [make_request(1, "hello world", max_new_tokens=2), bad]))
    assert "request 1" not in str(refused.value)
    runner = Runner(engine_f32)  # the shard keeps serving
    runner.prefill([make_request(1, "hello world", max_new_tokens=2)])
    runner.run()
    assert len(runner.tokens[1]) == 2 and engine_f32.kv_blocks_in_use == 0
