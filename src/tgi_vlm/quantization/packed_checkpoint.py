"""A model directory whose config says AWQ, GPTQ or compressed-tensors: built by transformers without its quantizer,
then each packed layer's tensors read from the safetensors and kept as a `GroupedInt8Weight` for the linear plan.

`PackedCheckpoint.find(model_id, hf_config)` reads the `quantization_config` (the top-level config's, else the
text_config's) and the checkpoint's safetensors files (their names only). `get_model` then builds the model from a
copy of the config without the quantization_config (`plain_config`), so transformers loads the unquantized tensors
(norms, embeddings, the vision tower, the lm-head where it is not quantized) and leaves the packed layers' weights
missing (initialized, then released here). `attach_packed_weights` reads every packed layer (packed_formats.py),
names its module through transformers' own checkpoint-key renaming (a Qwen2-VL checkpoint's `model.layers.*` and
`visual.*` are the model's `model.language_model.layers.*` and `model.visual.*`; newer layouts match as they are),
and:

- gives a language-model linear (and the lm-head) `quantized_weight` and a meta-device placeholder parameter, as the
  GGUF loader does, so plan rule 0 gives it an `int8-grouped(<scheme>)` kernel and q/k/v, gate/up fuse;
- writes a packed layer outside the language model (a vision tower or projector some tool quantized) back into its
  parameter de-quantized, in the model's dtype: the vision side always computes in the model's dtype;
- refuses, naming the file and tensor, a packed layer the config says stays unquantized (ignore,
  modules_to_not_convert, a GPTQ `-:` rule), one that is not a plain linear layer, and a linear layer whose weight
  the checkpoint holds in neither form.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from loguru import logger

from tgi_vlm.quantization.packed_config import METHODS, PackedCheckpointError, PackedQuantization
from tgi_vlm.quantization.packed_formats import MARKERS, SUFFIXES, PackedLayer, decoder_for


@dataclass
class PackedCheckpoint:
    directory: Path
    quantization: PackedQuantization
    weight_files: dict[str, str]  # tensor name -> safetensors file name (in `directory`)

    @classmethod
    def find(cls, model_id: str, hf_config, *, revision: str | None = None) -> PackedCheckpoint | None:
        """The checkpoint's quantization, where its config has a `quantization_config`; None for a float model."""
        raw, where = quantization_config_of(hf_config)
        if raw is None:
            return None
        quantization = PackedQuantization.from_config(raw, f"{Path(model_id).name}/config.json {where}")
        directory = _local_directory(model_id, revision)
        return cls(directory, quantization, _weight_files(directory))

    def layers(self) -> list[PackedLayer]:
        """Every packed layer of the checkpoint, its tensors read (memory-mapped), in file order."""
        from safetensors import safe_open

        marker, suffixes = MARKERS[self.quantization.method], SUFFIXES[self.quantization.method]
        prefixes = [name[: -len(marker) - 1] for name in self.weight_files if name.endswith("." + marker)]
        by_file: dict[str, list[str]] = {}
        for prefix in prefixes:
            for suffix in suffixes:
                name = f"{prefix}.{suffix}"
                if name in self.weight_files:
                    by_file.setdefault(self.weight_files[name], []).append(name)
        tensors: dict[str, torch.Tensor] = {}
        for file, names in by_file.items():
            with safe_open(self.directory / file, framework="pt") as f:
                tensors.update({name: f.get_tensor(name) for name in names})
        return [PackedLayer(prefix, {s: tensors[f"{prefix}.{s}"] for s in suffixes if f"{prefix}.{s}" in tensors},
                            {s: self.weight_files[f"{prefix}.{s}"] for s in suffixes
                             if f"{prefix}.{s}" in self.weight_files}) for prefix in prefixes]


def quantization_config_of(hf_config) -> tuple[dict | None, str]:
    """The `quantization_config` (as a dict) of `hf_config` or its text_config, and where it was."""
    for where, config in (("quantization_config", hf_config),
                          ("text_config.quantization_config", getattr(hf_config, "text_config", None))):
        raw = getattr(config, "quantization_config", None) if config is not None else None
        if raw is not None:
            return (raw if isinstance(raw, dict) else raw.to_dict()), where
    return None, ""


def plain_config(hf_config):
    """A copy of `hf_config` without its quantization_config (nor its text_config's): transformers builds the plain
    model from it and does not look for AutoAWQ / gptqmodel / compressed-tensors' loaders."""
    plain = copy.deepcopy(hf_config)
    for config in (plain, getattr(plain, "text_config", None)):
        if config is not None and hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
    return plain


def _local_directory(model_id: str, revision: str | None) -> Path:
    local = Path(model_id).expanduser()
    if local.is_dir():
        return local
    import huggingface_hub

    return Path(huggingface_hub.snapshot_download(model_id, revision=revision,
                                                  allow_patterns=["*.safetensors", "*.safetensors.index.json"]))


def _weight_files(directory: Path) -> dict[str, str]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    files: dict[str, str] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), path.name))
    if not files:
        raise PackedCheckpointError(f"{directory}: a quantized checkpoint without safetensors weights")
    return files


