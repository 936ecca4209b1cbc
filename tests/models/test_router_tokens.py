"""The router's TokenCounter sees each prompt exactly as the shard does: the same ids, the same image
spans with the same content hashes (after truncation), the same bidirectional groups. The prefix
cache's keys are built from these, so any difference would make every claim fail verification."""

from __future__ import annotations

import pytest

from tgi_vlm.router.tokens import TokenCounter
from tgi_vlm.testing import VLM_ARCHS, make_test_image, png_bytes, tiny_model_path
from tgi_vlm.testing.harness import make_request

FIRST, SECOND = png_bytes(make_test_image(40, 30, seed=1)), png_bytes(make_test_image(28, 56, seed=2))
CHUNKS = ("A first picture ", FIRST, " and a second one ", SECOND, " compared, in a few words.")


@pytest.fixture(scope="module", params=VLM_ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def counter(arch):
    return TokenCounter(str(tiny_model_path(arch)))


def shard_view(engine, request):
    prompt = engine.tokenize_request(request)
    refs = [(s.offset, s.length, s.content_hash) for s in prompt.media]
    return prompt.ids, refs, prompt.mm.group_ids


def router_view(counter, request):
    prompt = counter.tokenize(request)
    return prompt.ids, [(r.offset, r.length, r.digest) for r in prompt.media], prompt.group_ids


def test_the_counter_gives_the_shards_ids_image_spans_and_groups(engine, counter):
    request = make_request(1, *CHUNKS)
    ids, refs, groups = router_view(counter, request)
    assert (ids, refs, groups) == shard_view(engine, request)
    assert len(refs) == 2 and refs[0][2] != refs[1][2]
    assert counter.count(request) == len(ids)


def test_after_truncation_dropping_the_first_image_the_spans_still_match(engine, counter):
    full = counter.tokenize(make_request(1, *CHUNKS))
    keep = len(full.ids) - full.media[0].end  # cut right after the first image
    request = make_request(1, *CHUNKS, truncate=keep)
    ids, refs, groups = router_view(counter, request)
    assert (ids, refs, groups) == shard_view(engine, request)
    assert ids == full.ids[-keep:] and len(refs) == 1 and refs[0][0] == full.media[1].offset - (len(full.ids) - keep)
