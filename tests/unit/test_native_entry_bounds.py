"""The bounds checks at the native kernels' own entry points (kernels/cpu/ops.py) at exactly the last valid index,
one past it, and a negative one, for every op that takes slots or rows: decode_attention (slots, query rows,
positions in the slot index), rotary_and_store (slots), skinny_linear (rows). The C code indexes raw memory, so
each op is the last line: what intake refuses first (tests/models/test_slot_bounds.py) must be refused here too,
and the last valid index must still reach the library.

Run against a stand-in library that records each call and its arguments (the checks come before the library is
looked up, so this runs on any machine and shows what the C code is handed), and against the built library where
it loads (rotary_and_store's portable library builds with any C compiler; decode_attention and skinny_linear need
AVX-512). tests/unit/test_kernel_ops.py holds the ops' results to torch's."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from tests.unit.kernels_here import kernels
from tgi_vlm.kernels.cpu import library, ops
from tgi_vlm.layers.attention.cpu_backend import NativeDecodeStep
from tgi_vlm.layers.attention.metadata import DecodeGroup

SLOTS, HKV, HQ, D = 64, 2, 4, 16
MAX_ROWS = 8  # the stand-in's skinny_linear row limit


class _Call:
    """A bound C function stand-in: records its arguments, returns 0 (success)."""

    def __init__(self, calls: list[str], name: str):
        self.calls, self.name = calls, name
        self.args: list[tuple] = []

    def __call__(self, *args):
        self.calls.append(self.name)
        self.args.append(args)
        return 0


class StandIn:
    """Both libraries' calls, as library.PortableLibrary and library.Avx512Library bind them."""

    def __init__(self):
        self.calls: list[str] = []
        for name in ("decode_attention", "rotary_kv", "rms_norm", "skinny_linear"):
            setattr(self, name, _Call(self.calls, name))
        self.attention_dtypes = frozenset({torch.float32, torch.bfloat16})
        self.skinny_max_rows = MAX_ROWS


@pytest.fixture
def stand_in(monkeypatch) -> StandIn:
    fake = StandIn()
    loaded = library.CpuKernels({"portable": library.LibraryState(fake), "avx512": library.LibraryState(fake)})
    monkeypatch.setattr(library, "_loaded", loaded)
    return fake


def built(op: str) -> None:
    """Skip unless `op`'s library loads on this machine (then the real C code runs)."""
    state = kernels().state(op)
    if state.library is None:
        pytest.skip(f"tgi_vlm::{op} is not available here: {state.reason}")


def int64s(address: int, n: int) -> list[int]:
    return list((ctypes.c_int64 * n).from_address(address))


# ----- decode_attention -----

