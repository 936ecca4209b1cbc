"""Loaded adapters matched to the model: each targeted linear layer gets a `LoraDelta` as its `extra` term.

Every target must be a planned linear layer (`KernelLinear`) of the language model, with the adapter's A `[r, in]`
and B `[out, r]` fitting its input and output widths; anything else is refused at start, naming the adapter and
the module. The vision tower, the projector and the lm-head stay the base model's: an adapter with weights for them
is refused (peft's `target_modules` can be a regex over the language model's names to leave them out). With no
adapter loaded nothing is attached: every layer's `extra` stays None and the base model's path is unchanged.

Tensor parallelism (`--num-shard` > 1) is refused for now: the A/B slices per rank (column-parallel layers split
B's outputs, row-parallel ones A's inputs) are not made yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from loguru import logger

from tgi_vlm.layers.linear.fused import fused_groups
from tgi_vlm.layers.linear.modules import KernelLinear
from tgi_vlm.lora.checkpoint import AdapterError, LoraCheckpoint, load_checkpoint
from tgi_vlm.lora.delta import LoraDelta
from tgi_vlm.lora.specs import AdapterSpec
from tgi_vlm.models.adapter_table import AdapterTable


def attach_adapters(engine, specs: Sequence[AdapterSpec]) -> AdapterTable:
    """Load `specs` (index 1, 2, ... in order), check them against `engine`'s model, set the layers' extras; the
    table of their names."""
    if not specs:
        return AdapterTable()
    if engine.layout.world_size > 1:
        raise ValueError(f"--lora-adapters with --num-shard {engine.layout.world_size}: LoRA adapters are served on "
                         "one shard only (their A/B weights are not split across ranks yet); use --num-shard 1")
    checkpoints = [load_checkpoint(spec) for spec in specs]
    pairs = _pairs_by_layer(engine, checkpoints)
    modules = dict(engine.model.named_modules())
    for name, by_adapter in pairs.items():
        modules[name].extra = LoraDelta.from_pairs(by_adapter, len(specs))
    for group in fused_groups(engine.language_model):  # one product pair per fused q/k/v or gate/up group
        extras = [member.extra for member in group.members]
        if any(extra is not None for extra in extras):
            group.extra = LoraDelta.fused(extras, group.widths)
    for index, checkpoint in enumerate(checkpoints, start=1):
        ranks = sorted({m.rank for m in checkpoint.modules.values()})
        logger.info("LoRA adapter {} ({}): index {}, {} layers, rank {}", checkpoint.name, checkpoint.path, index,
                    len(checkpoint.modules), "/".join(map(str, ranks)))
    return AdapterTable([spec.id for spec in specs])


def _pairs_by_layer(engine, checkpoints: list[LoraCheckpoint]) -> dict[str, dict[int, tuple[torch.Tensor, ...]]]:
    modules = dict(engine.model.named_modules())
    language = {id(m) for m in engine.language_model.modules()}
    pairs: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for index, checkpoint in enumerate(checkpoints, start=1):
        for name, lora in checkpoint.modules.items():
            layer = modules.get(name)
            if layer is None:
                raise AdapterError(checkpoint.name, f"targets {name!r}, which this model does not have (an adapter "
                                                    "for another base model?)")
            _check_layer(checkpoint.name, name, layer, id(layer) in language, lora.a.shape, lora.b.shape)
            # float32 whatever the model's dtype: the deltas are computed in float32 (lora/delta.py)
            pairs.setdefault(name, {})[index] = (lora.a.to(engine.device, torch.float32),
                                                 (lora.b * lora.scale).to(engine.device, torch.float32))
    return pairs


def _check_layer(adapter: str, name: str, layer: torch.nn.Module, in_language_model: bool, a_shape, b_shape) -> None:
    if not in_language_model:
        raise AdapterError(adapter, f"targets {name!r}, outside the language model: the vision tower, projector and "
                                    "lm-head stay the base model's (target the language model's layers only)")
    if not isinstance(layer, KernelLinear):
        raise AdapterError(adapter, f"targets {name!r}, a {type(layer).__name__}: only linear layers take LoRA here")
    if a_shape[1] != layer.in_features or b_shape[0] != layer.out_features:
        raise AdapterError(adapter, f"{name}: lora_A {tuple(a_shape)} and lora_B {tuple(b_shape)} do not fit a "
                                    f"{layer.in_features} -> {layer.out_features} layer (want [r, "
                                    f"{layer.in_features}] and [{layer.out_features}, r]); an adapter for another "
                                    "base model?")
