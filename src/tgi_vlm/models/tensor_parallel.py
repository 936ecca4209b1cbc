"""Tensor parallelism (`--num-shard N`): transformers' own TP plans, plus what they lack for serving.

transformers shards a model at load time when `from_pretrained` gets a `DistributedConfig`: every
architecture we serve declares a plan (`base_model_tp_plan` of its text config, `_tp_plan` of the
model classes) with column-parallel q/k/v and gate/up, row-parallel o/down (all-reduce), a
vocab-parallel embedding (`embedding_rowwise`, partial lookups all-reduced) and a column-parallel
lm_head that gathers the full logits (`colwise_gather_output`). Parameters become DTensors; each
rank reads only its slices from the safetensors files (shard-on-read), and under
`torch.inference_mode()` the linear layers run on the local shards, so the attention function we
register receives this rank's LOCAL heads: query `[1, Hq/N, T, D]`, key/value `[1, Hkv/N, T, D]`.

What we add (decided here, on the host, before loading):
- KV heads fewer than ranks (N % Hkv == 0): transformers' column split of k_proj/v_proj would cut a
  head in half. As TGI does, every rank keeps whole the one KV head its query heads use: the text
  plan marks k/v "replicate" and, once loaded, each rank keeps only rows of KV head
  `rank * Hkv // N` (`keep_own_kv_head`). Its KV cache then holds 1 head per layer.
- Refusals: a model without a plan (e.g. GPT-2), query heads not divisible by N, or KV heads that
  neither divide nor are divided by N.
- CUDA: transformers binds its device mesh to LOCAL_RANK, which TGI's launcher does not set.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

KV_PROJECTIONS = ("k_proj", "v_proj")
SEPARATE_QKV = ("q_proj", *KV_PROJECTIONS)


@dataclass(frozen=True)
class ShardLayout:
    """How this rank holds the text model's attention."""

    rank: int
    world_size: int
    kv_heads: int  # KV heads per rank: what the KV cache and the attention function see
    replicated_kv_head: int | None = None  # N % Hkv == 0: the KV head this rank keeps whole

    @classmethod
    def unsharded(cls, text_config) -> ShardLayout:
        return cls(0, 1, _kv_heads(text_config))


def plan_layout(hf_config, rank: int, world_size: int) -> ShardLayout:
    """Check that the model can be split `world_size` ways and decide the KV layout.

    Marks replicated k/v projections in the text config's plan (an instance attribute: the class's
    plan stays as transformers wrote it), so pass this `hf_config` to `from_pretrained`.
    """
    text = hf_config.get_text_config()
    if world_size == 1:
        return ShardLayout.unsharded(text)
    _check_vision_heads(hf_config, world_size)
    plan = dict(getattr(text, "base_model_tp_plan", None) or {})
    model_type = hf_config.model_type
    if not plan:
        raise ValueError(f"model type {model_type!r} has no tensor-parallel plan in transformers; "
                         f"serve it with one shard (--num-shard 1)")
    heads, kv_heads = text.num_attention_heads, _kv_heads(text)
    separate = {_last(key): style for key, style in plan.items() if _last(key) in SEPARATE_QKV}
    if separate.get("q_proj") != "colwise":  # fused or gathered q/k/v: every rank attends with all heads
        return ShardLayout(rank, world_size, kv_heads)
    if heads % world_size:
        raise ValueError(f"{model_type}: {heads} attention heads cannot be split across {world_size} shards")
    if kv_heads % world_size == 0:
        return ShardLayout(rank, world_size, kv_heads // world_size)
    if world_size % kv_heads:
        raise ValueError(f"{model_type}: {kv_heads} key/value heads can be neither split across nor replicated "
                         f"on {world_size} shards (one must divide the other)")
    text.base_model_tp_plan = {k: "replicate" if _last(k) in KV_PROJECTIONS else s for k, s in plan.items()}
    return ShardLayout(rank, world_size, 1, replicated_kv_head=rank * kv_heads // world_size)


def load_kwargs(hf_config, layout: ShardLayout, device: str) -> dict:
    """Extra `from_pretrained` arguments for this rank (none unsharded): the planned config and
    transformers' DistributedConfig.

    The process group must already exist (`tgi_vlm.distributed.initialize`).
    """
    if layout.world_size == 1:
        return {}
    import importlib.util

    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    if importlib.util.find_spec("accelerate") is None:
        raise RuntimeError("tensor parallelism needs the accelerate package (transformers' sharded loading "
                           "requires it): pip install accelerate")

    if not dist.is_initialized():
        raise RuntimeError(f"world_size={layout.world_size} but no process group: call "
                           "tgi_vlm.distributed.initialize(...) before get_model")
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"EngineConfig.world_size={layout.world_size} but the process group has "
                           f"{dist.get_world_size()} ranks")
    if device.startswith("cuda"):
        # transformers binds its mesh to cuda:LOCAL_RANK (default 0); TGI's launcher sets RANK only.
        os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device()))
    elif torch.cuda.is_available():
        # transformers builds its device mesh on the machine's accelerator, whatever our device says.
        raise RuntimeError(f"sharding on {device} where CUDA is available is not supported; shard on cuda")
    return {"config": hf_config, "distributed_config": DistributedConfig(tp_size=layout.world_size)}


def keep_own_kv_head(decoder: torch.nn.Module, text_config, layout: ShardLayout) -> None:
    """Cut every replicated k/v projection of the text decoder down to this rank's KV head."""
    if layout.replicated_kv_head is None:
        return
    size = head_dim(text_config)
    rows = slice(layout.replicated_kv_head * size, (layout.replicated_kv_head + 1) * size)
    patterns = [_module_pattern(k) for k, s in text_config.base_model_tp_plan.items()
                if s == "replicate" and _last(k) in KV_PROJECTIONS]
    cut = 0
    for name, module in decoder.named_modules():
        if any(p.fullmatch(name) for p in patterns):
            module.weight = torch.nn.Parameter(module.weight.data[rows].clone(), requires_grad=False)
            if module.bias is not None:
                module.bias = torch.nn.Parameter(module.bias.data[rows].clone(), requires_grad=False)
            module.out_features = size
            cut += 1
    if cut != 2 * text_config.num_hidden_layers:
        raise RuntimeError(f"expected {2 * text_config.num_hidden_layers} k/v projections to cut, found {cut}")


def local_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shards of DTensors, whole replicated tensors)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _check_vision_heads(hf_config, world_size: int) -> None:
    """A vision tower transformers shards (Llama4's) needs its heads to split evenly too."""
    vision = getattr(hf_config, "vision_config", None)
    plan = getattr(vision, "base_model_tp_plan", None) or {}
    if any(_last(k) == "q_proj" and s == "colwise" for k, s in plan.items()):
        heads = vision.num_attention_heads
        if heads % world_size:
            raise ValueError(f"{hf_config.model_type}: the vision tower's {heads} attention heads cannot be split "
                             f"across {world_size} shards")


def _kv_heads(text_config) -> int:
    return getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads


def head_dim(text_config) -> int:
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def _last(plan_key: str) -> str:
    return plan_key.rsplit(".", 1)[-1]


def _module_pattern(plan_key: str) -> re.Pattern:
    """A plan key ("layers.*.self_attn.k_proj") as a module-name pattern under any prefix."""
    return re.compile(r"(?:.+\.)?" + re.escape(plan_key).replace(r"\*", r"\d+"))
