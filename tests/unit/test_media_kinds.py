"""Media kinds (tgi_vlm/media.py): where a kind enters the request, the adapters, the spans and the
cache keys. Images everywhere, videos on Qwen2-VL / Qwen2.5-VL; a stand-in third kind (not a MediaKind member)
shows that every architecture refuses what it does not take, and that the per-kind paths keep kinds apart."""

from __future__ import annotations

from enum import Enum
from types import SimpleNamespace

import pytest
import torch

from tgi_vlm.config import InputLimits
from tgi_vlm.errors import InvalidRequest
from tgi_vlm.media import MediaKind
from tgi_vlm.models.architectures import adapter_for, supported_model_types
from tgi_vlm.models.architectures.base import UnsupportedMediaKind, VlmPrompt
from tgi_vlm.models.media_spans import MediaSpan
from tgi_vlm.models.request_input import MediaChunk, request_chunks
from tgi_vlm.models.vlm_intake import prompt_spans
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.prefix_hash import MediaRef, chain_key, media_record, namespace_root
from tgi_vlm.testing.harness import make_request


class Stand(Enum):
    """A kind no architecture takes, shaped like MediaKind."""

    AUDIO = "audio"

    @property
    def plural(self) -> str:
        return f"{self.value}s"


AUDIO = Stand.AUDIO
VIDEO_TYPES = ("qwen2_vl", "qwen2_5_vl")
DIGEST = "ab" * 32


def fake_prompt_inputs(model_type: str):
    processor = SimpleNamespace(tokenizer=None, image_token="<image>", boi_token="<start_of_image>")
    return processor, SimpleNamespace(model_type=model_type, image_token_id=7, video_token_id=9)


# ----- the architectures -----

@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_architecture_takes_images_and_refuses_another_kind_naming_both(model_type):
    adapter = adapter_for(model_type)(None, *fake_prompt_inputs(model_type))
    prompt = adapter.prompt
    videos = model_type in VIDEO_TYPES
    assert prompt.media_kinds == ((MediaKind.IMAGE, MediaKind.VIDEO) if videos else (MediaKind.IMAGE,))
    assert prompt.media_token_id(MediaKind.IMAGE) == 7
    prompt.require(MediaKind.IMAGE)
    refused = [AUDIO] if videos else [AUDIO, MediaKind.VIDEO]
    for kind in refused:
        with pytest.raises(UnsupportedMediaKind) as info:
            prompt.require(kind)
        assert str(info.value) == (f"model_type '{model_type}' ({type(prompt).__name__}) takes no {kind.value} inputs; "
                                   f"it takes: image{', video' if videos else ''}")
    if videos:
        prompt.require(MediaKind.VIDEO)
        assert prompt.media_token_id(MediaKind.VIDEO) == 9


def test_intake_refuses_a_kind_the_architecture_does_not_take_as_the_request_s_error(monkeypatch):
    """prompt_parts is the one place kinds are checked: a chunk of another kind is an InvalidRequest naming the
    request, before anything is decoded."""
    from tgi_vlm.models import vlm_intake

    prompt = adapter_for("qwen2_vl")(None, *fake_prompt_inputs("qwen2_vl")).prompt
    monkeypatch.setattr(vlm_intake, "request_chunks", lambda request: ["see ", MediaChunk(AUDIO, b"x")])
    with pytest.raises(InvalidRequest, match="takes no audio inputs") as info:
        vlm_intake.prompt_parts(prompt, make_request(5, "see "), InputLimits())
    assert info.value.request_id == 5


def test_a_prompt_part_names_the_kind_whose_placeholder_goes_there():
    prompt = VlmPrompt(*fake_prompt_inputs("llava_next"))
    assert prompt.build_prompt(["a ", MediaKind.IMAGE, " b"]) == "a <image> b"


# ----- the request -----

def test_an_image_chunk_unpacks_as_an_image_media_chunk():
    request = make_request(0, "see ", b"\x89PNG-bytes", " now")
    assert request_chunks(request) == ["see ", MediaChunk(MediaKind.IMAGE, b"\x89PNG-bytes"), " now"]


def test_a_video_chunk_unpacks_as_a_video_media_chunk():
    from tgi_vlm.media import VideoBytes

    request = make_request(0, "see ", VideoBytes(b"clip-bytes"), " now")
    assert request.input_chunks.chunks[1].video.mimetype == "video/mp4"
    assert request_chunks(request) == ["see ", MediaChunk(MediaKind.VIDEO, b"clip-bytes"), " now"]


def test_an_unset_chunk_unpacks_as_an_empty_image_refused_later_as_before():
    request = pb.Request(id=0, input_chunks=pb.Input(chunks=[pb.InputChunk(text="a"), pb.InputChunk()]))
    assert request_chunks(request) == ["a", MediaChunk(MediaKind.IMAGE, b"")]


# ----- spans of several kinds -----

class TwoKindPrompt(VlmPrompt):
    media_kinds = (MediaKind.IMAGE, AUDIO)

    def __init__(self):
        super().__init__(*fake_prompt_inputs("two_kinds"))
        self.media_token_ids[AUDIO] = 8


def test_the_items_of_each_kind_own_that_kind_s_tokens_in_prompt_order():
    ids = [1, 7, 7, 2, 8, 8, 8, 3, 7, 4]  # image, audio, image
    spans = prompt_spans(pb.Request(id=3), TwoKindPrompt(), ids, [MediaKind.IMAGE, AUDIO, MediaKind.IMAGE],
                         [2, 3, 1], ["d0", "d1", "d2"])
    assert [(s.kind, s.index, s.offset, s.length, s.content_hash) for s in spans] == [
        (MediaKind.IMAGE, 0, 1, 2, "d0"), (AUDIO, 1, 4, 3, "d1"), (MediaKind.IMAGE, 2, 8, 1, "d2")]


def test_a_kind_whose_tokens_do_not_match_its_items_is_the_request_s_error():
    with pytest.raises(InvalidRequest, match="prompt has 2 audio tokens but its audios need 3"):
        prompt_spans(pb.Request(id=3), TwoKindPrompt(), [7, 8, 8], [MediaKind.IMAGE, AUDIO], [1, 3], ["d0", "d1"])


# ----- cache keys -----

def span(kind, digest=DIGEST) -> MediaSpan:
    return MediaSpan(kind, 0, 6, 4, torch.arange(4), 4, digest, {})


def test_the_same_bytes_as_another_kind_give_another_block_key():
    ids = list(range(12))
    image, other = MediaRef(MediaKind.IMAGE, 6, 4, DIGEST), MediaRef(MediaKind.VIDEO, 6, 4, DIGEST)
    assert media_record(other) == f"mvideo:6:4:{DIGEST}".encode()
    root = namespace_root()
    assert chain_key(root, ids, [image], 4, 8) != chain_key(root, ids, [other], 4, 8)


