"""LoRA adapters by name: the index a request's `adapter_id` gets in every layer (0 = the base model).

Not the architecture adapters of `models/architectures/`: these are weight adapters a request names
in `generate_pb2.Request.adapter_id` (TGI's field 11), loaded at start from `--lora-adapters` (lora/).
A request naming an adapter the table does not hold is refused, naming it and the loaded ones
(`resolve` raises `UnknownAdapter`; intake turns it into that request's `InvalidRequest`, the rest of
the batch goes on). Prefix-cache keys take the name, not the index (`prefix_hash.namespace_root`), so
requests of two adapters never share KV blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from tgi_vlm.layers.step_context import BASE_ADAPTER
from tgi_vlm.lora.specs import unknown_adapter_message


class UnknownAdapter(KeyError):
    """A request named an adapter that is not loaded."""

    def __init__(self, adapter_id: str, loaded: Sequence[str]):
        self.adapter_id = adapter_id
        self.message = unknown_adapter_message(adapter_id, loaded)
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class AdapterTable:
    """Adapter name → index. Index 0 is the base model; loaded adapters get 1, 2, ... in order."""

    def __init__(self, names: Sequence[str] = ()):
        if "" in names or len(set(names)) != len(names):
            raise ValueError(f"adapter names must be unique and non-empty, got {list(names)}")
        self.names: tuple[str, ...] = tuple(names)
        self._index = {"": BASE_ADAPTER} | {name: i + 1 for i, name in enumerate(names)}

    def __len__(self) -> int:
        """Loaded adapters (the base model not counted)."""
        return len(self.names)

    def resolve(self, adapter_id: str) -> int:
        """The index of `adapter_id` ("" = the base model); an unknown name raises `UnknownAdapter`."""
        index = self._index.get(adapter_id)
        if index is None:
            raise UnknownAdapter(adapter_id, self.names)
        return index
