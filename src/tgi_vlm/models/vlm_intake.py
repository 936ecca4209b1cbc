"""VLM request intake: decode the request's media items (images, videos), lay out the prompt with the
architecture's placeholders, run the processor (the source of truth for media tokens), locate each
item's span and apply `truncate` without ever cutting through an item.

Only the prompt half of the adapter (`VlmPrompt`: processor, no weights) is needed here, so the
router's token counter shares `prompt_parts` with the engine. A prompt is a list of parts: text, or
the `MediaKind` of the item that goes there; the decoded items and their digests come alongside, in
prompt order.

Videos are decoded on worker threads (`media_prefetch.py`), started when the batch arrives; intake takes
each result (or its refusal) in prompt order. Without a prefetch (the router's counter) a video decodes here.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from tgi_vlm.config import InputLimits
from tgi_vlm.errors import InvalidRequest
from tgi_vlm.images import ImageError, decode_image
from tgi_vlm.media import MediaKind
from tgi_vlm.models.architectures.base import PromptPart, UnsupportedMediaKind, VlmPrompt
from tgi_vlm.models.media_spans import MediaSpan, locate_spans
from tgi_vlm.models.request_input import request_chunks
from tgi_vlm.pb import generate_pb2
from tgi_vlm.video import VideoError, decode_video

# Processor outputs laid out along the prompt (cut with it by truncation).
PER_TOKEN_KEYS = ("input_ids", "mm_token_type_ids", "token_type_ids")


@dataclass(frozen=True)
class Decoder:
    """How the items of one kind are read from untrusted bytes."""

    decode: Callable[[bytes, InputLimits, VlmPrompt], object]  # the prompt half: a video's frame sampler
    error: type[Exception]  # what `decode` raises for bad content; its message says why
    max_per_request: Callable[[InputLimits], int]
    off_thread: bool = False  # decoded by `media_prefetch.MediaPrefetch` while the batch is tokenized


DECODERS: dict[MediaKind, Decoder] = {
    MediaKind.IMAGE: Decoder(lambda data, limits, prompt: decode_image(data, limits), ImageError,
                             lambda limits: limits.max_images_per_request),
    MediaKind.VIDEO: Decoder(lambda data, limits, prompt: decode_video(data, limits, prompt.frame_sampler(limits)),
                             VideoError, lambda limits: limits.max_videos_per_request, off_thread=True),
}

# A request's prefetched decodes by chunk position: each future gives (item, sha256 hex of its bytes).
Prefetched = Mapping[int, Future]


class MediaCutInWarmup(Exception):
    """The router's warmup truncation cuts a media item: warm up without media instead."""


def media_kinds(parts: list[PromptPart]) -> list[MediaKind]:
    """The kind of each item, in prompt order."""
    return [p for p in parts if not isinstance(p, str)]


def prompt_parts(prompt: VlmPrompt, request: generate_pb2.Request, limits: InputLimits,
                 prefetched: Prefetched | None = None) -> tuple[list[PromptPart], list, list[str]]:
    """(parts: text, or the kind of the item that goes there; the decoded items; sha256 of each item's bytes).
    The one place a kind is checked against the architecture: past here every item is one it takes."""
    parts: list[PromptPart] = []
    items, digests = [], []
    per_kind: Counter[MediaKind] = Counter()
    for position, chunk in enumerate(request_chunks(request)):
        if isinstance(chunk, str):
            parts.append(chunk)
            continue
        try:
            prompt.require(chunk.kind)
        except UnsupportedMediaKind as exc:
            raise InvalidRequest(request.id, str(exc)) from None
        decoder, n = DECODERS[chunk.kind], per_kind[chunk.kind]
        if n >= decoder.max_per_request(limits):
            raise InvalidRequest(request.id, f"more than {decoder.max_per_request(limits)} {chunk.kind.plural} "
                                             "in one request")
        try:
            item, digest = _decoded(prompt, decoder, chunk.data, limits, (prefetched or {}).get(position))
        except decoder.error as exc:
            raise InvalidRequest(request.id, f"{chunk.kind.value} {n}: {exc}") from None
        items.append(item)
        per_kind[chunk.kind] += 1
        digests.append(digest)
        parts.append(chunk.kind)
    return parts, items, digests


def decode_item(prompt: VlmPrompt, decoder: Decoder, data: bytes, limits: InputLimits) -> tuple[object, str]:
    """(decoded item, sha256 hex of `data`): what a prefetch future gives."""
    return decoder.decode(data, limits, prompt), hashlib.sha256(data).hexdigest()


def _decoded(prompt: VlmPrompt, decoder: Decoder, data: bytes, limits: InputLimits, future: Future | None):
    return future.result() if future is not None else decode_item(prompt, decoder, data, limits)


