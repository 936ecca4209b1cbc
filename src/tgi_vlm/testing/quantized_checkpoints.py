"""Quantized copies of a float model directory in the formats real tools write: compressed-tensors `pack-quantized`
(llm-compressor's W4A16), GPTQ (AutoGPTQ / gptqmodel) and AWQ GEMM (AutoAWQ), written offline from each format's
published definition (quantization/packed_formats.py states them). For tests and benchmarks: `tgi-vlm quantized-copy`
writes one of the bench model, for the shard and for peers that load these formats (vLLM's CPU build reads
compressed-tensors W4A16 and GPTQ).

`write_quantized_copy(src, dst, method, bits=4, group=128, symmetric=True, act_order=False)` copies every file of
`src`, and in model.safetensors replaces the weight of every linear layer of the language model (transformers'
decoder: not the lm-head, the embedding, the vision tower or the projector) by its packed tensors, under the
checkpoint's own names, then adds the `quantization_config` to config.json. The quantizer is plain round-to-nearest
per group (min/max; symmetric: absmax / (2^(bits-1) - 1)); `act_order` (GPTQ) takes the inputs in a fixed random
order per input width before grouping (GPTQ's desc_act sorts them by its Hessian's diagonal, which layers reading the
same input share, so q/k/v and gate/up share one order) and writes the `g_idx` that results.

Tests read these files with independent code (compressed-tensors' decompressor, AutoAWQ's de-quantization, a formula
written in the test from the format's definition), never only with the shard's reader.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ GEMM word holds output 8c + AWQ_PACK_ORDER[i]


@dataclass
class Quantized:
    """One weight [out, in] as integers: codes q [out, in] (unsigned, 0..2^bits-1), zeros z [out, groups], scales
    s [out, groups] (the checkpoint's dtype), `order` the input order groups were taken in (None: as they are)."""

    q: torch.Tensor
    z: torch.Tensor
    s: torch.Tensor
    order: torch.Tensor | None

    def dequantize(self, group: int) -> torch.Tensor:
        w = (self.q - self.z.repeat_interleave(group, dim=1)).float() * self.s.float().repeat_interleave(group, dim=1)
        if self.order is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.order, w)  # column j of the groups is input order[j]


def quantize(weight: torch.Tensor, bits: int, group: int, *, symmetric: bool, scale_dtype: torch.dtype,
             act_order: bool = False, min_zero: int = 0) -> Quantized:
    """Round-to-nearest `bits`-bit codes per `group` inputs (-1: the whole row); zeros of at least `min_zero`."""
    w = weight.detach().float()
    generator = torch.Generator().manual_seed(w.shape[1])  # one order per input width: siblings share it
    order = torch.randperm(w.shape[1], generator=generator) if act_order else None
    if order is not None:
        w = w[:, order]
    out, in_features = w.shape
    group = in_features if group == -1 else group
    groups = w.view(out, in_features // group, group)
    top = (1 << bits) - 1
    if symmetric:
        s = (groups.abs().amax(-1) / ((1 << (bits - 1)) - 1)).to(scale_dtype)
        z = torch.full(s.shape, 1 << (bits - 1), dtype=torch.int32)
    else:
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        s = ((high - low) / top).to(scale_dtype)
        z = torch.round(-low / s.float().clamp(min=1e-12)).clamp(min_zero, top).to(torch.int32)
    s = torch.where(s.float() > 0, s, torch.ones_like(s))
    q = torch.round(groups / s.float().unsqueeze(-1)) + z.unsqueeze(-1)
    return Quantized(q.clamp(0, top).to(torch.int32).view(out, in_features), z, s, order)


def pack_along_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int [r, c * 32 / bits] (each value in 0..2^bits-1) -> int32 [r, c]: value j of a word at bits j * bits."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (values.to(torch.int64).view(values.shape[0], -1, per_word) << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_along_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_along_columns(values.t().contiguous(), bits).t().contiguous()


def _awq_words(values: torch.Tensor) -> torch.Tensor:
    """[r, 8c] in output order -> AWQ's interleaved int32 words [r, c]."""
    grouped = values.view(values.shape[0], -1, 8)[:, :, list(AWQ_PACK_ORDER)]
    return pack_along_columns(grouped.reshape(values.shape[0], -1), 4)


def packed_tensors(method: str, qw: Quantized, bits: int, *, zeros_minus_one: bool = True) -> dict[str, torch.Tensor]:
    """One layer's tensors (suffix -> tensor) in `method`'s layout."""
    if method == "compressed-tensors":
        center = 1 << (bits - 1)  # stored as q_signed + center, q_signed = q - center
        out = {"weight_packed": pack_along_columns(qw.q, bits), "weight_scale": qw.s.contiguous(),
               "weight_shape": torch.tensor(list(qw.q.shape), dtype=torch.int64)}
        if not bool((qw.z == center).all()):
            out["weight_zero_point"] = pack_along_rows(qw.z, bits)
        if qw.order is not None:
            out["weight_g_idx"] = _g_idx(qw)
        return out
    if method == "gptq":
        zeros = (qw.z - 1) if zeros_minus_one else qw.z
        return {"qweight": pack_along_rows(qw.q.t().contiguous(), bits),
                "qzeros": pack_along_columns(zeros.t().contiguous(), bits),
                "scales": qw.s.t().contiguous(), "g_idx": _g_idx(qw)}
    if method == "awq":
        return {"qweight": _awq_words(qw.q.t().contiguous()), "qzeros": _awq_words(qw.z.t().contiguous()),
                "scales": qw.s.t().contiguous()}
    raise ValueError(f"unknown method {method!r}; expected compressed-tensors, gptq or awq")


def _g_idx(qw: Quantized) -> torch.Tensor:
    in_features, groups = qw.q.shape[1], qw.s.shape[1]
    by_position = torch.arange(in_features, dtype=torch.int32) // (in_features // groups)
    if qw.order is None:
        return by_position
    return torch.empty_like(by_position).index_copy_(0, qw.order, by_position)  # input order[j] is in group j // g


def quantization_config(method: str, bits: int, group: int, symmetric: bool, act_order: bool,
                        unquantized: list[str], *, zeros_minus_one: bool = True) -> dict:
    """config.json's `quantization_config` as each tool writes it."""
    if method == "compressed-tensors":
        weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group" if group > 0 else
                   "channel", "group_size": group if group > 0 else None, "dynamic": False,
                   "actorder": "group" if act_order else None, "observer": "minmax"}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None, "format": "pack-quantized"}},
                "ignore": unquantized, "kv_cache_scheme": None, "sparsity_config": {}, "version": "0.20.1"}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": symmetric, "desc_act": act_order,
                "checkpoint_format": "gptq" if zeros_minus_one else "gptq_v2", "static_groups": False,
                "true_sequential": True, "damp_percent": 0.01, "lm_head": False,
                "dynamic": {f"-:{_pattern(name)}": {} for name in unquantized if name != "lm_head"}}
    return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": [name for name in unquantized if name != "lm_head"] or None}


