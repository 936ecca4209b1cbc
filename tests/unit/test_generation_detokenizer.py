"""IncrementalDetokenizer never emits a broken multi-byte character and its deltas add up to decode()."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tgi_vlm.generation.detokenizer import IncrementalDetokenizer, token_text, token_texts

CORPUS = ["héllo wörld", "日本語のテキスト", "smile 🙂 smile 🙂", "hello there, plain ascii text"] * 5
PROMPT = "Dis-moi 日本"
GENERATED = "héllo 日本語 🙂 ça va? ok"


def byte_level_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """vocab_size 257 leaves no merges: every non-ASCII character spans several tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@pytest.fixture(params=[257, 320], ids=["no-merges", "trained"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return byte_level_tokenizer(request.param)


def stream(tokenizer: PreTrainedTokenizerFast, generated: list[int], **kwargs: bool) -> list[str]:
    prompt = tokenizer.encode(PROMPT)
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    return [detok.step(prompt + generated[: i + 1]) for i in range(len(generated))]


def test_multibyte_characters_are_split_across_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(GENERATED)]
    assert any("\ufffd" in piece for piece in pieces)  # otherwise the next test proves nothing


def test_stream_never_emits_a_replacement_character(tokenizer: PreTrainedTokenizerFast) -> None:
    deltas = stream(tokenizer, tokenizer.encode(GENERATED))
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # some steps held back an incomplete character


def test_stream_concatenates_to_decode_of_all_generated_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    generated = tokenizer.encode(GENERATED)
    assert "".join(stream(tokenizer, generated)) == tokenizer.decode(generated) == GENERATED


def test_special_tokens_stream_unless_skipped(tokenizer: PreTrainedTokenizerFast) -> None:
    generated = tokenizer.encode("ok") + [tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, generated)) == "ok<eos>"
    assert "".join(stream(tokenizer, generated, skip_special_tokens=True)) == "ok"


def test_full_text_is_the_generated_text_without_special_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT))
    generated = tokenizer.encode(GENERATED) + [tokenizer.eos_token_id]
    assert detok.full_text(generated) == GENERATED
    assert detok.full_text(generated, skip_special_tokens=False) == GENERATED + "<eos>"
    assert detok.full_text([]) == ""


def test_token_texts_are_single_token_decodes(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("hello 🙂") + [tokenizer.eos_token_id]
    assert token_texts(tokenizer, ids) == [token_text(tokenizer, i) for i in ids]
    assert token_text(tokenizer, tokenizer.eos_token_id) == "<eos>"
