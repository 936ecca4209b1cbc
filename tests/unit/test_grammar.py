"""GrammarState and GrammarMasker on a tiny byte-level BPE vocabulary: which tokens a grammar
allows, when EOS is allowed, how masks are laid out, and what a speculative draft may keep."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tgi_vlm.config import GrammarLimits
from tgi_vlm.generation.grammar import GrammarMasker, GrammarState, GrammarType
from tgi_vlm.generation.grammar_compiler import GrammarCompiler
from tgi_vlm.testing import tiny_model_path

WORDS = ("cat", "cats", "dog", "dogs")
ANIMALS = "(cat|dog)s?"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path("llama"))


@pytest.fixture(scope="module")
def eos(tokenizer) -> int:
    return tokenizer.eos_token_id


@pytest.fixture(scope="module")
def compiler(tokenizer, eos) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), {eos}, GrammarLimits())


@pytest.fixture(scope="module")
def masker(tokenizer, compiler, eos) -> GrammarMasker:
    return GrammarMasker(len(tokenizer), compiler.mask_words, {eos}, threads=1)


def regex_state(compiler: GrammarCompiler, regex: str) -> GrammarState:
    return compiler.state_for(GrammarType.REGEX, regex)


def allowed_ids(masker: GrammarMasker, state: GrammarState) -> set[int]:
    return set(masker.allowed([state], "cpu")[0].nonzero()[:, 0].tolist())


def feed(state: GrammarState, tokenizer, text: str) -> None:
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        assert state.advance(token), f"{text!r}: token {token} refused"


def test_the_first_mask_allows_exactly_the_tokens_that_start_a_match(tokenizer, compiler, masker):
    special = set(tokenizer.all_special_ids)
    expected = {
        i for i in range(len(tokenizer))
        if i not in special and (text := tokenizer.decode([i])) and any(w.startswith(text) for w in WORDS)
    }
    assert {"c", "d"} <= {tokenizer.decode([i]) for i in expected}  # the check is not vacuous
    assert allowed_ids(masker, regex_state(compiler, ANIMALS)) == expected


def test_eos_is_allowed_only_where_the_output_already_matches(tokenizer, compiler, masker, eos):
    state = regex_state(compiler, ANIMALS)
    feed(state, tokenizer, "ca")
    assert eos not in allowed_ids(masker, state) and not state.is_accepting
    feed(state, tokenizer, "t")
    assert state.is_accepting and not state.is_complete
    assert {tokenizer.decode([i]) for i in allowed_ids(masker, state) - {eos}} == {"s"}
    assert eos in allowed_ids(masker, state)


def test_a_complete_grammar_allows_only_eos(tokenizer, compiler, masker, eos):
    state = regex_state(compiler, ANIMALS)
    feed(state, tokenizer, "dogs")
    assert state.is_complete
    assert allowed_ids(masker, state) == {eos}


def test_special_tokens_other_than_eos_are_never_allowed(tokenizer, compiler, masker, eos):
    state = regex_state(compiler, r"(.|\n)*")  # every string, including the empty one
    allowed = allowed_ids(masker, state)
    assert set(tokenizer.all_special_ids) & allowed == {eos}
    assert len(allowed) > len(tokenizer) // 2


def test_a_refused_token_leaves_only_eos(tokenizer, compiler, masker, eos):
    state = regex_state(compiler, ANIMALS)
    assert not state.advance(tokenizer("x", add_special_tokens=False)["input_ids"][0])
    assert state.error and allowed_ids(masker, state) == {eos}


def test_states_of_one_compiled_grammar_are_independent(tokenizer, compiler, masker):
    first, second = regex_state(compiler, ANIMALS), regex_state(compiler, ANIMALS)
    feed(first, tokenizer, "cat")
    assert first.is_accepting and not second.is_accepting
    assert allowed_ids(masker, second) == allowed_ids(masker, regex_state(compiler, ANIMALS))


def test_a_draft_is_accepted_up_to_its_first_refused_token(tokenizer, compiler):
    state = regex_state(compiler, "[0-9]{3}")
    draft = tokenizer("12a4", add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode([t]) for t in draft] == ["1", "2", "a", "4"]
    assert state.accepted_prefix(draft) == 2
    assert not state.is_accepting and state.accepted_prefix(draft[:2]) == 2  # nothing was consumed


def test_rows_without_a_grammar_are_all_true_and_no_grammar_gives_none(tokenizer, compiler, masker):
    assert masker.allowed([None, None], "cpu") is None
    mask = masker.allowed([None, regex_state(compiler, ANIMALS), None], "cpu")
    assert mask.shape == (3, len(tokenizer)) and mask.dtype == torch.bool
    assert mask[0].all() and mask[2].all() and 0 < int(mask[1].sum()) < len(tokenizer)


def test_bits_unpack_to_token_ids_in_order():
    masker = GrammarMasker(70, 3, {0}, threads=1)  # 70 tokens in 3 words: the last 26 bits are cut off
    bitmask = np.array([[0b1011, -(1 << 31), -1], [0, 0, 1 << 5]], dtype=np.int32)  # -(1 << 31): bit 31 alone
    unpacked = masker.unpack(bitmask)
    assert unpacked.shape == (2, 70)
    assert unpacked[0].nonzero()[0].tolist() == [0, 1, 3, 63, 64, 65, 66, 67, 68, 69]
    assert unpacked[1].nonzero()[0].tolist() == [69]


def test_a_row_with_nothing_allowed_gets_eos():
    masker = GrammarMasker(40, 2, {7, 39}, threads=1)
    rows = np.zeros((2, 40), dtype=bool)
    rows[1, 3] = True
    fixed = masker._never_empty(rows)
    assert fixed[0].nonzero()[0].tolist() == [7, 39]
    assert fixed[1].nonzero()[0].tolist() == [3]


def test_ids_past_the_tokenizer_are_never_allowed(tokenizer, eos):
    wide = len(tokenizer) + 45  # models often have more logits than tokenizer entries
    compiler = GrammarCompiler(tokenizer, wide, {eos}, GrammarLimits())
    masker = GrammarMasker(wide, compiler.mask_words, {eos}, threads=1)
    mask = masker.allowed([compiler.state_for(GrammarType.REGEX, "(.|\n)*")], "cpu")
    assert mask.shape == (1, wide)
    assert not mask[0, len(tokenizer):].any() and mask[0, : len(tokenizer)].any()
