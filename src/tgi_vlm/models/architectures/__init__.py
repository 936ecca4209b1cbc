"""Per-architecture adapters, found through `registry.adapter_for(model_type)`."""

from tgi_vlm.models.architectures.registry import adapter_for, supported_model_types

__all__ = ["adapter_for", "supported_model_types"]
