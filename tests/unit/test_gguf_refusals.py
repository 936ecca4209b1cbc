"""What the GGUF loader refuses, and that it refuses it at start with the file (and tensor) named: the tiny LLaMA
file of tgi_vlm/testing/tiny_gguf.py, written offline, and broken copies of it.

- a file cut short (in its header, its metadata, a tensor's data, the last tensor's last bytes): `GgufFile.reader()`
  raises `GgufLoadError` naming the file. Served with `get_model`, transformers reads the file first and its own
  error (no file named) came out until `get_model` checked the file first (`GgufFile.check`): it refuses with
  `GgufLoadError` naming the file and the tensor cut short;
- a linear stored in a type the shard cannot decode (MXFP4, which gguf writes and transformers loads):
  `get_model` refuses, naming the file, the tensor and the type;
- a tensor whose decoded blocks differ from what transformers loaded for it (one value of the loaded weight moved
  by one float32 step): `attach_quantized_weights` refuses, naming the file, the tensor, its type and the parameter,
  before it has replaced or attached anything;
- a directory holding two `.gguf` files: `GgufFile.find` and `get_model` refuse, listing both;
- `GgufFile.find` is None for a safetensors model directory (even one that also holds a `.gguf`), a file that is not
  `.gguf` and a hub id, and finds the file given itself or as the only one in its directory.
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tgi_vlm.config import EngineConfig
from tgi_vlm.models import get_model
from tgi_vlm.quantization.gguf_checkpoint import attach_quantized_weights
from tgi_vlm.quantization.gguf_file import GgufFile, GgufLoadError
from tgi_vlm.testing.tiny_gguf import write_tiny_gguf

# q/k/v in F32: a llama file with quantized q/k is refused today whatever else it holds (tests/models/
# test_gguf_serving.py); the rest is the default mix (Q5_1 embedding, Q8_0 lm-head, Q5_0, Q4_1, Q4_0 layers).
TYPES = {"attn_q": "F32", "attn_k": "F32", "attn_v": "F32"}
CONFIG = EngineConfig(device="cpu", dtype="float32", cpu_kv_cache_bytes=16 << 20)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("good") / "tiny.gguf", types=TYPES)


@pytest.fixture(scope="module")
def layout(good):
    """Where the file's parts lie: the metadata's end (the tensor data's start) and the last tensor's span."""
    import gguf

    reader = gguf.GGUFReader(good)
    last = reader.tensors[-1]
    assert last.name == "output.weight"
    return {"data": reader.data_offset, "last": (int(last.data_offset), int(last.data_offset) + int(last.n_bytes))}


def cut_copy(src, dst, keep_bytes: int):
    """A copy of `src` at `dst` holding its first `keep_bytes` bytes."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes()[:keep_bytes])
    return dst


CUTS = {
    "in the header": lambda layout: 10,
    "in the metadata": lambda layout: layout["data"] // 2,
    "in the first tensor's data": lambda layout: layout["data"] + 1000,
    "in the last tensor's last block": lambda layout: layout["last"][1] - 20,
}


@pytest.mark.parametrize("where", CUTS)
def test_a_file_cut_short_is_refused_by_its_reader_naming_the_file(good, layout, tmp_path, where):
    short = cut_copy(good, tmp_path / "cut.gguf", CUTS[where](layout))
    with pytest.raises(GgufLoadError, match=f"^{re.escape(str(short))}: not a readable GGUF file"):
        GgufFile(short).reader()


def test_the_cut_in_the_last_tensor_leaves_its_padding_out_too(good, layout):
    """The last cut falls in output.weight's bytes, not in the file's trailing alignment padding (which a reader
    never needs: a cut there would leave a whole file)."""
    start, end = layout["last"]
    assert start < end - 20 < end <= good.stat().st_size


def test_serving_a_file_cut_short_in_its_last_tensor_is_refused_at_start_naming_the_file_and_tensor(good, layout,
                                                                                                     tmp_path):
    short = cut_copy(good, tmp_path / "cut" / "tiny.gguf", layout["last"][1] - 20)
    with pytest.raises(GgufLoadError, match=r"tiny\.gguf.*output\.weight"):
        get_model(str(short), CONFIG)


def test_a_linear_stored_in_a_type_the_shard_cannot_decode_is_refused_naming_file_tensor_and_type(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", types={**TYPES, "blk.1.ffn_down": "MXFP4"})
    # transformers itself reads it: the refusal is the shard's
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    assert model.model.layers[1].mlp.down_proj.weight.shape == (64, 128)
    message = ("tiny.gguf: tensor blk.1.ffn_down.weight has GGUF type MXFP4, which this shard cannot read "
               "(supported: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F32, F16, BF16)")
    with pytest.raises(GgufLoadError, match=f"^{re.escape(message)}$"):
        get_model(str(path), CONFIG)


PERTURBED = [  # parameter, its GGUF tensor, its type, the rows of the message, the value moved
    ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight", "Q4_0", "rows 0..63", (40, 100)),
    ("model.layers.0.self_attn.o_proj.weight", "blk.0.attn_output.weight", "Q5_0", "rows 0..63", (0, 0)),
    ("model.embed_tokens.weight", "token_embd.weight", "Q5_1", "rows 0..658", (658, 63)),
    ("lm_head.weight", "output.weight", "Q8_0", "rows 0..658", (17, 5)),
]


@pytest.mark.parametrize("param,tensor,type_name,rows,at", PERTURBED, ids=[p[1] for p in PERTURBED])
def test_a_tensor_decoding_to_other_values_than_transformers_loaded_is_refused_naming_it(good, param, tensor,
                                                                                         type_name, rows, at):
    model = AutoModelForCausalLM.from_pretrained(good.parent, gguf_file=good.name, dtype=torch.float32)
    weight = model.get_parameter(param)
    with torch.no_grad():  # one float32 step: the smallest change there is
        weight[at] = float(np.nextafter(np.float32(weight[at].item()), np.float32(np.inf)))
    message = (f"tiny.gguf: tensor {tensor}: its gguf {type_name} blocks decode to other values than transformers "
               f"loaded for {param} ({rows}); not served quantized rather than served wrong")
    with pytest.raises(GgufLoadError, match=f"^{re.escape(message)}$"):
        attach_quantized_weights(model, GgufFile(good))
    # refused before anything changed hands: the embedding is transformers' own, no linear holds a quantized weight
    assert type(model.get_input_embeddings()) is torch.nn.Embedding
    assert not [name for name, m in model.named_modules() if hasattr(m, "quantized_weight")]


def test_the_unperturbed_model_takes_the_same_files_tensors(good):
    """The control for the test above: the same load, nothing moved, is accepted (12 tensors kept quantized)."""
    model = AutoModelForCausalLM.from_pretrained(good.parent, gguf_file=good.name, dtype=torch.float32)
    attached = attach_quantized_weights(model, GgufFile(good))
    assert sorted(set(attached.types.values())) == ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
    assert len(attached.types) == 2 * 4 + 2 and attached.embedding == "gguf Q5_1"


def test_a_directory_holding_two_gguf_files_is_refused_listing_both(good, tmp_path):
    for name in ("b.gguf", "a.gguf"):
        shutil.copy(good, tmp_path / name)
    message = f"{tmp_path} holds 2 GGUF files (a.gguf, b.gguf): pass the path of the one to serve"
    with pytest.raises(GgufLoadError, match=f"^{re.escape(message)}$"):
        GgufFile.find(tmp_path)
    with pytest.raises(GgufLoadError, match=f"^{re.escape(message)}$"):
        get_model(str(tmp_path), CONFIG)
    assert GgufFile.find(tmp_path / "a.gguf") == GgufFile(tmp_path / "a.gguf")  # naming one serves it


def test_find_is_none_for_a_safetensors_model_directory_a_file_not_gguf_and_a_hub_id(good, tmp_path):
    from tgi_vlm.testing import tiny_model_path

    safetensors_dir = tiny_model_path("llama")
    assert GgufFile.find(safetensors_dir) is None
    assert GgufFile.find(safetensors_dir / "config.json") is None
    assert GgufFile.find(safetensors_dir / "model.safetensors") is None
    assert GgufFile.find("meta-llama/Llama-3.2-1B-Instruct") is None
    both = tmp_path / "both"
    both.mkdir()
    shutil.copy(safetensors_dir / "model.safetensors", both)
    shutil.copy(good, both)
    assert GgufFile.find(both) is None  # safetensors weights: a transformers directory, the .gguf beside is not served


def test_find_names_the_file_given_or_the_only_one_in_its_directory(good):
    assert GgufFile.find(good) == GgufFile(good)
    assert GgufFile.find(str(good.parent)) == GgufFile(good)
    assert GgufFile.find(good).pretrained_args() == (str(good.parent), {"gguf_file": "tiny.gguf"})
