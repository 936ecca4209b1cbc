"""Server-sent events as TGI writes them: `data: <json>\n\n` per event (axum's `Event::json_data`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse


class EventStream(StreamingResponse):
    """Documents a route as `text/event-stream` (/openapi.json)."""

    media_type = "text/event-stream"


DONE = b"data: [DONE]\n\n"  # the OpenAI routes' last event


def event(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode() + b"\n\n"


def response(events: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
