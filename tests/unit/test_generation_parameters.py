"""validate_parameters names each bad value; proto3 zeros read as "off"."""

import math

import pytest

from tgi_vlm.generation.parameters import SamplingParameters, validate_parameters
from tgi_vlm.pb.generate_pb2 import NextTokenChooserParameters, StoppingCriteriaParameters

VOCAB = 100


def problems(stop: dict | None = None, **params: object) -> list[str]:
    stopping = StoppingCriteriaParameters(**(stop or {"max_new_tokens": 10}))
    return validate_parameters(NextTokenChooserParameters(**params), stopping, VOCAB)


def test_defaults_and_typical_values_are_valid() -> None:
    assert problems() == []
    assert problems(temperature=0.7, top_k=VOCAB, top_p=1.0, typical_p=0.9, repetition_penalty=1.1) == []
    assert problems(frequency_penalty=-1.5, do_sample=True, seed=3) == []


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": -0.5}, "top_p must be in (0, 1], got -0.5"),
        ({"typical_p": 2.0}, "typical_p must be in (0, 1], got 2.0"),
        ({"top_k": VOCAB + 1}, f"top_k must be at most the vocabulary size ({VOCAB}), got {VOCAB + 1}"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0, got -1.0"),
        ({"grammar": "[a-z]+"}, "a grammar is given with grammar_type NONE; say JSON (1) or REGEX (2)"),
        ({"grammar": "[a-z]+", "grammar_type": 7}, "grammar_type 7 is unknown (0 NONE, 1 JSON, 2 REGEX)"),
    ],
)
def test_each_bad_value_is_reported_by_name(params: dict, message: str) -> None:
    assert problems(**params) == [message]


@pytest.mark.parametrize(
    "name", ["temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty"]
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_reported_once(name: str, value: float) -> None:
    assert problems(**{name: value}) == [f"{name} must be a finite number, got {value}"]


def test_grammars_of_both_types_pass_here_and_an_empty_one_means_none() -> None:
    # The grammar text itself is checked when it compiles (tests/unit/test_grammar_compiler.py).
    assert problems(grammar="[a-z]+", grammar_type=2) == []
    assert problems(grammar='{"type": "object"}', grammar_type=1) == []
    assert problems(grammar="", grammar_type=2) == []  # TGI: an empty grammar is no grammar


def test_max_new_tokens_zero_is_rejected() -> None:
    assert problems(stop={"max_new_tokens": 0}) == ["max_new_tokens must be at least 1"]


def test_empty_stop_sequence_is_rejected() -> None:
    stop = {"max_new_tokens": 5, "stop_sequences": ["</s>", ""]}
    assert problems(stop=stop) == ["stop_sequences must not contain an empty string"]


def test_all_problems_are_listed_together() -> None:
    assert len(problems(stop={"max_new_tokens": 0}, top_p=3.0, temperature=-1.0)) == 3


def test_proto3_zeros_mean_off() -> None:
    assert SamplingParameters.from_params(NextTokenChooserParameters()) == SamplingParameters()
    assert not SamplingParameters().has_warpers


def test_set_values_are_kept() -> None:
    p = SamplingParameters.from_params(
        NextTokenChooserParameters(
            temperature=0.5, top_k=7, top_p=0.25, do_sample=True, seed=99, watermark=True
        )
    )
    assert (p.temperature, p.top_k, p.top_p, p.do_sample, p.seed, p.watermark) == (
        0.5,
        7,
        0.25,
        True,
        99,
        True,
    )
    assert p.has_warpers


def test_logit_bias_keys_that_are_token_ids_in_the_vocabulary_are_valid() -> None:
    assert problems(logit_bias={"0": 5, str(VOCAB - 1): -100, "+3": 1, "007": 2}) == []


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("hello", "logit_bias key 'hello' is not a token id (a non-negative decimal integer)"),
        ("-1", "logit_bias key '-1' is not a token id (a non-negative decimal integer)"),
        (" 5", "logit_bias key ' 5' is not a token id (a non-negative decimal integer)"),
        ("", "logit_bias key '' is not a token id (a non-negative decimal integer)"),
        ("1.0", "logit_bias key '1.0' is not a token id (a non-negative decimal integer)"),
        (str(VOCAB), f"logit_bias key '{VOCAB}' is outside the vocabulary (token ids 0..{VOCAB - 1})"),
    ],
)
def test_each_bad_logit_bias_key_is_named(key: str, message: str) -> None:
    assert problems(logit_bias={key: 1, "2": 1}) == [message]


def test_logit_bias_reads_as_sorted_id_bias_pairs_summing_keys_of_the_same_id() -> None:
    params = NextTokenChooserParameters(logit_bias={"9": -100, "7": 2, "07": 3})
    assert SamplingParameters.from_params(params).logit_bias == ((7, 5.0), (9, -100.0))
