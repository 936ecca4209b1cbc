"""`--lora-adapters` (env `LORA_ADAPTERS`): a comma-separated list of `id[=path][@revision]`, as TGI's launcher takes it.

`id` is the name requests give in `adapter_id`; `path` a local peft adapter directory (without it, `id` is a local
directory when one exists, else a Hugging Face Hub id read through the HF cache); `revision` a hub revision. Parsed
here without the engine, so the router driver, `generate`, `bench` and `launch` can check and list the names too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_SPEC = re.compile(r"^(?P<id>[^=@]+)(?:=(?P<path>[^=@]+))?(?:@(?P<revision>[^=@]+))?$")


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter to load: its request name, where it is (None: `id` itself), the hub revision."""

    id: str
    path: str | None = None
    revision: str | None = None

    @property
    def source(self) -> str:
        return self.path or self.id

    def __str__(self) -> str:
        return self.id + (f"={self.path}" if self.path else "") + (f"@{self.revision}" if self.revision else "")


def unknown_adapter_message(adapter_id: str, loaded: Sequence[str]) -> str:
    """The refusal of a request naming an adapter that is not loaded (the shard's, the driver's and the HTTP 422's)."""
    listed = ", ".join(repr(n) for n in loaded) if loaded else "none"
    return (f"adapter_id {adapter_id!r} is not a loaded LoRA adapter (loaded: {listed}; leave adapter_id empty for "
            "the base model)")


def parse_lora_adapters(text: str | None) -> tuple[AdapterSpec, ...]:
    """The adapters `text` names, in order (empty or None: none). Malformed entries and repeated ids are refused."""
    if not text or not text.strip():
        return ()
    specs = []
    for entry in text.split(","):
        entry = entry.strip()
        match = _SPEC.match(entry)
        if not entry or match is None:
            raise ValueError(f"--lora-adapters: {entry!r} is not id, id=path, id@revision or id=path@revision "
                             f"(in {text!r})")
        specs.append(AdapterSpec(match["id"].strip(), (match["path"] or "").strip() or None,
                                 (match["revision"] or "").strip() or None))
    names = [s.id for s in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--lora-adapters: adapter id(s) {', '.join(map(repr, repeated))} given more than once")
    return tuple(specs)