@dataclass
class AttachedPacked:
    """What `attach_packed_weights` did: per module name the scheme kept quantized; those written back de-quantized."""

    schemes: dict[str, str] = field(default_factory=dict)
    dequantized: list[str] = field(default_factory=list)
    quantized_bytes: int = 0

    def summary(self) -> str:
        kinds = ", ".join(f"{n} x {s}" for s, n in sorted(Counter(self.schemes.values()).items()))
        back = f"; {len(self.dequantized)} outside the language model de-quantized" if self.dequantized else ""
        return f"{len(self.schemes)} packed layers kept quantized ({kinds}){back}; {self.quantized_bytes / 1e6:.1f} MB"


def model_names(model: torch.nn.Module, checkpoint_names: list[str]) -> dict[str, str]:
    """Checkpoint parameter name -> the model's, by transformers' own key renaming for this model class."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    params = dict.fromkeys(name for name, _ in model.named_parameters(remove_duplicate=False))
    return {name: rename_source_key(name, renamings, converters, model.base_model_prefix, params)[0]
            for name in checkpoint_names}


def attach_packed_weights(model: torch.nn.Module, checkpoint: PackedCheckpoint,
                          missing_keys: set[str] | list[str] = ()) -> AttachedPacked:
    """Keep `checkpoint`'s packed layers quantized in `model` (built from `plain_config`; `missing_keys`: what
    transformers' load reported missing). Refuses, naming file and tensor, what does not match (module docstring)."""
    quantization = checkpoint.quantization
    layers = checkpoint.layers()
    renamed = model_names(model, [f"{layer.prefix}.weight" for layer in layers])
    modules = dict(model.named_modules())
    kept_quantized = {id(m) for m in model.get_decoder().modules()} | {id(model.get_output_embeddings())}
    attached, loaded = AttachedPacked(), set()
    decode = decoder_for(quantization.method)
    for layer in layers:
        name = renamed[f"{layer.prefix}.weight"].removesuffix(".weight")
        marker = layer.where(MARKERS[quantization.method])
        module = modules.get(name)
        if type(module) is not torch.nn.Linear:
            raise PackedCheckpointError(f"{marker}: packed, but the model's {name} is "
                                        f"{type(module).__name__ if module is not None else 'not a module'}, not a "
                                        "linear layer")
        scheme = quantization.scheme_for(layer.prefix, name)
        if scheme is None:
            raise PackedCheckpointError(f"{marker}: packed, but {quantization.where} keeps {layer.prefix} unquantized "
                                        "(ignore / modules_to_not_convert / dynamic): the config does not match the "
                                        "weights")
        label = scheme.label(quantization.method)
        out_features, in_features = module.weight.shape
        kwargs = {"zeros_minus_one": quantization.gptq_zeros_minus_one} if quantization.method == "gptq" else {}
        weight = decode(layer, scheme, out_features, in_features, source=label, **kwargs)
        _hand_over(module, weight, quantized=id(module) in kept_quantized)
        if id(module) in kept_quantized:
            attached.schemes[name] = label
            attached.quantized_bytes += weight.nbytes
        else:
            attached.dequantized.append(name)
        loaded.add(f"{name}.weight")
    _refuse_missing(modules, set(missing_keys) - loaded, checkpoint)
    logger.info("{}: {}", checkpoint.directory.name, attached.summary())
    return attached


def load_packed(from_pretrained, source: str, checkpoint: PackedCheckpoint, hf_config, device: str, **kwargs):
    """`from_pretrained(source, **kwargs)` on the plain config (transformers' report of the packed tensors as
    unexpected and their layers' weights as missing silenced: both are read here), moved to `device`, then the packed
    layers attached."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = from_pretrained(source, config=plain_config(hf_config), output_loading_info=True, **kwargs)
    finally:
        hf_logging.set_verbosity(level)
    model = model.to(device)
    attach_packed_weights(model, checkpoint, info["missing_keys"])
    return model


def _hand_over(module: torch.nn.Linear, weight, *, quantized: bool) -> None:
    weight = weight.to(module.weight.device)
    if quantized:
        module.quantized_weight = weight
        module.weight = torch.nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype, device="meta"),
                                           requires_grad=False)
        return
    with torch.no_grad():
        module.weight.copy_(weight.dequantize().to(module.weight.dtype))


def _refuse_missing(modules: dict[str, torch.nn.Module], missing: set[str], checkpoint: PackedCheckpoint) -> None:
    unread = sorted(key for key in missing if key.endswith(".weight")
                    and isinstance(modules.get(key.removesuffix(".weight")), torch.nn.Linear))
    if unread:
        raise PackedCheckpointError(f"{checkpoint.directory.name}: the checkpoint holds neither a float weight nor "
                                    f"{checkpoint.quantization.method} packed tensors for {', '.join(unread[:4])}"
                                    f"{' ...' if len(unread) > 4 else ''}")
    others = sorted(missing)
    if others:  # transformers' own report, silenced during the load: said here, where it is not about packed layers
        logger.warning("{}: not in the checkpoint, left as the model initialized them: {}{}",
                       checkpoint.directory.name, ", ".join(others[:8]), " ..." if len(others) > 8 else "")


__all__ = ["METHODS", "AttachedPacked", "PackedCheckpoint", "PackedCheckpointError", "attach_packed_weights",
           "load_packed", "plain_config", "quantization_config_of"]
