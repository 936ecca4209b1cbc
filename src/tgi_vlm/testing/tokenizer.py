"""A small byte-level BPE tokenizer trained offline, for tiny random models.

The corpus is generated from a seed (English words, numbers, punctuation, some non-ASCII text),
so the same seed gives the same merges and ids. Special tokens come first (ids 0..n-1), then the
256 byte symbols, then the merges.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

_WORDS = (
    "the of and to in is was for on that with as by at from it an be this are or his which her "
    "have had not but one all were they she there when their we been has who more will would no "
    "if out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three image picture photo cat dog house tree car street "
    "red blue green yellow black white small large left right top bottom person people sky water "
    "describe question answer what where who how many color shows there is a an on table chair "
    "window door road sign text number model token vision language sentence word hello world"
).split()

_NON_ASCII = (
    "café naïve résumé über straße façade jalapeño niño "
    "привет мир спасибо "
    "你好 世界 图片 猫 狗 "
    "こんにちは 世界 "
    "안녕하세요 "
    "γειά σου κόσμε "
    "🙂 🐱 ✓ → ° € £ ¥ —"
).split()

_PUNCTUATION = (".", ",", "?", "!", ":", ";", "...", " -", "'s", '"', "(", ")")

_SYLLABLES = (
    "ka ri to na me lo su vi en ar on st th ch sh qu pre con ing ion er al ly ment ness able "
    "tra gen dor mal pix vel ox zen "
).split()


def _pseudo_word(rng: random.Random) -> str:
    """A made-up word, so larger vocabularies (bench size) still find pairs to merge."""
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))


def _sentence(rng: random.Random) -> str:
    words = []
    for _ in range(rng.randint(4, 14)):
        roll = rng.random()
        if roll < 0.70:
            word = rng.choice(_WORDS)
        elif roll < 0.80:
            word = _pseudo_word(rng)
        elif roll < 0.90:
            word = str(rng.randint(0, 10 ** rng.randint(1, 5)))
        else:
            word = rng.choice(_NON_ASCII)
        words.append(word.capitalize() if not words else word)
    return " ".join(words) + rng.choice(_PUNCTUATION)


def generate_corpus(seed: int, num_lines: int = 800) -> list[str]:
    """Deterministic training text: `num_lines` lines of a few sentences each."""
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(1, 3))) for _ in range(num_lines)]


@dataclass(frozen=True)
class TokenizerSpec:
    """The special tokens an architecture's tokenizer and processor need.

    `named` are transformers' standard attributes (bos_token, eos_token, pad_token, unk_token);
    `extra` become `tokenizer.<name>` / `tokenizer.<name>_id` through `extra_special_tokens`
    (e.g. `image_token`); `other` are further special tokens with no attribute (row/col tags).
    """

    named: dict[str, str]
    extra: dict[str, str] = field(default_factory=dict)
    other: tuple[str, ...] = ()
    add_bos_token: bool = True

    def special_tokens(self) -> list[str]:
        tokens = [*self.named.values(), *self.extra.values(), *self.other]
        return list(dict.fromkeys(tokens))  # unique, first occurrence order


def build_tokenizer(spec: TokenizerSpec, *, seed: int = 0, num_merges: int = 400) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with `num_merges` merges and wrap it for transformers."""
    specials = spec.special_tokens()
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + 256 + num_merges,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    num_lines = max(800, 2 * num_merges)  # more merges need more text to find frequent pairs
    backend.train_from_iterator(generate_corpus(seed, num_lines), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **spec.named,
        extra_special_tokens=dict(spec.extra),
        add_bos_token=spec.add_bos_token,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )
