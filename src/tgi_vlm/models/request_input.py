"""A request's input as the shard reads it: its chunks in prompt order, and left truncation.

`request_chunks` is the one place a request's input is unpacked (engine, router counter, tests). No
engine imports here (only the generated protobuf types): the router's token counter reads requests
with these same functions without loading torch or the attention backends.
"""

from __future__ import annotations

from tgi_vlm.pb import generate_pb2


def request_chunks(request: generate_pb2.Request) -> list[str | bytes]:
    """The request's input in prompt order: text as str, each image as its encoded bytes.
    A request without `input_chunks` is its `inputs` string (older routers)."""
    if not request.HasField("input_chunks") or not request.input_chunks.chunks:
        return [request.inputs]
    return [c.text if c.WhichOneof("chunk") == "text" else c.image.data for c in request.input_chunks.chunks]


def truncate_ids(ids: list[int], truncate: int) -> list[int]:
    """Keep the last `truncate` tokens, as TGI does (truncation_side="left"); 0 means no limit."""
    return ids[-truncate:] if truncate and len(ids) > truncate else ids
