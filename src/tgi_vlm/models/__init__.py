"""get_model(): a model directory (or hub id) → a ready FlashCausalLM or VlmCausalLM.

The engine (torch, the attention backends, tensor parallelism) is imported inside `get_model`, not
here: the router's token counter imports this package's prompt side (`request_input`, `vlm_intake`,
`architectures`' prompt half), and a package's `__init__` runs whenever one of its modules is imported
(tests/unit/test_layering.py checks what that loads).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from loguru import logger

from tgi_vlm.config import EngineConfig
from tgi_vlm.dtypes import DtypeChoice, checkpoint_dtype, cpu_has_native_bf16, resolve_dtype

if TYPE_CHECKING:
    from tgi_vlm.models.tensor_parallel import ShardLayout


def get_model(model_id: str, config: EngineConfig, *, revision: str | None = None, trust_remote_code: bool = False):
    import torch
    from transformers import AutoConfig

    from tgi_vlm.layers.attention import register_paged_attention, resolve_backend
    from tgi_vlm.models.tensor_parallel import plan_layout
    from tgi_vlm.quantization.gguf_file import GgufFile

    gguf_file = GgufFile.find(model_id)
    if gguf_file is not None:
        gguf_file.check()  # a truncated file is refused here, naming the tensor, not deep inside transformers
    source, gguf_args = gguf_file.pretrained_args() if gguf_file is not None else (model_id, {})
    backend = resolve_backend(config.attention, config.device)
    attn_name = register_paged_attention()  # one dispatcher; the backend object belongs to the model
    config = dataclasses.replace(config, attention=backend)  # what actually runs (Info reports it)
    _log_what_launcher_switches_do(config)
    hf_config = AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code, **gguf_args)
    choice = choose_dtype(config, hf_config)
    config = dataclasses.replace(config, dtype=choice.name)  # what actually runs
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[choice.name]
    packed = None if gguf_file is not None else _packed_checkpoint(model_id, hf_config, config, revision)
    quantized = (f"{gguf_file.path.name}: a GGUF file" if gguf_file is not None
                 else f"{model_id}: a {packed.quantization.method} checkpoint" if packed is not None
                 else f"--quantize {config.quantize}" if config.quantize else None)
    if quantized is not None and config.world_size > 1:
        raise ValueError(f"{quantized} is served on one shard (--num-shard 1): quantized weights are not split "
                         "across ranks")
    # Tensor parallelism (world_size > 1): which heads this rank holds; unsharded, all of them.
    layout = plan_layout(hf_config, config.rank, config.world_size)
    if _is_vision_language(hf_config):
        from tgi_vlm.models.vlm_causal_lm import load_vlm

        engine = load_vlm(model_id, hf_config, config, attn_name, dtype, layout, revision=revision,
                          trust_remote_code=trust_remote_code, packed=packed)
    else:
        engine = _load_text_model(model_id, hf_config, config, attn_name, dtype, layout, revision, trust_remote_code,
                                  gguf_file, packed)
    engine.linear_plan = _plan_linears(engine, config)
    if config.lora_adapters:  # each targeted linear gets its LoRA term (lora/attach.py); none: every extra stays None
        from tgi_vlm.lora.attach import attach_adapters

        engine.adapter_table = attach_adapters(engine, config.lora_adapters)
    return engine


def _packed_checkpoint(model_id: str, hf_config, config: EngineConfig, revision: str | None):
    """An AWQ / GPTQ / compressed-tensors checkpoint's quantization (quantization/packed_checkpoint.py), None for a
    float one; `--quantize` must name its method or be left out (as TGI's launcher, which reads it from the config),
    and `--quantize awq|gptq|compressed-tensors` on a float checkpoint is refused."""
    from tgi_vlm.quantization.packed_checkpoint import METHODS, PackedCheckpoint, PackedCheckpointError

    if config.quantize not in (None, "eetq", *METHODS):
        raise ValueError(f"quantize={config.quantize!r}: served are 'eetq' and {', '.join(map(repr, METHODS))}")
    packed = PackedCheckpoint.find(model_id, hf_config, revision=revision)
    method = packed.quantization.method if packed is not None else None
    if packed is None and config.quantize in METHODS:
        raise PackedCheckpointError(f"--quantize {config.quantize}: {model_id} is not a {config.quantize} checkpoint "
                                    "(its config.json has no quantization_config); leave the flag out, or use --quantize "
                                    "eetq to make int8 weights at load")
    if packed is not None and config.quantize not in (None, method):
        raise PackedCheckpointError(f"--quantize {config.quantize}: {model_id} is a {method} checkpoint "
                                    f"({packed.quantization.where}); pass --quantize {method} or leave the flag out")
    return packed


def _plan_linears(engine, config: EngineConfig):
    """Every linear layer's kernel (layers/linear/plan.py): CPU kernels and lean layers on CPU, `torch` elsewhere;
    `--quantize eetq` first gives the language model's linears their int8 weights (quantization/int8.py)."""
    language_model = engine.find_language_model()
    if config.quantize == "eetq":
        from tgi_vlm.quantization.int8 import attach_int8_weights

        logger.info("--quantize eetq: {} language-model linear layers int8 per output channel",
                    attach_int8_weights(language_model))
    if config.device == "cpu":
        from tgi_vlm.layers.cpu import speed_up_for_cpu

        return speed_up_for_cpu(engine.model, language_model=language_model, sharded=config.world_size > 1,
                                kernels=config.kernels)
    from tgi_vlm.layers.linear import PlanOptions, plan_linears

    return plan_linears(engine.model, PlanOptions(cpu=False), language_model=language_model)


def choose_dtype(config: EngineConfig, hf_config) -> DtypeChoice:
    """`config.dtype` (--dtype) or the default rule of tgi_vlm.dtypes for this device and checkpoint; logged."""
    on_cpu = config.device.startswith("cpu")
    choice = resolve_dtype(config.dtype, config.device, checkpoint_dtype(hf_config),
                           cpu_has_bf16=on_cpu and cpu_has_native_bf16(), model_type=hf_config.model_type)
    logger.info("dtype {} ({})", choice.name, choice.reason)
    return choice


def _log_what_launcher_switches_do(config: EngineConfig) -> None:
    """TGI's launcher sets these for every shard; say plainly what they do here."""
    if config.prefix_caching:
        logger.info("PREFIX_CACHING is set: text models answer Info.use_prefix_caching=true; VLMs answer false "
                    "(TGI's router keys prefixes on token ids, blind to images). Every cache_len is verified.")
    if config.request_logprobs:
        logger.info("REQUEST_LOGPROBS is set: nothing to switch on, prefill logprobs are always served "
                    "to requests that ask for them")


def _is_vision_language(hf_config) -> bool:
    return getattr(hf_config, "vision_config", None) is not None


def _load_text_model(model_id, hf_config, config: EngineConfig, attn_name, dtype, layout: ShardLayout, revision,
                     trust_remote_code, gguf_file=None, packed=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tgi_vlm.models.flash_causal_lm import FlashCausalLM
    from tgi_vlm.models.tensor_parallel import keep_own_kv_head, load_kwargs

    # A GGUF file: transformers reads config, tokenizer and (de-quantized) weights from it; never a pickle either.
    source, file_args = gguf_file.pretrained_args() if gguf_file is not None else (model_id, {"use_safetensors": True})
    if gguf_file is not None:  # the config read from the file once already (its metadata parse: 7.5 s of 26 for Gemma)
        file_args = {**file_args, "config": hf_config}
    kwargs = dict(revision=revision, trust_remote_code=trust_remote_code, attn_implementation=attn_name, dtype=dtype,
                  **file_args,  # safetensors only: never unpickle weights
                  **load_kwargs(hf_config, layout, config.device))
    if packed is not None:  # AWQ / GPTQ / compressed-tensors: the packed layers attached quantized
        from tgi_vlm.quantization.packed_checkpoint import load_packed

        model = load_packed(AutoModelForCausalLM.from_pretrained, source, packed, hf_config, config.device, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs).to(config.device)
    if gguf_file is not None:
        from tgi_vlm.quantization.gguf_checkpoint import attach_quantized_weights

        attach_quantized_weights(model, gguf_file)
    keep_own_kv_head(model.get_decoder(), model.config.get_text_config(), layout)
    tokenizer = AutoTokenizer.from_pretrained(
        source, revision=revision, trust_remote_code=trust_remote_code, truncation_side="left",
        **({k: v for k, v in file_args.items() if k == "gguf_file"}),
    )
    logger.info("loaded {} ({}) on {} in {}", Path(model_id).name, type(model).__name__, config.device, dtype)
    return FlashCausalLM(model, tokenizer, config, model_id=model_id, layout=layout)
