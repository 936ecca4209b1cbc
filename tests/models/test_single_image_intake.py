"""Intake runs the processor once for a one-image request: the image's pixel inputs and token count
are read from the whole-prompt output. They must be exactly what the image alone through the
processor gives (the per-image path, still used with several images), on every architecture."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_engine
from tgi_vlm.media import MediaKind
from tgi_vlm.models.vlm_intake import _per_item_inputs, process_prompt
from tgi_vlm.testing import VLM_ARCHS, make_test_image
from tgi_vlm.testing.harness import make_request


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_one_image_s_inputs_from_the_whole_prompt_equal_the_image_alone(arch):
    prompt = load_engine(arch).adapter.prompt
    image = make_test_image(61, 45, seed=11)
    parts = ["Describe ", MediaKind.IMAGE, " in detail, please."]
    request = make_request(0, "x")
    processed = process_prompt(prompt, request, parts, [image])
    [(ours, count)] = _per_item_inputs(prompt, processed, parts, [image])
    alone, alone_count = prompt.media_inputs(MediaKind.IMAGE, image)
    assert count == alone_count > 0
    assert sorted(ours) == sorted(alone)
    for key, value in alone.items():
        assert torch.equal(ours[key], value), key


def test_the_image_goes_through_the_processor_again_only_when_the_text_spells_the_image_token(monkeypatch):
    prompt = load_engine("qwen2_vl").adapter.prompt
    image = make_test_image(40, 28, seed=1)
    calls = []
    real = prompt.media_inputs
    monkeypatch.setattr(prompt, "media_inputs", lambda kind, img: calls.append(img) or real(kind, img))
    plain = ["plain ", MediaKind.IMAGE]
    _per_item_inputs(prompt, process_prompt(prompt, make_request(0, "x"), plain, [image]), plain, [image])
    assert calls == []
    token = prompt.tokenizer.convert_ids_to_tokens(prompt.media_token_id(MediaKind.IMAGE))
    spelled = ["say " + token, MediaKind.IMAGE]
    _per_item_inputs(prompt, {"input_ids": torch.tensor([[prompt.media_token_id(MediaKind.IMAGE)] * 9])}, spelled, [image])
    assert calls == [image]