def decode_inputs(last_slot: int = SLOTS - 1, row: int = 2, start: int = 0, end: int = 5):
    """Two sequences, 5 and 3 positions of a 5-wide slot index, decoding at query rows `row` and 0 of 3."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(SLOTS, HKV, D, generator=gen), torch.randn(SLOTS, HKV, D, generator=gen)
    slot_index = torch.tensor([[5, 6, 7, 8, last_slot], [9, 10, 11, 0, 0]])
    row_spans = torch.tensor([[row, 0], [start, 0], [end, 3]])  # rows, starts, ends
    q = torch.randn(3, HQ, D, generator=gen)
    return q, torch.full_like(q, 7.0), k_cache, v_cache, slot_index, row_spans


def decode(*inputs) -> None:
    ops.decode_attention(*inputs, 0.25)


@pytest.mark.parametrize("where", ["stand-in", "built"])
def test_decode_attention_at_the_last_slot_row_and_position_reaches_the_kernel(where, request):
    if where == "built":
        built("decode_attention")
    else:
        fake = request.getfixturevalue("stand_in")
    q, out, *rest = decode_inputs(last_slot=SLOTS - 1, row=2, end=5)  # slot 63 of 64, row 2 of 3, end 5 of 5
    decode(q, out, *rest)
    if where == "stand-in":
        assert fake.calls == ["decode_attention"]
    else:
        assert not torch.equal(out[2], torch.full_like(out[2], 7.0)) and torch.equal(out[1], torch.full_like(out[1], 7.0))


@pytest.mark.parametrize(("change", "problem"), [
    ({"last_slot": SLOTS}, f"a slot past the cache of {SLOTS} slots, or negative \\(largest: {SLOTS}\\)"),
    ({"last_slot": SLOTS + 1}, f"a slot past the cache of {SLOTS} slots, or negative \\(largest: {SLOTS + 1}\\)"),
    ({"last_slot": -1}, f"a slot past the cache of {SLOTS} slots, or negative \\(largest: {sys.maxsize}\\)"),
    ({"row": 3}, "a row outside the query's 3 rows \\(0..3\\)"),
    ({"row": -1}, "a row outside the query's 3 rows \\(-1..0\\)"),
    ({"end": 6}, "positions outside the slot index's width 5 \\(0..6\\)"),
    ({"start": -1}, "positions outside the slot index's width 5 \\(-1..5\\)"),
], ids=["slot-one-past", "slot-two-past", "slot-negative", "row-one-past", "row-negative", "end-one-past",
        "start-negative"])
def test_decode_attention_one_past_or_before_the_first_is_refused_before_the_kernel(stand_in, change, problem):
    q, out, *rest = decode_inputs(**change)
    with pytest.raises(ValueError, match=f"^tgi_vlm::decode_attention: {problem}$"):
        decode(q, out, *rest)
    assert stand_in.calls == [] and torch.equal(out, torch.full_like(out, 7.0))


def test_decode_attention_with_no_sequences_calls_nothing(stand_in):
    q, out, k_cache, v_cache, _, _ = decode_inputs()
    decode(q, out, k_cache, v_cache, torch.zeros(0, 5, dtype=torch.long), torch.zeros(3, 0, dtype=torch.long))
    assert stand_in.calls == []


def test_decode_attention_hands_the_kernel_its_tensors_strides_and_sizes(stand_in):
    _, out, k_cache, v_cache, slot_index, row_spans = decode_inputs()
    q = torch.randn(3, HQ, 2 * D)[..., :D]  # rows and heads further apart than out's
    ops.decode_attention(q, out, k_cache, v_cache, slot_index, row_spans, 0.125)
    (args,) = stand_in.decode_attention.args
    assert args[:4] == (library.DTYPE_CODES[torch.float32], q.data_ptr(), 2 * HQ * D, 2 * D)
    assert args[4:8] == (k_cache.data_ptr(), v_cache.data_ptr(), slot_index.data_ptr(), 5)
    assert [int64s(a, 2) for a in args[8:11]] == [[2, 0], [0, 0], [5, 3]]  # rows, starts, ends
    assert args[11:18] == (out.data_ptr(), HQ * D, D, 2, HQ, HKV, D)
    assert args[18:] == (0.125, torch.get_num_threads())


# ----- rotary_and_store -----

def rotary(slots: list[int], slot_dtype=torch.long):
    gen = torch.Generator().manual_seed(len(slots))
    tokens = len(slots)
    qkv = torch.randn(1, tokens, (HQ + 2 * HKV) * D, generator=gen)
    tables = torch.randn(1, tokens, 2 * D, generator=gen)
    k_cache, v_cache = torch.zeros(SLOTS, HKV, D), torch.zeros(SLOTS, HKV, D)
    index = torch.tensor(slots, dtype=slot_dtype)
    q, k = ops.rotary_and_store(qkv, tables[..., :D], tables[..., D:], HQ, k_cache, v_cache, index)
    return qkv, (q, k), (k_cache, v_cache), index


def test_rotary_and_store_at_the_last_slot_reaches_the_kernel(stand_in):
    qkv, _, (k_cache, v_cache), index = rotary([9, 0, SLOTS - 1])
    (args,) = stand_in.rotary_kv.args
    assert args[2:7] == (qkv.stride(1), 3, HQ, HKV, D)
    assert args[9] == 2 * D  # the tables' row stride (they are views of one wider tensor)
    assert (args[12], args[13]) == (k_cache.data_ptr(), v_cache.data_ptr()) and int64s(args[14], 3) == [9, 0, SLOTS - 1]
    assert args[15] == torch.get_num_threads()


def test_rotary_and_store_writes_the_last_slot_in_the_built_library():
    built("rotary_and_store")
    qkv, (_, key), (k_cache, v_cache), _ = rotary([9, 0, SLOTS - 1])
    assert torch.equal(k_cache[SLOTS - 1], key[2])
    assert torch.equal(v_cache[SLOTS - 1], qkv[0, 2, (HQ + HKV) * D :].view(HKV, D))
    assert not k_cache[10 : SLOTS - 1].any()


@pytest.mark.parametrize(("slot", "largest"), [(SLOTS, SLOTS), (SLOTS + 1, SLOTS + 1), (-1, sys.maxsize)])
def test_rotary_and_store_one_past_the_last_slot_or_a_negative_one_is_refused_before_the_kernel(stand_in, slot,
                                                                                                largest):
    with pytest.raises(ValueError, match=f"^tgi_vlm::rotary_and_store: a slot past the cache of {SLOTS} slots, or "
                                         f"negative \\(largest: {largest}\\)$"):
        rotary([0, slot, 3])
    assert stand_in.calls == []


def test_rotary_and_store_refuses_slots_that_are_not_one_int64_per_row(stand_in):
    with pytest.raises(ValueError, match="\\(3,\\) torch.int32 slots for 3 rows"):
        rotary([0, 1, 2], slot_dtype=torch.int32)
    assert stand_in.calls == []


# ----- skinny_linear -----

def linear(rows: int) -> torch.Tensor:
    weight = torch.randn(20, 32)
    return ops.skinny_linear(torch.randn(rows, 32), ops.blocked_weight(weight), 20, None)


def test_skinny_linear_at_the_row_limit_reaches_the_kernel_and_one_more_row_is_refused(stand_in):
    assert linear(MAX_ROWS).shape == (MAX_ROWS, 20)
    with pytest.raises(ValueError, match=f"inconsistent inputs \\({MAX_ROWS + 1} rows, at most {MAX_ROWS}\\)"):
        linear(MAX_ROWS + 1)
    with pytest.raises(ValueError, match="inconsistent inputs \\(x \\(0, 32\\)"):
        linear(0)
    assert stand_in.calls == ["skinny_linear"]
    assert stand_in.skinny_linear.args[0][1:3] == (MAX_ROWS, 32)


# ----- the step the CPU backend hands decode_attention -----

def test_the_largest_slot_is_the_largest_and_a_negative_one_is_past_every_cache():
    assert ops.slot_bound(torch.tensor([[0, 3, 9], [4, 0, 0]]), empty=0) == 9
    assert ops.slot_bound(torch.tensor([0, 3, -1]), empty=0) == sys.maxsize
    assert ops.slot_bound(torch.arange(300), empty=0) == 299  # past the host-list shortcut
    assert ops.slot_bound(torch.arange(300) - 1, empty=0) == sys.maxsize
    assert ops.slot_bound(torch.zeros(0, dtype=torch.long), empty=-1) == -1


def test_a_kv_len_equal_to_the_slot_index_width_is_accepted_and_one_more_is_refused():
    index = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert NativeDecodeStep(DecodeGroup.build([0, 1], [3, 1], index, 2)).num_rows == 2
    with pytest.raises(ValueError, match="a kv_len exceeds its slot index"):
        NativeDecodeStep(DecodeGroup.build([0, 1], [4, 1], index, 2))
    with pytest.raises(ValueError, match="rows and slot index disagree"):
        NativeDecodeStep(DecodeGroup.build([0, 1, 2], [3, 1, 1], index, 3))


@pytest.mark.parametrize(("window", "chunk", "starts"), [
    (None, None, [0, 0, 0, 0, 0]),
    (16, None, [0, 0, 0, 1, 24]),  # the last 16 positions: from kv_len - 16
    (None, 16, [0, 0, 0, 16, 32]),  # the attention chunk holding the last position
    (16, 32, [0, 0, 0, 1, 32]),  # both: the later start
])
def test_the_attended_positions_start_where_the_window_and_the_chunk_say(window, chunk, starts):
    lens = [1, 15, 16, 17, 40]
    rows = [4, 0, 1, 2, 3]
    step = NativeDecodeStep(DecodeGroup.build(rows, lens, torch.zeros(5, 40, dtype=torch.long), 5))
    spans = step.row_spans(window, chunk)
    assert spans.tolist() == [rows, starts, lens]
    assert step.row_spans(window, chunk) is spans  # computed once per (window, chunk), shared by the layers
