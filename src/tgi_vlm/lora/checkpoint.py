"""One peft LoRA adapter read from its directory and checked, before anything touches the model.

What is read: `adapter_config.json` (peft's LoraConfig: `r`, `lora_alpha`, `use_rslora`, `rank_pattern`) and
`adapter_model.safetensors`, whose tensors are `base_model.model.<module>.lora_A.weight` `[r, in]` and
`...lora_B.weight` `[out, r]` (the module names are the transformers model's own, as peft wrapped it). Never a
pickle: a directory with only `adapter_model.bin` is refused. What is refused, naming the adapter: a `peft_type`
other than LORA, `modules_to_save` (whole modules replaced: not a per-row delta), DoRA, LoRA biases,
`alpha_pattern`, embedding LoRA, a rank that disagrees with the config, a path with `..` or a file that resolves
outside the adapter's directory (a symlink out of it). The scale peft applies (`lora_alpha / r`, rslora
`lora_alpha / sqrt(r)`) is per module, from its tensors' rank.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tgi_vlm.lora.specs import AdapterSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<side>A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$")
# LoraConfig fields whose non-default values change the arithmetic beyond x A^T B^T * scale: refused.
_REFUSED_FIELDS = {
    "modules_to_save": "replaces whole modules (not a per-row delta); serve a merged model instead",
    "use_dora": "DoRA rescales the weight per column, which a per-row delta cannot express",
    "lora_bias": "LoRA biases are not served",
    "alpha_pattern": "per-module alpha is not served; set lora_alpha",
    "layer_replication": "layer replication changes the model's depth",
}


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names it and says why."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"LoRA adapter {name!r}: {reason}")


@dataclass(frozen=True)
class ModuleLora:
    """One module's pair: `a` `[r, in]`, `b` `[out, r]` (float32 as stored), and peft's scale for it."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraCheckpoint:
    name: str
    path: Path
    modules: dict[str, ModuleLora]  # transformers module name -> its pair


def adapter_dir(spec: AdapterSpec) -> Path:
    """The local directory of `spec`: its path, `id` itself when it is a directory, else the hub snapshot (cache)."""
    source = spec.source
    if ".." in Path(source).parts or ".." in source.split("/"):
        raise AdapterError(spec.id, f"path {source!r} contains '..'; give a directory without parent references")
    local = Path(source).expanduser()
    if spec.path is not None or local.is_dir():
        if not local.is_dir():
            raise AdapterError(spec.id, f"{source} is not a directory")
        return local
    if source.startswith(("/", ".", "~")):
        raise AdapterError(spec.id, f"local adapter directory {source} does not exist")
    return _hub_snapshot(spec)


def _hub_snapshot(spec: AdapterSpec) -> Path:
    import huggingface_hub

    try:
        return Path(huggingface_hub.snapshot_download(repo_id=spec.id, revision=spec.revision,
                                                      allow_patterns=[CONFIG_FILE, WEIGHTS_FILE]))
    except Exception as exc:
        raise AdapterError(spec.id, f"not a local directory and not fetched from the Hugging Face Hub "
                                    f"({type(exc).__name__}: {exc})") from None


def _inside(name: str, directory: Path, file: Path) -> Path:
    resolved = file.resolve()
    if not resolved.is_relative_to(directory.resolve()):
        raise AdapterError(name, f"{file.name} resolves outside the adapter directory ({resolved}); refused")
    return resolved


def read_config(name: str, directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(name, f"{directory} has no {CONFIG_FILE}; is it a peft adapter directory?")
    config = json.loads(_inside(name, directory, path).read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(name, f"peft_type {config.get('peft_type')!r} is not served (LoRA only)")
    for field, why in _REFUSED_FIELDS.items():
        if config.get(field):
            raise AdapterError(name, f"{field}={config[field]!r}: {why}")
    if not isinstance(config.get("r"), int) or config["r"] <= 0:
        raise AdapterError(name, f"{CONFIG_FILE} has no positive integer r (got {config.get('r')!r})")
    return config


def read_weights(name: str, directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = directory / WEIGHTS_FILE
    if not path.is_file():
        pickles = [p for p in PICKLE_FILES if (directory / p).exists()]
        found = f" (found {', '.join(pickles)}: pickled weights are never loaded; convert to safetensors)" if pickles else ""
        raise AdapterError(name, f"{directory} has no {WEIGHTS_FILE}{found}")
    return load_file(_inside(name, directory, path))


def load_checkpoint(spec: AdapterSpec) -> LoraCheckpoint:
    """`spec`'s adapter read and checked on its own (the model's shapes are checked by `attach.py`)."""
    directory = adapter_dir(spec)
    config = read_config(spec.id, directory)
    tensors = read_weights(spec.id, directory)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(spec.id, f"tensor {key!r} is not a LoRA A/B weight (embedding LoRA, biases and "
                                        "saved modules are not served)")
        pairs.setdefault(match["module"], {})[match["side"]] = tensor
    if not pairs:
        raise AdapterError(spec.id, f"{WEIGHTS_FILE} holds no LoRA weights")
    modules = {m: _module_lora(spec.id, m, sides, config) for m, sides in sorted(pairs.items())}
    return LoraCheckpoint(spec.id, directory, modules)


def _module_lora(name: str, module: str, sides: dict[str, torch.Tensor], config: dict) -> ModuleLora:
    if set(sides) != {"A", "B"}:
        raise AdapterError(name, f"{module}: lora_{'A' if 'A' not in sides else 'B'} is missing")
    a, b = sides["A"], sides["B"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise AdapterError(name, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not [r, in] "
                                 "and [out, r] of one rank")
    rank = a.shape[0]
    if rank != config["r"] and not config.get("rank_pattern"):
        raise AdapterError(name, f"{module}: rank {rank} in the weights but r={config['r']} in {CONFIG_FILE}")
    alpha = float(config.get("lora_alpha", config["r"]))
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return ModuleLora(a.float(), b.float(), scale)
