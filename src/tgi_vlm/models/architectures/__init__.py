"""Per-architecture adapters, found through `registry.adapter_for(model_type)` (model side) and
`registry.prompt_for(model_type)` (prompt side, no weights)."""

from tgi_vlm.models.architectures.registry import adapter_for, prompt_for, supported_model_types

__all__ = ["adapter_for", "prompt_for", "supported_model_types"]
