"""Images in request text, TGI's way: markdown `![](data:image/png;base64,...)` or `![](https://...)`;
clips (a tgi-vlm extension) as `![video](data:video/mp4;base64,...)` or `![video](https://...)`.

`ImageResolver.chunks(text, kinds)` splits a prompt into text (str), image (bytes) and clip (VideoBytes)
chunks in order, as TGI's router does before it calls the shard (router/src/validation.rs `prepare_input`).
A clip for a model without video (`kinds`) is a 422 before anything is fetched. Data URIs
are decoded here; http(s) URLs are fetched with a byte limit (checked on Content-Length and while
reading) and a wall-clock limit for the whole fetch. Any other scheme is refused. Decoding and
pixel limits are the shard's (the router's token counter runs the same checks before queueing).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from dataclasses import dataclass

import httpx

from tgi_vlm.api.errors import ApiError, validation_error
from tgi_vlm.media import MediaKind, VideoBytes

IMAGE_MARKDOWN = re.compile(r"!\[(video)?\]\(([^\)]*)\)")  # TGI's pattern, and the same with the alt text "video"


@dataclass(frozen=True)
class FetchLimits:
    max_bytes: int
    timeout_s: float


def split_markdown(text: str) -> list[str | tuple[str, MediaKind]]:
    """Text pieces (str) and media references ((URL, kind)), in order; no empty text."""
    pieces: list[str | tuple[str, MediaKind]] = []
    start = 0
    for match in IMAGE_MARKDOWN.finditer(text):
        if match.start() > start:
            pieces.append(text[start : match.start()])
        pieces.append((match.group(2), MediaKind.VIDEO if match.group(1) else MediaKind.IMAGE))
        start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def decode_data_uri(uri: str) -> bytes:
    """`data:<mimetype>;base64,<payload>` → the payload's bytes (TGI accepts exactly this form)."""
    content = uri[len("data:") :]
    parts = content.split(";")
    if len(parts) != 2 or not parts[1].startswith("base64,"):
        raise validation_error(f"invalid image content: {_short(content)}")
    try:
        return base64.b64decode(parts[1][len("base64,") :], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise validation_error(f"base64 encoding is invalid: {exc}") from None


class ImageResolver:
    """Turns markdown images into bytes. One HTTP client (connection pool) for the server's life."""

    def __init__(self, limits: FetchLimits):
        self.limits = limits
        # the whole fetch is bounded by `timeout_s` (wait_for); per-operation timeouts only back that up
        self.client = httpx.AsyncClient(follow_redirects=True, timeout=limits.timeout_s + 5)

    async def close(self) -> None:
        await self.client.aclose()

    async def chunks(self, text: str, kinds: tuple[MediaKind, ...] = (MediaKind.IMAGE,)) -> list[str | bytes | VideoBytes]:
        """The prompt's chunks; `kinds`: what the model takes (a clip for a model without video is a 422)."""
        pieces = split_markdown(text)
        for piece in pieces:
            if not isinstance(piece, str) and piece[1] not in kinds:
                raise validation_error(f"this model takes no {piece[1].value} inputs; it takes: "
                                       f"{', '.join(k.value for k in kinds)}")
        return [p if isinstance(p, str) else await self._chunk(*p) for p in pieces]

    async def _chunk(self, url: str, kind: MediaKind) -> bytes | VideoBytes:
        data = await self.load(url)
        return VideoBytes(data, _mimetype(url, "video/mp4")) if kind is MediaKind.VIDEO else data

    async def load(self, url: str) -> bytes:
        if url.startswith("data:"):
            return decode_data_uri(url)
        if url.startswith(("http://", "https://")):
            try:
                return await asyncio.wait_for(self._fetch(url), self.limits.timeout_s)
            except asyncio.TimeoutError:
                raise validation_error(f"Could not fetch image: {url} did not answer within "
                                       f"{self.limits.timeout_s:g} s") from None
        raise validation_error(f"invalid image content: {_short(url)} (expected a data: URI or an http(s) URL)")

    async def _fetch(self, url: str) -> bytes:
        limit = self.limits.max_bytes
        try:
            async with self.client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise validation_error(f"Could not fetch image: {url} answered HTTP {response.status_code}")
                declared = int(response.headers.get("content-length") or 0)
                if declared > limit:
                    raise _too_large(declared, limit)
                data = bytearray()
                async for piece in response.aiter_bytes():
                    data += piece
                    if len(data) > limit:
                        raise _too_large(len(data), limit)
                return bytes(data)
        except ApiError:
            raise
        except (httpx.HTTPError, OSError) as exc:
            raise validation_error(f"Could not fetch image: {url}: {type(exc).__name__}: {exc}") from None


def _mimetype(url: str, default: str) -> str:
    """A data URI's declared type (advisory: the shard sniffs the bytes)."""
    return url[len("data:") : url.index(";")] if url.startswith("data:") and ";" in url else default


def _too_large(size: int, limit: int) -> ApiError:
    return validation_error(f"Image size {size} bytes exceeds maximum allowed size of {limit} bytes")


def _short(text: str, keep: int = 64) -> str:
    return text if len(text) <= keep else f"{text[:keep]}... ({len(text)} characters)"
