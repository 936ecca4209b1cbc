"""Media-span location and the window-overlap helper."""

from __future__ import annotations

import pytest
import torch

from tgi_vlm.media import MediaKind
from tgi_vlm.models.media_spans import MediaSpan, locate_spans, spans_overlapping

IMG = 9


def test_spans_follow_image_tokens_in_order_with_structure_tokens_inside():
    ids = [1, 2, IMG, IMG, 5, IMG, IMG, 3, IMG, IMG, IMG, 4]  # image 0 has a marker (5) inside
    spans = locate_spans(ids, MediaKind.IMAGE, IMG, counts=[4, 3])
    assert [(o, n) for o, n, _ in spans] == [(2, 5), (8, 3)]
    assert spans[0][2].tolist() == [0, 1, -1, 2, 3]
    assert spans[1][2].tolist() == [0, 1, 2]


def test_back_to_back_images_are_split_by_count():
    ids = [IMG] * 6
    spans = locate_spans(ids, MediaKind.IMAGE, IMG, counts=[2, 4])
    assert [(o, n) for o, n, _ in spans] == [(0, 2), (2, 4)]


def test_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="3 image tokens but its images need 4"):
        locate_spans([IMG, IMG, IMG], MediaKind.IMAGE, IMG, counts=[4])


def _span(offset, length):
    return MediaSpan(MediaKind.IMAGE, 0, offset, length, torch.arange(length), length, "h", {})


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [(0, 5, []), (0, 6, [(5, 6)]), (6, 9, [(6, 9)]), (14, 20, [(14, 15)]), (15, 20, []), (0, 100, [(5, 15)])],
)
def test_overlap_is_the_half_open_intersection(start, end, expected):
    span = _span(5, 10)  # positions [5, 15)
    assert [(s, e) for _, s, e in spans_overlapping([span], start, end)] == expected
