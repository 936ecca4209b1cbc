"""Grammar requests on a VLM (tiny Qwen2-VL) with images in their prompts: outputs hold across
chunk sizes that split the images, with a grammar request joining mid-decode and finished ones
filtered out, while an image request without a grammar keeps transformers' exact tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.models.reference import assert_matches
from tests.models.vlm_reference import hf_reference
from tgi_vlm.generation import FinishReason, GrammarType
from tgi_vlm.testing import make_test_image, png_bytes
from tgi_vlm.testing.harness import make_request
from tgi_vlm.testing.schemas import BADGE, router_regex

IMG_A = png_bytes(make_test_image(20, 20, seed=1))
IMG_B = png_bytes(make_test_image(37, 53, seed=2))
CAPTION = r"(a|the) (cat|dog|tree|car) is (red|blue|green)\."
PLAIN = ("Look at ", IMG_B, " and describe it")
SHAPE = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "round": {"type": "boolean"}},
         "required": ["color", "round"], "additionalProperties": False}


@pytest.fixture(scope="module")
def arch():
    return "qwen2_vl"


def grammar_request(rid: int, chunks: tuple, grammar: str, kind: GrammarType, **params):
    return make_request(rid, *chunks, max_new_tokens=100, ignore_eos=False, grammar=grammar, grammar_type=int(kind),
                        **params)


@pytest.mark.parametrize("chunk", [3, 16])
def test_grammar_outputs_hold_with_images_chunking_and_a_joiner(engine, runner, arch, chunk):
    badge = router_regex(BADGE)
    engine.prefill_budget = chunk
    runner.prefill([
        grammar_request(0, ("Describe ", IMG_A, " briefly"), CAPTION, GrammarType.REGEX, chunk_len=chunk),
        grammar_request(1, (IMG_B, " as json"), badge, GrammarType.REGEX, do_sample=True, seed=chunk),
        make_request(2, *PLAIN, max_new_tokens=6, chunk_len=chunk),
    ])
    for _ in range(3):
        runner.step()
    runner.prefill([grammar_request(3, ("Again ", IMG_A, IMG_B), json.dumps(SHAPE), GrammarType.JSON,
                                    do_sample=True, seed=11, temperature=0.8)], batch_id=2)
    runner.run()
    done = runner.finished
    assert {rid: done[rid].finish_reason for rid in (0, 1, 3)} == dict.fromkeys((0, 1, 3), FinishReason.EOS_TOKEN)
    assert re.fullmatch(CAPTION, done[0].text), done[0].text
    assert re.fullmatch(badge, done[1].text), done[1].text
    jsonschema.validate(json.loads(done[1].text), BADGE)
    jsonschema.validate(json.loads(done[3].text), SHAPE)
    assert_matches(runner, 2, hf_reference(arch, PLAIN, 6))
