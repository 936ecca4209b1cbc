"""A request's input as the shard reads it: its chunks in prompt order, and left truncation.

`request_chunks` is the one place a request's input is unpacked (engine, router counter, tests): text
as str, each media item as a `MediaChunk` (its kind, from the proto field it came in, and its bytes).
No engine imports here (only the generated protobuf types and the media kinds): the router's token
counter reads requests with these same functions without loading torch or the attention backends.
"""

from __future__ import annotations

from dataclasses import dataclass

from tgi_vlm.media import MediaKind
from tgi_vlm.pb import generate_pb2


@dataclass(frozen=True)
class MediaChunk:
    """One media item as the request carries it."""

    kind: MediaKind
    data: bytes  # encoded (e.g. PNG bytes); decoded at intake (`vlm_intake.DECODERS`)


# The proto's `InputChunk` oneof field of each media kind (the other field is "text").
CHUNK_KINDS = {"image": MediaKind.IMAGE, "video": MediaKind.VIDEO}  # video: a tgi-vlm superset field


def request_chunks(request: generate_pb2.Request) -> list[str | MediaChunk]:
    """The request's input in prompt order: text as str, each media item as a MediaChunk.
    A request without `input_chunks` is its `inputs` string (older routers)."""
    if not request.HasField("input_chunks") or not request.input_chunks.chunks:
        return [request.inputs]
    return [_unpack(c) for c in request.input_chunks.chunks]


def _unpack(chunk: generate_pb2.InputChunk) -> str | MediaChunk:
    field = chunk.WhichOneof("chunk")
    if field == "text":
        return chunk.text
    if field is None:  # an unset chunk reads as the proto's default image: empty, refused at decoding
        field = "image"
    return MediaChunk(CHUNK_KINDS[field], getattr(chunk, field).data)


def truncate_ids(ids: list[int], truncate: int) -> list[int]:
    """Keep the last `truncate` tokens, as TGI does (truncation_side="left"); 0 means no limit."""
    return ids[-truncate:] if truncate and len(ids) > truncate else ids
