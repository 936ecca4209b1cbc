"""Encoder outputs (vision features of media items) kept between steps.

Two stores with different owners:
- per-request entries (`put`/`get`/`pop`), keyed by an id given to each media span. The engine
  puts an entry the first step an item's span overlaps the step's token window and pops it after
  the step that computes the span's last token; filtering or releasing a sequence pops its
  entries. So a finished scenario leaves `num_entries == 0`.
- a cross-request LRU keyed by content (the engine uses `MediaSpan.feature_key`: the item's kind and
  the sha256 of its bytes) and bounded in bytes, which lets a repeated image or clip skip the vision tower
  (TGI recomputes it). Entries there are copies' references, evicted oldest-first when over budget;
  0 bytes disables it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable

import torch


class EncoderCache:
    def __init__(self, shared_bytes: int = 256 << 20):
        self._entries: dict[int, torch.Tensor] = {}
        self._keys = itertools.count()
        self._shared: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._shared_bytes = 0
        self.shared_capacity = shared_bytes
        self.hits = 0
        self.misses = 0

    # ----- per-request entries -----
    def new_key(self) -> int:
        return next(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def get(self, key: int) -> torch.Tensor:
        return self._entries[key]

    def put(self, key: int, features: torch.Tensor) -> None:
        self._entries[key] = features

    def pop(self, key: int) -> None:
        self._entries.pop(key, None)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    # ----- cross-request LRU by content -----
    def lookup(self, content_key: Hashable) -> torch.Tensor | None:
        features = self._shared.get(content_key)
        if features is None:
            self.misses += 1
            return None
        self._shared.move_to_end(content_key)
        self.hits += 1
        return features

    def remember(self, content_key: Hashable, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.shared_capacity or content_key in self._shared:
            return  # disabled (capacity 0), too large, or already kept: no copy made
        if features.untyped_storage().nbytes() > size:
            features = features.clone()  # a view (e.g. one item of a batched encoder call) would pin the whole batch
        self._shared[content_key] = features
        self._shared_bytes += size
        while self._shared_bytes > self.shared_capacity:
            _, evicted = self._shared.popitem(last=False)
            self._shared_bytes -= evicted.numel() * evicted.element_size()

    @property
    def shared_bytes(self) -> int:
        """Bytes of features the LRU holds (a clip's rows count like an image's: grid_t × its merged patches)."""
        return self._shared_bytes

    def clear_shared(self) -> None:
        self._shared.clear()
        self._shared_bytes = 0