def _pattern(name: str) -> str:
    return name.replace(".", r"\.")


def linear_names(src: Path, keys: list[str]) -> tuple[list[str], list[str]]:
    """The checkpoint names (without `.weight`) of the language model's linear layers, and of the other linears."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(src)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    decoder = {id(m) for m in model.get_decoder().modules()}
    modules = dict(model.named_modules())
    names = _model_names(model, [k for k in keys if k.endswith(".weight")])
    language, other = [], []
    for key, name in names.items():
        module = modules.get(name.removesuffix(".weight"))
        if type(module) is torch.nn.Linear:
            (language if id(module) in decoder else other).append(key.removesuffix(".weight"))
    return language, other


def _model_names(model: torch.nn.Module, keys: list[str]) -> dict[str, str]:
    """Checkpoint name -> the model's, by transformers' key renaming (on its own here: the testing package stays out
    of the shard's reader, quantization/packed_checkpoint.py, which does the same for loading)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    params = dict.fromkeys(name for name, _ in model.named_parameters(remove_duplicate=False))
    return {k: rename_source_key(k, renamings, converters, model.base_model_prefix, params)[0] for k in keys}


def write_quantized_copy(src: str | Path, dst: str | Path, method: str = "compressed-tensors", *, bits: int = 4,
                         group: int = 128, symmetric: bool = True, act_order: bool = False,
                         zeros_minus_one: bool = True, scale_dtype: torch.dtype | None = None) -> Path:
    """Write `src`'s quantized copy to `dst` (module docstring). `scale_dtype`: bfloat16 for compressed-tensors,
    float16 for GPTQ / AWQ by default, as the tools write them."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    if method == "awq" and (bits != 4 or symmetric or act_order):
        raise ValueError("AWQ GEMM is 4-bit with zero points, in input order")
    scale_dtype = scale_dtype or (torch.bfloat16 if method == "compressed-tensors" else torch.float16)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    language, other = linear_names(src, list(tensors))
    written: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        prefix = key.removesuffix(".weight")
        if prefix not in language or not key.endswith(".weight"):
            written[key] = value
            continue
        qw = quantize(value, bits, group, symmetric=symmetric, scale_dtype=scale_dtype, act_order=act_order,
                      min_zero=1 if method == "gptq" and zeros_minus_one else 0)  # classic GPTQ cannot store 0
        written.update({f"{prefix}.{s}": t for s, t in packed_tensors(method, qw, bits,
                                                                      zeros_minus_one=zeros_minus_one).items()})
    save_file(written, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, bits, group, symmetric, act_order,
                                                        sorted(set(other) | {"lm_head"}), zeros_minus_one=zeros_minus_one)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return dst
