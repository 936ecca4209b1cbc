"""Everything the routes share, built once the router driver is warmed up."""

from __future__ import annotations

from dataclasses import dataclass

from tgi_vlm import __version__
from tgi_vlm.api.chat import ChatTemplate
from tgi_vlm.api.config import ApiConfig
from tgi_vlm.api.images import FetchLimits, ImageResolver
from tgi_vlm.api.infer import Infer
from tgi_vlm.api.metrics import Metrics
from tgi_vlm.api.responses import OpenAiBodies
from tgi_vlm.api.validation import LengthLimits, Validator
from tgi_vlm.router.router import Router
from tgi_vlm.router.tokens import TokenCounter


@dataclass
class ApiState:
    config: ApiConfig
    router: Router
    counter: TokenCounter
    lengths: LengthLimits
    images: ImageResolver
    metrics: Metrics
    infer: Infer
    chat_template: ChatTemplate
    openai: OpenAiBodies

    @classmethod
    def create(cls, config: ApiConfig, router: Router, counter: TokenCounter) -> ApiState:
        """`router` must be started (Warmup done): the length limits are the shard's."""
        lengths = LengthLimits(router.shard.max_input_tokens, router.shard.max_total_tokens)
        images = ImageResolver(FetchLimits(config.max_image_fetch_size, config.image_fetch_timeout_s))
        metrics = Metrics(router, lengths.max_input_tokens, lengths.max_total_tokens)
        validator = Validator(config, counter, lengths, images, prompt_tokens=router.config.prefix_caching,
                              adapters=tuple(router.shard.info.lora_adapters))
        infer = Infer(router, validator, metrics, config.max_concurrent_requests)
        chat_template = ChatTemplate(counter.tokenizer, counter.processor, config.chat_template)
        openai = OpenAiBodies(config.model_id, f"{__version__}-native")
        return cls(config, router, counter, lengths, images, metrics, infer, chat_template, openai)

    def adapter_for(self, model: str | None) -> str:
        """The LoRA adapter an OpenAI route's `model` names: TGI reads any value but "tgi" as an adapter id and serves
        an id it has not loaded on the base model; clients send whatever they were configured with ("tgi", the
        model's id, huggingface_hub's "dummy"), so here too a `model` that is not a loaded adapter is the base model.
        `/generate`'s explicit `adapter_id` is the one refused (422) when unknown."""
        return model if model and model in self.router.shard.info.lora_adapters else ""

    def openai_for(self, model: str | None) -> OpenAiBodies:
        """TGI echoes the request's `model` unless it is absent or "tgi"."""
        return self.openai if model in (None, "tgi") else OpenAiBodies(model, self.openai.fingerprint)

    @property
    def takes_images(self) -> bool:
        return self.counter.prompt is not None

    async def close(self) -> None:
        await self.images.close()
