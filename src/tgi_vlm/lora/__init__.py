"""LoRA adapters served beside the base model, many per batch (TGI's `--lora-adapters`, `Request.adapter_id`).

specs.py       `--lora-adapters id[=path][@revision],...` parsed into `AdapterSpec`s (TGI's syntax)
checkpoint.py  one peft adapter directory read and checked (config, safetensors only, no escaping paths)
delta.py       `LoraDelta`: the `LinearExtra` of one linear layer, the adapters' A/B stacked, scale folded into B
attach.py      `attach_adapters`: checkpoints matched to the model's linear layers, shapes checked, extras set
"""

from tgi_vlm.lora.specs import AdapterSpec, parse_lora_adapters

__all__ = ["AdapterSpec", "parse_lora_adapters"]