def process_prompt(prompt: VlmPrompt, request: generate_pb2.Request, parts: list[PromptPart], items: list) -> dict:
    """The processor on the whole prompt; any failure on user content is that request's error."""
    try:
        return prompt.process(prompt.build_prompt(parts), items, add_special_tokens=request.add_special_tokens,
                              kinds=media_kinds(parts))
    except Exception as exc:  # noqa: BLE001
        raise InvalidRequest(request.id, f"the processor rejected the input: {type(exc).__name__}: {exc}") from None


def tokenize_media(prompt: VlmPrompt, request: generate_pb2.Request, parts: list[PromptPart], items: list,
                   digests: list[str], *, warmup: bool) -> tuple[list[int], dict, list[MediaSpan]]:
    """(prompt ids after truncation, processor outputs cut alike, media spans that survived)."""
    processed = process_prompt(prompt, request, parts, items)
    try:
        per_item = _per_item_inputs(prompt, processed, parts, items)
    except Exception as exc:  # noqa: BLE001
        raise InvalidRequest(request.id, f"the processor rejected the input: {type(exc).__name__}: {exc}") from None
    ids = processed["input_ids"][0].tolist()
    spans = prompt_spans(request, prompt, ids, media_kinds(parts), [count for _, count in per_item], digests,
                         [pixels for pixels, _ in per_item])
    return truncate_with_media(request, ids, processed, spans, warmup=warmup)


def prompt_spans(request: generate_pb2.Request, prompt: VlmPrompt, ids: list[int], kinds: list[MediaKind],
                 counts: list[int], digests: list[str], pixel_inputs: list[dict] | None = None) -> list[MediaSpan]:
    """Each item's span in the prompt ids, from its kind and embedding-token count (prompt order); the
    router's counting shortcut (`VlmPrompt.expanded_ids`) builds its spans here too, without pixel inputs."""
    located: list = [None] * len(kinds)
    try:
        for kind in dict.fromkeys(kinds):  # the items of a kind own that kind's tokens, in prompt order
            members = [i for i, k in enumerate(kinds) if k is kind]
            found = locate_spans(ids, kind, prompt.media_token_id(kind), [counts[i] for i in members])
            for i, span in zip(members, found):
                located[i] = span
    except ValueError as exc:
        raise InvalidRequest(request.id, str(exc)) from None
    pixel_inputs = pixel_inputs if pixel_inputs is not None else [{} for _ in counts]
    return [  # locate_spans gave each item exactly counts[i] embedding rows
        MediaSpan(kind, i, offset, length, embed_index, count, digest, pixels)
        for i, (kind, (offset, length, embed_index), count, pixels, digest)
        in enumerate(zip(kinds, located, counts, pixel_inputs, digests))
    ]


def _per_item_inputs(prompt: VlmPrompt, processed: dict, parts: list[PromptPart], items: list) -> list[tuple[dict, int]]:
    """(pixel inputs, embedding-token count) of each item. One item: taken from the whole-prompt
    output, whose tokens of its kind are all that item's (unless the text spells the kind's token
    itself: then, as with several items, each item goes through the processor again on its own)."""
    kinds = media_kinds(parts)
    if len(items) == 1 and not _text_names_a_media_token(prompt, parts, kinds[0]):
        count = int((processed["input_ids"] == prompt.media_token_id(kinds[0])).sum())
        return [(prompt.only_media_inputs(kinds[0], processed), count)]
    return [prompt.media_inputs(kind, item) for kind, item in zip(kinds, items)]


def _text_names_a_media_token(prompt: VlmPrompt, parts: list[PromptPart], kind: MediaKind) -> bool:
    names = {prompt.placeholder(kind), prompt.tokenizer.convert_ids_to_tokens(prompt.media_token_id(kind))}
    return any(isinstance(part, str) and any(name and name in part for name in names) for part in parts)


def truncate_with_media(request, ids: list[int], processed: dict, spans: list[MediaSpan], *, warmup: bool = False):
    """Keep the last `truncate` tokens; items wholly cut off are dropped, one cut through is an
    error (in warmup: MediaCutInWarmup, and the caller retries without media)."""
    if not request.truncate or len(ids) <= request.truncate:
        return ids, processed, spans
    cut = len(ids) - request.truncate
    for span in spans:
        if span.offset < cut < span.end and warmup:
            raise MediaCutInWarmup(f"truncate={request.truncate} cuts {span.kind.value} {span.index}")
        if span.offset < cut < span.end:
            raise InvalidRequest(
                request.id,
                f"truncate={request.truncate} would cut {span.kind.value} {span.index} (tokens "
                f"{span.offset}..{span.end - 1} of {len(ids)}); raise truncate or shorten the text",
            )
    kept = [s for s in spans if s.offset >= cut]
    for s in kept:
        s.offset -= cut
    processed = {k: (v[:, cut:] if k in PER_TOKEN_KEYS else v) for k, v in processed.items()}
    return ids[cut:], processed, kept
