"""LoRA adapters by name: the index a request's `adapter_id` gets in every layer (0 = the base model).

Not the architecture adapters of `models/architectures/`: these are weight adapters a request names
in `generate_pb2.Request.adapter_id` (TGI's field 11). No adapter is loaded yet, so a served table
holds only the base model, "" → 0. A request naming an adapter the table does not hold runs on the
base model, exactly as before the field was read (the shard ignored it); the LoRA work makes that a
per-request refusal once adapters can be loaded. Its prefix-cache keys are still its own
(`prefix_hash.namespace_root` takes the name, not the index), so it never shares KV blocks with
another adapter's requests, today or later.
"""

from __future__ import annotations

from collections.abc import Sequence

from tgi_vlm.layers.step_context import BASE_ADAPTER


class AdapterTable:
    """Adapter name → index. Index 0 is the base model; loaded adapters get 1, 2, ... in order."""

    def __init__(self, names: Sequence[str] = ()):
        if "" in names or len(set(names)) != len(names):
            raise ValueError(f"adapter names must be unique and non-empty, got {list(names)}")
        self._index = {"": BASE_ADAPTER} | {name: i + 1 for i, name in enumerate(names)}

    def resolve(self, adapter_id: str) -> int:
        """The index of `adapter_id`; an unknown name gets the base model (see the module docstring)."""
        return self._index.get(adapter_id, BASE_ADAPTER)
