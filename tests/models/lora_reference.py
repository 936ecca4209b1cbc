"""Random peft LoRA adapters made offline on the tiny models, and transformers' merged models as the reference.

peft builds each adapter on the architecture's own transformers class (`get_peft_model`), its A and B filled with
seeded random values (B nonzero, unlike peft's default init), and saves it as peft does (`save_pretrained`:
adapter_config.json + adapter_model.safetensors). The reference for requests of that adapter is the same base model
with the adapter merged into its weights (`merge_and_unload`), run by transformers' own generate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from tgi_vlm.testing import TEXT_ARCHS, tiny_model_path

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
STD = 0.15  # A and B entries: large enough that each adapter changes the tiny models' greedy tokens


@dataclass(frozen=True)
class AdapterRecipe:
    rank: int
    targets: tuple[str, ...]
    seed: int
    rslora: bool = False


# Three adapters that differ in rank, targets (all seven; part of a fused q/k/v group; o/down only) and scaling.
RECIPES = {
    "lora-all": AdapterRecipe(8, ATTENTION + MLP, seed=1),
    "lora-qv": AdapterRecipe(4, ("q_proj", "v_proj"), seed=2),
    "lora-rs": AdapterRecipe(16, ("o_proj", "down_proj", "up_proj"), seed=3, rslora=True),
}


def base_model(arch: str) -> torch.nn.Module:
    cls = AutoModelForCausalLM if arch in TEXT_ARCHS else AutoModelForImageTextToText
    return cls.from_pretrained(tiny_model_path(arch), dtype=torch.float32).eval()


def language_model_targets(model: torch.nn.Module, targets: tuple[str, ...]) -> str:
    """A peft `target_modules` regex over the language model's decoder layers only (the vision tower stays base)."""
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    return rf"{re.escape(prefix)}\.layers\.\d+\.(?:self_attn|mlp)\.(?:{'|'.join(targets)})"


def make_adapter(arch: str, out: Path, recipe: AdapterRecipe, *, model: torch.nn.Module | None = None,
                 target_modules=None) -> Path:
    """Write a random LoRA adapter for `arch`'s tiny model to `out` with peft; returns `out`."""
    model = model or base_model(arch)
    config = LoraConfig(r=recipe.rank, lora_alpha=2 * recipe.rank, use_rslora=recipe.rslora, lora_dropout=0.0,
                        target_modules=target_modules or language_model_targets(model, recipe.targets))
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(recipe.seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * STD)
    peft_model.save_pretrained(out, save_embedding_layers=False)
    return out


def merged_model(arch: str, adapter: Path | None) -> torch.nn.Module:
    """The base model with `adapter` merged into its weights (None: the base model)."""
    model = base_model(arch)
    if adapter is None:
        return model
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
