"""VLM request intake: decode the request's images, lay out the prompt with the architecture's
placeholders, run the processor (the source of truth for image tokens), locate each image's span
and apply `truncate` without ever cutting through an image.

Only the prompt half of the adapter (`VlmPrompt`: processor, no weights) is needed here, so the
router's token counter shares `prompt_parts` with the engine.
"""

from __future__ import annotations

import hashlib

from tgi_vlm.config import InputLimits
from tgi_vlm.errors import InvalidRequest
from tgi_vlm.images import ImageError, decode_image
from tgi_vlm.models.architectures.base import VlmPrompt
from tgi_vlm.models.image_spans import ImageSpan, locate_spans
from tgi_vlm.models.request_input import request_chunks
from tgi_vlm.pb import generate_pb2

# Processor outputs laid out along the prompt (cut with it by truncation).
PER_TOKEN_KEYS = ("input_ids", "mm_token_type_ids", "token_type_ids")


class ImageCutInWarmup(Exception):
    """The router's warmup truncation cuts an image: warm up without images instead."""


def prompt_parts(request: generate_pb2.Request, limits: InputLimits) -> tuple[list[str | None], list, list[str]]:
    """(text parts with None where an image goes, decoded RGB images, sha256 of each image's bytes)."""
    parts: list[str | None] = []
    images, digests = [], []
    for chunk in request_chunks(request):
        if isinstance(chunk, str):
            parts.append(chunk)
            continue
        if len(images) >= limits.max_images_per_request:
            raise InvalidRequest(request.id, f"more than {limits.max_images_per_request} images in one request")
        try:
            images.append(decode_image(chunk, limits))
        except ImageError as exc:
            raise InvalidRequest(request.id, f"image {len(images)}: {exc}") from None
        digests.append(hashlib.sha256(chunk).hexdigest())
        parts.append(None)
    return parts, images, digests


def process_prompt(prompt: VlmPrompt, request: generate_pb2.Request, parts: list[str | None], images: list) -> dict:
    """The processor on the whole prompt; any failure on user content is that request's error."""
    try:
        return prompt.process(prompt.build_prompt(parts), images, add_special_tokens=request.add_special_tokens)
    except Exception as exc:  # noqa: BLE001
        raise InvalidRequest(request.id, f"the processor rejected the input: {type(exc).__name__}: {exc}") from None


def tokenize_images(prompt: VlmPrompt, request: generate_pb2.Request, parts: list[str | None], images: list,
                    digests: list[str], *, warmup: bool) -> tuple[list[int], dict, list[ImageSpan]]:
    """(prompt ids after truncation, processor outputs cut alike, image spans that survived)."""
    processed = process_prompt(prompt, request, parts, images)
    try:
        per_image = _per_image_inputs(prompt, processed, parts, images)
    except Exception as exc:  # noqa: BLE001
        raise InvalidRequest(request.id, f"the processor rejected the input: {type(exc).__name__}: {exc}") from None
    ids = processed["input_ids"][0].tolist()
    spans = image_spans(request, prompt, ids, [count for _, count in per_image], digests,
                        [pixels for pixels, _ in per_image])
    return truncate_with_images(request, ids, processed, spans, warmup=warmup)


def image_spans(request: generate_pb2.Request, prompt: VlmPrompt, ids: list[int], counts: list[int],
                digests: list[str], pixel_inputs: list[dict] | None = None) -> list[ImageSpan]:
    """Each image's span in the prompt ids, from its embedding-token count (prompt order); the router's
    counting shortcut (`VlmPrompt.expanded_ids`) builds its spans here too, without pixel inputs."""
    try:
        located = locate_spans(ids, prompt.image_token_id, counts)
    except ValueError as exc:
        raise InvalidRequest(request.id, str(exc)) from None
    pixel_inputs = pixel_inputs if pixel_inputs is not None else [{} for _ in counts]
    return [
        ImageSpan(i, offset, length, embed_index, int((embed_index >= 0).sum()), digest, pixels)
        for i, ((offset, length, embed_index), pixels, digest) in enumerate(zip(located, pixel_inputs, digests))
    ]


def _per_image_inputs(prompt: VlmPrompt, processed: dict, parts: list[str | None], images: list) -> list[tuple[dict, int]]:
    """(pixel inputs, embedding-token count) of each image. One image: taken from the whole-prompt
    output, whose image tokens are all that image's (unless the text spells the image token itself:
    then, as with several images, each image goes through the processor again on its own)."""
    if len(images) == 1 and not _text_names_the_image_token(prompt, parts):
        count = int((processed["input_ids"] == prompt.image_token_id).sum())
        return [(prompt.only_image_inputs(processed), count)]
    return [prompt.image_inputs(img) for img in images]


def _text_names_the_image_token(prompt: VlmPrompt, parts: list[str | None]) -> bool:
    names = {prompt.image_placeholder(), prompt.tokenizer.convert_ids_to_tokens(prompt.image_token_id)}
    return any(part is not None and any(name and name in part for name in names) for part in parts)


def truncate_with_images(request, ids: list[int], processed: dict, spans: list[ImageSpan], *, warmup: bool = False):
    """Keep the last `truncate` tokens; images wholly cut off are dropped, one cut through is an
    error (in warmup: ImageCutInWarmup, and the caller retries without images)."""
    if not request.truncate or len(ids) <= request.truncate:
        return ids, processed, spans
    cut = len(ids) - request.truncate
    for span in spans:
        if span.offset < cut < span.end and warmup:
            raise ImageCutInWarmup(f"truncate={request.truncate} cuts image {span.index}")
        if span.offset < cut < span.end:
            raise InvalidRequest(
                request.id,
                f"truncate={request.truncate} would cut image {span.index} (tokens {span.offset}..{span.end - 1} "
                f"of {len(ids)}); raise truncate or shorten the text",
            )
    kept = [s for s in spans if s.offset >= cut]
    for s in kept:
        s.offset -= cut
    processed = {k: (v[:, cut:] if k in PER_TOKEN_KEYS else v) for k, v in processed.items()}
    return ids[cut:], processed, kept
