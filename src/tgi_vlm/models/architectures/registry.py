"""model_type → adapter class. Shared code asks here and never reads model_type itself."""

from __future__ import annotations

from tgi_vlm.models.architectures.base import VlmAdapter, VlmPrompt

_ADAPTERS: dict[str, type[VlmAdapter]] = {}


def register(cls: type[VlmAdapter]) -> type[VlmAdapter]:
    for model_type in cls.model_types:
        _ADAPTERS[model_type] = cls
    return cls


def supported_model_types() -> list[str]:
    _load_all()
    return sorted(_ADAPTERS)


def adapter_for(model_type: str) -> type[VlmAdapter]:
    _load_all()
    if model_type not in _ADAPTERS:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported vision-language model types: "
            f"{', '.join(sorted(_ADAPTERS))}"
        )
    return _ADAPTERS[model_type]


def prompt_for(model_type: str) -> type[VlmPrompt]:
    """The prompt half only (processor, no weights): what the router's token counter needs."""
    return adapter_for(model_type).prompt_type


def _load_all() -> None:
    # Importing the modules runs their @register decorators.
    from tgi_vlm.models.architectures import (  # noqa: F401
        gemma3,
        idefics,
        llama4,
        llava_next,
        paligemma,
        qwen2_vl,
    )
