"""One request's state inside the engine.

There is no prefill/decode phase: a sequence brings `num_computed` (tokens whose K/V are in the
cache) up to `len(all_ids)`. While `num_computed < prompt_len` it is prefilling (possibly in
chunks); afterwards each step feeds the last generated token. A step samples a token only when
the step's window reaches the end of `all_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tgi_vlm.generation import IncrementalDetokenizer, StoppingCriteria, TokenChooser


@dataclass
class Sequence:
    request_id: int
    all_ids: list[int]  # prompt (after truncation) followed by generated tokens
    prompt_len: int
    max_new_tokens: int
    chooser: TokenChooser
    stopping: StoppingCriteria
    detokenizer: IncrementalDetokenizer
    block_table: list[int]
    # [max positions] long, on the model's device: cache slot of every position the request may
    # write (router-given `slots`, or derived from the server-allocated block table).
    slot_tensor: torch.Tensor
    owns_blocks: bool  # blocks came from the server's allocator and go back to it
    num_computed: int = 0  # tokens whose K/V are in the cache
    first_chunk_len: int | None = None  # router's chunk_len for the first prefill
    started: bool = False  # a forward has run for this sequence (later chunks are sized by the server)
    prefill_logprobs: bool = False
    top_n_tokens: int = 0
    prefill_logprob_values: list[float] = field(default_factory=list)  # accumulated across chunks
    prefill_reported: bool = False
    finished: bool = False

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_len

    def align_chunk(self, n: int) -> int:
        """Adjust a prefill chunk of n tokens (subclasses keep attention blocks whole)."""
        return n

    @property
    def remaining_prompt(self) -> int:
        return self.prompt_len - self.num_computed

    @property
    def generated_ids(self) -> list[int]:
        return self.all_ids[self.prompt_len :]

    @property
    def max_total_tokens(self) -> int:
        return self.prompt_len + self.max_new_tokens


def slots_from_blocks(blocks: list[int], block_size: int) -> list[int]:
    return [b * block_size + j for b in blocks for j in range(block_size)]
