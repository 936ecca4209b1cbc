"""StoppingCriteria: the length limit, then EOS, then stop sequences (TGI's order)."""

from tgi_vlm.generation import FinishReason
from tgi_vlm.generation.stopping import StoppingCriteria
from tgi_vlm.pb.generate_pb2 import StoppingCriteriaParameters

EOS = 2


def test_eos_token_stops() -> None:
    stop = StoppingCriteria({EOS}, max_new_tokens=10)
    assert stop(5, "a") is None
    assert stop(EOS, "") is FinishReason.EOS_TOKEN
    assert stop.current_tokens == 2


def test_ignore_eos_keeps_going_until_length() -> None:
    stop = StoppingCriteria({EOS}, max_new_tokens=2, ignore_eos=True)
    assert stop(EOS, "") is None
    assert stop(EOS, "") is FinishReason.LENGTH


def test_length_stops_at_max_new_tokens() -> None:
    stop = StoppingCriteria({EOS}, max_new_tokens=3)
    assert [stop(7, "x") for _ in range(3)] == [None, None, FinishReason.LENGTH]


def test_length_wins_over_eos_on_the_last_token_as_in_tgi() -> None:
    stop = StoppingCriteria({EOS}, max_new_tokens=1)
    assert stop(EOS, "") is FinishReason.LENGTH


def test_stop_sequence_split_across_tokens_is_found() -> None:
    stop = StoppingCriteria({EOS}, max_new_tokens=50, stop_sequences=["###"])
    assert stop(5, "Hello #") is None
    assert stop(6, "#") is None
    assert stop(7, "#") is FinishReason.STOP_SEQUENCE


def test_stop_sequence_inside_one_tokens_text_is_found() -> None:
    stop = StoppingCriteria({EOS}, max_new_tokens=50, stop_sequences=["\n\n"])
    assert stop(5, "a\n\nb") is FinishReason.STOP_SEQUENCE


def test_stop_sequence_split_over_many_short_texts_after_long_output() -> None:
    stop = StoppingCriteria({EOS}, max_new_tokens=1000, stop_sequences=["<end>", "!"])
    for _ in range(100):
        assert stop(5, "lorem ipsum ") is None
    for piece in ["<", "e", "n", "d"]:
        assert stop(5, piece) is None
    assert stop(5, ">") is FinishReason.STOP_SEQUENCE


def test_length_wins_over_stop_sequence_as_in_tgi() -> None:
    stop = StoppingCriteria({EOS}, max_new_tokens=1, stop_sequences=["x"])
    assert stop(5, "x") is FinishReason.LENGTH


def test_eos_wins_over_a_stop_sequence_in_the_same_token_as_in_tgi() -> None:
    stop = StoppingCriteria({EOS}, max_new_tokens=5, stop_sequences=["</s>"])
    assert stop(EOS, "</s>") is FinishReason.EOS_TOKEN


def test_empty_stop_sequences_are_ignored() -> None:
    stop = StoppingCriteria({EOS}, max_new_tokens=5, stop_sequences=[""])
    assert stop(5, "abc") is None


def test_from_params_reads_the_proto_fields() -> None:
    params = StoppingCriteriaParameters(max_new_tokens=4, stop_sequences=["END"], ignore_eos_token=True)
    stop = StoppingCriteria.from_params(params, eos_token_ids=[EOS, 3])
    assert (stop.max_new_tokens, stop.stop_sequences, stop.ignore_eos, stop.eos_token_ids) == (
        4,
        ["END"],
        True,
        {2, 3},
    )


def test_finish_reason_values_are_tgis_wire_values():
    from tgi_vlm.pb import generate_pb2

    assert [int(r) for r in FinishReason] == [
        generate_pb2.FINISH_REASON_LENGTH,
        generate_pb2.FINISH_REASON_EOS_TOKEN,
        generate_pb2.FINISH_REASON_STOP_SEQUENCE,
    ]
