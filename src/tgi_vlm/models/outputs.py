"""Output building: a sampled token of a sequence becomes a `Generation` (with `Tokens`).

Pure formatting over what the sequence already decided (its new text, its finish reason); the
only state it touches is through the sequence's own transitions (`take_prefill_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tgi_vlm.generation import FinishReason, token_texts
from tgi_vlm.models.sequence import Sequence
from tgi_vlm.models.types import GeneratedText, Generation, Tokens


class OutputBuilder:
    def __init__(self, tokenizer, special_ids: set[int]):
        self.tokenizer = tokenizer
        self.special_ids = special_ids

    def tokens(self, ids: list[int], logprobs: list[float], texts: list[str]) -> Tokens:
        return Tokens(ids=list(ids), logprobs=list(logprobs), texts=texts,
                      is_special=[i in self.special_ids for i in ids])

    def generation(self, seq: Sequence, emitted: list[EmittedToken], reason: FinishReason | None,
                   prefill_values: list[float] | None) -> Generation:
        """The Generation for this step's tokens of `seq` (already appended, see Sequence.append_token):
        one token, or several when speculation accepted drafts; top-n per token, as TGI zips them."""
        prefill_tokens = None
        if prefill_values is not None:
            prompt = seq.all_ids[: seq.prompt_len]
            prefill_tokens = self.tokens(prompt, prefill_values, token_texts(self.tokenizer, prompt))
        generated = None
        if reason is not None:
            generated = GeneratedText(
                text=seq.detokenizer.full_text(seq.generated_ids),
                generated_tokens=len(seq.generated_ids),
                finish_reason=reason,
                seed=seq.chooser.seed if seq.chooser.do_sample else None,
            )
        top_tokens = [self.tokens(e.top[0], e.top[1], token_texts(self.tokenizer, e.top[0]))
                      for e in emitted if e.top is not None]
        return Generation(
            request_id=seq.request_id,
            prefill_tokens=prefill_tokens,
            tokens=self.tokens([e.id for e in emitted], [e.logprob for e in emitted], [e.text for e in emitted]),
            generated_text=generated,
            top_tokens=top_tokens,
        )


@dataclass(frozen=True)
class EmittedToken:
    id: int
    logprob: float
    text: str
    top: tuple[list[int], list[float]] | None = None
