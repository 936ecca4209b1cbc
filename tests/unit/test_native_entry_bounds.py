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
import re
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


# ----- the inputs' kind, device and layout, one at a time (the C code trusts every one of them) -----

def on_meta(t: torch.Tensor) -> torch.Tensor:
    """The same shape, dtype and strides, not on the CPU (a tensor the C code must never be handed)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@pytest.mark.parametrize("which", [0, 1, 2, 3, 4, 5], ids=["q", "out", "k_cache", "v_cache", "slot_index", "row_spans"])
def test_decode_attention_refuses_any_one_tensor_that_is_not_on_the_cpu(which):
    """The op's CPU kernel checks every input with `_decode_problem` (a tensor on another device dispatches the op
    elsewhere, so the check is called here as the kernel calls it)."""
    inputs = list(decode_inputs())
    assert ops._decode_problem(*inputs) is None
    inputs[which] = on_meta(inputs[which])
    assert ops._decode_problem(*inputs) == "every tensor must be on the CPU"


def test_decode_attention_refuses_a_head_size_off_the_multiple_of_16_and_names_both_shapes(stand_in):
    q, out, k_cache, v_cache, slot_index, row_spans = decode_inputs()
    narrow = torch.zeros(SLOTS, HKV, 8)
    with pytest.raises(ValueError, match=re_exact("the cache must be [slots, Hkv, D] contiguous float32 or bfloat16 "
                                                  f"with D a multiple of 16 up to 256, got ({SLOTS}, {HKV}, 8) "
                                                  "torch.float32")):
        decode(q[..., :8], out[..., :8], narrow, narrow.clone(), slot_index, row_spans)
    wide_q = torch.zeros(3, HQ, 2 * D)
    with pytest.raises(ValueError, match=re_exact(f"query (3, {HQ}, {2 * D}) torch.float32 (last dim contiguous) does "
                                                  f"not fit the cache ({SLOTS}, {HKV}, {D}) torch.float32")):
        decode(wide_q, wide_q.clone(), k_cache, v_cache, slot_index, row_spans)
    assert stand_in.calls == []


def test_decode_attention_refuses_a_slot_index_that_is_not_contiguous(stand_in):
    q, out, k_cache, v_cache, slot_index, row_spans = decode_inputs()
    strided = torch.zeros(2, 10, dtype=torch.long)[:, ::2]
    strided.copy_(slot_index)
    with pytest.raises(ValueError, match=re_exact("the slot index must be [B, width] contiguous int64, got (2, 5) "
                                                  "torch.int64")):
        decode(q, out, k_cache, v_cache, strided, row_spans)
    assert stand_in.calls == []


def test_an_empty_slot_index_names_no_slot_so_even_a_one_slot_cache_takes_it():
    q = torch.zeros(1, HQ, D)
    one_slot = torch.zeros(1, HKV, D)
    # one sequence with no cached position yet: nothing to index, whatever the cache's size
    assert ops._decode_index_problem(q, one_slot, torch.zeros(1, 0, dtype=torch.long), torch.zeros(3, 1).long()) is None
    assert ops._decode_index_problem(q, one_slot, torch.zeros(1, 1, dtype=torch.long),
                                     torch.tensor([[0], [0], [1]])) is None  # slot 0: the last of one
    assert ops._decode_index_problem(q, one_slot, torch.ones(1, 1, dtype=torch.long), torch.tensor([[0], [0], [1]])) \
        == "a slot past the cache of 1 slots, or negative (largest: 1)"


def re_exact(message: str) -> str:
    return f"^tgi_vlm::[a-z_]+: {re.escape(message)}$"


def rotary_inputs():
    qkv = torch.zeros(1, 3, (HQ + 2 * HKV) * D)
    tables = torch.zeros(1, 3, D)
    return qkv, tables, tables.clone(), HQ, torch.zeros(SLOTS, HKV, D), torch.zeros(SLOTS, HKV, D), torch.arange(3)


def test_rotary_and_store_refuses_a_product_that_is_not_one_sequence_of_rows(stand_in):
    qkv, cos, sin, *rest = rotary_inputs()
    with pytest.raises(ValueError, match=re_exact("the fused product must be [1, T, W] CPU float32 or bfloat16, last "
                                                  f"dim contiguous, got (3, {(HQ + 2 * HKV) * D})")):
        ops.rotary_and_store(qkv[0], cos, sin, *rest)
    assert stand_in.calls == []


@pytest.mark.parametrize("which", ["cos", "sin"])
@pytest.mark.parametrize("bad", ["float64", "meta", "shape"])
def test_rotary_and_store_refuses_either_table_of_another_dtype_device_or_shape(stand_in, which, bad):
    qkv, cos, sin, *rest = rotary_inputs()
    table = {"cos": cos, "sin": sin}[which]
    table = {"float64": table.double(), "meta": on_meta(table), "shape": torch.zeros(1, 2, D)}[bad]
    cos, sin = (table, sin) if which == "cos" else (cos, table)
    message = f"rotary tables {tuple(cos.shape)} / {tuple(sin.shape)} are not [1, T, D] for {tuple(qkv.shape)}"
    assert ops._rotary_problem(qkv, cos, sin, *rest[:3]) == message  # what the CPU kernel checks first
    if bad != "meta":  # a meta table dispatches the op to its fake kernel
        with pytest.raises(ValueError, match=re_exact(message)):
            ops.rotary_and_store(qkv, cos, sin, *rest)
    assert stand_in.calls == []


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_skinny_linear_refuses_a_weight_or_bias_that_is_not_on_the_cpu(which):
    x, weight, bias = torch.randn(2, 32), ops.blocked_weight(torch.randn(20, 32)), torch.zeros(20)
    assert ops._linear_problem(x, weight, 20, bias) is None
    weight, bias = (on_meta(weight), bias) if which == "weight" else (weight, on_meta(bias))
    assert ops._linear_problem(x, weight, 20, bias).startswith("inconsistent inputs (x (2, 32) torch.float32")


def test_skinny_linear_takes_a_single_output_column(stand_in):
    out = ops.skinny_linear(torch.randn(2, 32), ops.blocked_weight(torch.randn(1, 32)), 1, torch.zeros(1))
    assert out.shape == (2, 1) and stand_in.calls == ["skinny_linear"]


def test_an_op_called_before_the_kernels_were_loaded_says_so(monkeypatch):
    monkeypatch.setattr(library, "_loaded", None)
    with pytest.raises(RuntimeError, match=re.escape("tgi_vlm::rms_norm is not available: the native kernels were "
                                                     "not loaded (kernels.cpu.load)")):
        ops._loaded("rms_norm")
