"""A model path that is a GGUF file: load it through transformers, keep its quantized tensors quantized.

`GgufFile.find(model_id)` says whether `model_id` is a `.gguf` file, or a directory holding exactly one and no
safetensors; transformers reads its config, tokenizer (and chat template, where the file carries one) and model
(`from_pretrained(directory, gguf_file=name)`, the `pretrained_args`). transformers de-quantizes every tensor at load;
`attach_quantized_weights` then reads the file's quantized tensors itself (gguf's memory-mapped reader), decodes
them into `GroupedInt8Weight`s (gguf_blocks.py), checks each against the weight transformers loaded (bit for bit in
the model's dtype: the name mapping, the row order, the values), hangs it on its linear layer for the linear plan
(layers/linear/plan.py gives it a `GroupedInt8Linear`), replaces a quantized token embedding with a
`QuantizedEmbedding` (a tied lm-head shares its table) and releases the de-quantized copies. What stays in memory
is the codes and scales: about 1.06x the file's bytes for Q8_0 tensors, 1.64x for Q5_0, 2.22x for Q4_K as
loaded; 1.09x and 1.33x once the plan holds 4- / 5-bit codes packed (quantization/grouped.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from loguru import logger

from tgi_vlm.quantization.gguf_blocks import BLOCKS, UnsupportedBlocks, decode_blocks
from tgi_vlm.quantization.gguf_file import GgufFile, GgufLoadError
from tgi_vlm.quantization.grouped import GroupedInt8Weight

_PLAIN_TYPES = ("F32", "F16", "BF16")


@dataclass
class AttachedWeights:
    """What `attach_quantized_weights` did: per module name the block type kept; the bytes kept."""

    types: dict[str, str] = field(default_factory=dict)
    embedding: str | None = None
    quantized_bytes: int = 0

    def summary(self) -> str:
        from collections import Counter

        counts = Counter(self.types.values())
        kinds = ", ".join(f"{n} x {t}" for t, n in sorted(counts.items()))
        embed = f"; embedding {self.embedding}" if self.embedding else ""
        return f"{len(self.types)} quantized tensors kept quantized ({kinds}){embed}; {self.quantized_bytes / 1e6:.1f} MB"


def tensor_processor(model: torch.nn.Module, reader):
    """transformers' GGUF tensor processor for the file's architecture (what it does to a tensor on load)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    arch = _field(reader, "general.architecture")
    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())


def hf_names(model: torch.nn.Module, processor) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, by transformers' GGUF name mapping."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    return get_gguf_hf_weights_map(model, processor)


def row_order(processor, tensor_name: str, rows: int) -> np.ndarray | None:
    """The order transformers puts a tensor's rows in on load, where its processor moves whole rows (llama.cpp stores
    a llama's q/k rows permuted per head for its rotary; transformers' processor undoes that): found by processing
    the row numbers themselves. None where the rows stay as stored or the processor does something else (then the
    equality check decides)."""
    probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    try:
        moved = np.asarray(processor.process(weights=probe, name=tensor_name).weights)
    except Exception:  # noqa: BLE001 - a processor that expects real weights: no row order to read
        return None
    if moved.shape != probe.shape:
        return None
    order = moved.reshape(-1)
    if np.array_equal(order, probe.reshape(-1)) or not np.array_equal(np.sort(order), probe.reshape(-1)):
        return None
    return order.astype(np.int64)


def _field(reader, key: str):
    entry = reader.fields.get(key)
    return None if entry is None else entry.contents()


def attach_quantized_weights(model: torch.nn.Module, gguf_file: GgufFile) -> AttachedWeights:
    """Keep `gguf_file`'s quantized tensors quantized in `model` (loaded from it by transformers), checked equal to
    what transformers loaded. Refuses, naming the file and tensor, a tensor type it cannot decode and a tensor whose
    decoded values differ from the loaded ones."""
    reader = gguf_file.reader()
    processor = tensor_processor(model, reader)
    names = hf_names(model, processor)
    attached = AttachedWeights()
    modules = dict(model.named_modules())
    embedding = model.get_input_embeddings()
    shared: dict[int, GroupedInt8Weight] = {}  # parameter id -> its table (a tied lm-head shares the embedding's)
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if type_name in _PLAIN_TYPES:
            continue
        where = f"{gguf_file.path.name}: tensor {tensor.name}"
        if type_name not in BLOCKS:
            raise GgufLoadError(f"{where} has GGUF type {type_name}, which this shard cannot read (supported: "
                                f"{', '.join(BLOCKS)}, {', '.join(_PLAIN_TYPES)})")
        param_name = names.get(tensor.name)
        module = modules.get(param_name.rsplit(".", 1)[0]) if param_name and param_name.endswith(".weight") else None
        if module is None or type(module) is not torch.nn.Linear and not isinstance(module, torch.nn.Embedding):
            logger.warning("{}: {} kept de-quantized (not a linear layer's or the embedding's weight)", where,
                           param_name)
            continue
        out_features, in_features = module.weight.shape
        try:
            weight = decode_blocks(tensor.data, type_name, out_features, in_features, tensor=tensor.name)
        except UnsupportedBlocks as error:
            raise GgufLoadError(f"{gguf_file.path.name}: {error}") from error
        order = row_order(processor, tensor.name, out_features)
        if order is not None:  # whole rows move: exact on the codes, scales and offsets alike
            weight = weight.rows_in_order(torch.from_numpy(order))
        weight = weight.to(module.weight.device)  # where the model is (a GPU: computed there by torch's ops)
        _check_equal(weight, module.weight, where, param_name)
        shared[id(module.weight)] = weight
        attached.types[param_name.rsplit(".", 1)[0]] = type_name
        attached.quantized_bytes += weight.nbytes
    _hand_over(model, modules, embedding, shared, attached)
    logger.info("{}: {}", gguf_file.path.name, attached.summary())
    return attached


def _check_equal(weight: GroupedInt8Weight, loaded: torch.Tensor, where: str, param_name: str) -> None:
    """The decoded tensor in the model's dtype is, bit for bit, what transformers loaded for `param_name`."""
    rows = loaded.shape[0]
    step = max(1, (1 << 24) // max(1, loaded.shape[1]))  # ~16M values at a time
    for start in range(0, rows, step):
        part = slice(start, min(rows, start + step))
        if not torch.equal(weight.dequantize(rows=part).to(loaded.dtype), loaded[part]):
            raise GgufLoadError(f"{where}: its {weight.source} blocks decode to other values than transformers "
                                f"loaded for {param_name} (rows {part.start}..{part.stop - 1}); not served "
                                "quantized rather than served wrong")


def _hand_over(model: torch.nn.Module, modules: dict[str, torch.nn.Module], embedding: torch.nn.Module,
               tables: dict[int, GroupedInt8Weight], attached: AttachedWeights) -> None:
    """Quantized tables to their owners: the embedding module replaced, linears given `quantized_weight` for the
    plan; then every de-quantized copy released (a meta-device placeholder keeps each parameter's shape and dtype)."""
    from tgi_vlm.layers.quantized_embedding import QuantizedEmbedding

    if isinstance(embedding, torch.nn.Embedding) and id(embedding.weight) in tables:
        model.set_input_embeddings(QuantizedEmbedding.replacing(embedding, tables[id(embedding.weight)]))
        attached.embedding = tables[id(embedding.weight)].source
    for module in modules.values():
        if type(module) is torch.nn.Linear and id(module.weight) in tables:  # exactly the class the plan gives kernels
            module.quantized_weight = tables[id(module.weight)]
            module.weight = torch.nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype,
                                                           device="meta"), requires_grad=False)
