"""A tiny random LLaMA GGUF file, written offline the way llama.cpp's converter writes one.

`write_tiny_gguf(path, types=None, seed=0)` writes `path`: architecture "llama" at the tiny size of the testing
package (64 wide, 2 layers, 4 query / 2 KV heads of 16, MLP 128; tgi_vlm/testing/sizes.py), its vocabulary the
tiny models' byte-level BPE (tgi_vlm/testing/tokenizer.py, Llama 3's special tokens) exported as a GGUF "gpt2"
tokenizer (tokens, token types, merges, BOS/EOS/pad ids, add-BOS flag, a chat template). Only the `gguf`
package writes it (`GGUFWriter`, `gguf.quants.quantize`), so nothing is downloaded and no llama.cpp is needed.

As llama.cpp's `convert_hf_to_gguf.py` does for llama:

- every 2-D weight is stored under its GGUF name (`token_embd`, `output`, `blk.N.attn_q`, ...) with rows = the
  HF layer's output features; 1-D norm weights are F32;
- `attn_q` / `attn_k` rows are permuted per head (`LlamaModel.permute`: the rotary halves interleaved), which
  transformers' `LlamaTensorProcessor` reverses on load;
- `output.weight` is written (untied lm-head), so transformers builds the model with `tie_word_embeddings=False`.

`types` maps a tensor kind (`token_embd`, `output`, `attn_q`, `attn_k`, `attn_v`, `attn_output`, `ffn_gate`,
`ffn_up`, `ffn_down`) or one tensor's name without `.weight` (`blk.1.ffn_down`, which wins over its kind) to a
GGUF type name: F32, F16, or any type `gguf.quants.quantize` writes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; also MXFP4,
which the shard does not read). The default mix (`DEFAULT_TYPES`) holds Q8_0, Q5_0, Q4_0, Q4_1 and Q5_1 tensors,
with a quantized embedding and lm-head; its attn_q / attn_k are quantized (Q8_0), as in every llama.cpp llama file,
which the shard refuses today (tests/models/test_gguf_serving.py serves q/k/v in F32). Every input width is a
multiple of 32, so every 32-input block type fits.

The weights are normal with `std` (default: the tiny models' initializer range, 0.3, which keeps greedy output
varied), norms 1 + 0.1 * normal. The same arguments give the same bytes.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np

from tgi_vlm.testing.sizes import get_sizes
from tgi_vlm.testing.tokenizer import TokenizerSpec, build_tokenizer

KINDS = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

DEFAULT_TYPES: dict[str, str] = {
    "token_embd": "Q5_1",
    "output": "Q8_0",
    "attn_q": "Q8_0",
    "attn_k": "Q8_0",
    "attn_v": "Q8_0",
    "attn_output": "Q5_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_1",
    "ffn_down": "Q4_0",
}

TOKENS = TokenizerSpec(named={"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                              "pad_token": "<|pad|>"})

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

ROPE_THETA = 10000.0
RMS_EPS = 1e-5
CONTEXT_LENGTH = 4096


def llama_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): an HF q/k projection's rows -> the file's."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def tensor_type(name: str, types: dict[str, str]) -> str:
    """The GGUF type name `name` (a 2-D weight's GGUF name) is written in under `types`."""
    stem = name.removesuffix(".weight")
    return types.get(stem) or types[stem.rsplit(".", 1)[-1]]


def hf_weights(seed: int = 0, std: float | None = None, vocab: int | None = None) -> dict[str, np.ndarray]:
    """The random float32 weights, by GGUF name, in the HF layout (q/k not yet permuted), as `write_tiny_gguf`
    draws them for `seed`."""
    s = get_sizes("tiny")
    std = s.initializer_range if std is None else std
    vocab = len(_tokenizer(seed)) if vocab is None else vocab
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(s.hidden)).astype(np.float32)

    weights = {"token_embd.weight": normal(vocab, s.hidden)}
    for i in range(s.layers):
        blk = f"blk.{i}"
        weights |= {
            f"{blk}.attn_norm.weight": norm(),
            f"{blk}.attn_q.weight": normal(s.heads * s.head_dim, s.hidden),
            f"{blk}.attn_k.weight": normal(s.kv_heads * s.head_dim, s.hidden),
            f"{blk}.attn_v.weight": normal(s.kv_heads * s.head_dim, s.hidden),
            f"{blk}.attn_output.weight": normal(s.hidden, s.heads * s.head_dim),
            f"{blk}.ffn_norm.weight": norm(),
            f"{blk}.ffn_gate.weight": normal(s.intermediate, s.hidden),
            f"{blk}.ffn_up.weight": normal(s.intermediate, s.hidden),
            f"{blk}.ffn_down.weight": normal(s.hidden, s.intermediate),
        }
    weights |= {"output_norm.weight": norm(), "output.weight": normal(vocab, s.hidden)}
    return weights


def write_tiny_gguf(path: str | Path, *, types: dict[str, str] | None = None, seed: int = 0,
                    std: float | None = None) -> Path:
    """Write the tiny LLaMA GGUF file to `path` (its directory is created) and return `path`. `types` override
    `DEFAULT_TYPES` per kind or per tensor (see the module docstring)."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    types = {**DEFAULT_TYPES, **(types or {})}
    unknown = [k for k in types if k not in KINDS and not k.startswith("blk.")]
    if unknown:
        raise ValueError(f"unknown tensor kinds {unknown}; expected {', '.join(KINDS)} or blk.N.<kind>")
    s = get_sizes("tiny")
    tokenizer = _tokenizer(seed)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_vocab_size(len(tokenizer))
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.intermediate)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    _add_tokenizer(writer, tokenizer)

    for name, values in hf_weights(seed, std, len(tokenizer)).items():
        if values.ndim == 1:
            writer.add_tensor(name, values)  # norms: F32, as llama.cpp keeps them
            continue
        if ".attn_q." in name:
            values = llama_permute(values, s.heads, s.heads)
        elif ".attn_k." in name:
            values = llama_permute(values, s.heads, s.kv_heads)
        qtype = gguf.GGMLQuantizationType[tensor_type(name, types)]
        data = gguf.quants.quantize(values, qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (gguf.GGMLQuantizationType.F32,
                                                                   gguf.GGMLQuantizationType.F16) else qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@lru_cache(maxsize=4)
def _tokenizer(seed: int):
    """The trained tokenizer for `seed` (trained once per process: it is only read)."""
    return build_tokenizer(TOKENS, seed=seed, num_merges=get_sizes("tiny").num_merges)


def _add_tokenizer(writer, tokenizer) -> None:
    """The tokenizer as llama.cpp's converter writes a byte-level BPE: tokens in id order (in the byte-to-unicode
    spelling of vocab.json), special tokens CONTROL, merges as "a b" strings, the special ids and flags."""
    import gguf

    vocab = tokenizer.get_vocab()
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    if None in tokens:
        raise ValueError("the tokenizer's ids are not 0..n-1")
    specials = set(tokenizer.all_special_tokens)
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
