"""ASGI middleware in front of every route: the bearer token (--api-key) and the body size limit
(--payload-limit), both checked before a request body is parsed.

As in TGI, the token guards the generation routes only (POST /, /generate, /generate_stream,
/v1/chat/completions, /v1/completions, /tokenize); /health, /info, /metrics and /v1/models stay open.
A wrong or missing token is 401 with an empty body (axum's answer). A body past the limit is 413,
refused on its Content-Length, or while it is read when it has none.
"""

from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tgi_vlm.api.errors import payload_too_large

PROTECTED = {"/", "/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions", "/tokenize"}


class Guards:
    def __init__(self, app: ASGIApp, *, api_key: str | None, payload_limit: int):
        self.app = app
        self.expected = f"bearer {api_key}".lower().encode() if api_key else None  # TGI compares lowercased
        self.payload_limit = payload_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected is not None and scope["method"] == "POST" and scope["path"] in PROTECTED:
            given = headers.get(b"authorization", b"").lower()
            if not hmac.compare_digest(given, self.expected):
                await _answer(send, 401, b"", b"text/plain")
                return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.payload_limit:
            error = payload_too_large(self.payload_limit)
            await _answer(send, error.status, json.dumps(error.body()).encode(), b"application/json")
            return
        await self.app(scope, self._limited(receive), send)

    def _limited(self, receive: Receive) -> Receive:
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.payload_limit:
                    # FastAPI re-raises HTTPException from body reading; the app's handler answers 413
                    raise HTTPException(413)
            return message

        return limited


async def _answer(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
