"""The bounds checks at the native library's own entry points (NativeDecodeAttention.attend and
.rotary_and_store, NativeDecodeStep), at exactly the last valid slot or row, one past it, and a negative
slot. The C code indexes raw memory, so the wrapper is the last line: what intake refuses first (tests/models/
test_slot_bounds.py) must be refused here too, by itself, and the last valid slot must still reach the call.

Run against a stand-in library that records each call (the checks are Python, in front of the call, and this
runs on any machine) and, where the kernel builds (x86-64 with AVX-512 and a C compiler), the real one."""

from __future__ import annotations

import ctypes
import platform
import sys

import pytest
import torch

from tgi_vlm.layers.attention import native_decode
from tgi_vlm.layers.attention.metadata import DecodeGroup, slot_bound
from tgi_vlm.layers.attention.native_decode import ABI_VERSION, NativeDecodeAttention, NativeDecodeStep

NUM_SLOTS, HKV, HQ, D = 64, 2, 4, 16


class _Call:
    """A ctypes function stand-in: takes argtypes/restype, records its calls (and their arguments), returns 0."""

    def __init__(self, calls: list, name: str, result: int = 0):
        self.calls, self.name, self.result = calls, name, result
        self.args: list[tuple] = []

    def __call__(self, *args):
        self.calls.append(self.name)
        self.args.append(args)
        return self.result


class StandInLibrary:
    def __init__(self):
        self.calls: list[str] = []
        for name in ("tgi_vlm_decode_attention", "tgi_vlm_rotary_kv", "tgi_vlm_skinny_linear", "tgi_vlm_rms_norm"):
            setattr(self, name, _Call(self.calls, name))

    def tgi_vlm_abi_version(self):
        return ABI_VERSION

    def tgi_vlm_skinny_max_rows(self):
        return 8

    def tgi_vlm_decode_attention_dtypes(self):
        return 1 | 2


def _builds() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            avx512 = " avx512f" in cpuinfo.read()
    except OSError:
        avx512 = False
    return platform.machine() == "x86_64" and avx512 and native_decode._compiler() is not None


@pytest.fixture(params=["stand-in", "built"])
def native(request):
    """(the wrapper, the names of the library calls it made so far, or None for the real library)."""
    if request.param == "stand-in":
        library = StandInLibrary()
        return NativeDecodeAttention(library, native_decode.cache_dir() / "stand-in.so"), library.calls
    if not _builds():
        pytest.skip("the native kernel needs x86-64 with AVX-512 and a C compiler")
    loaded = native_decode.load()
    assert loaded is not None
    return loaded, None


def cache() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(NUM_SLOTS, HKV, D), torch.zeros(NUM_SLOTS, HKV, D)


def decode_step(slot_index: list[list[int]], rows: list[int] | None = None) -> NativeDecodeStep:
    index = torch.tensor(slot_index, dtype=torch.long)
    rows = list(range(len(slot_index))) if rows is None else rows
    return NativeDecodeStep(DecodeGroup.build(rows, [len(r) for r in slot_index], index, max(rows) + 1))


def attend(native, step: NativeDecodeStep, tokens: int | None = None) -> None:
    wrapper, _ = native
    k, v = cache()
    q = torch.randn(tokens or step.num_rows, HQ, D)
    wrapper.attend(q, torch.empty_like(q), k, v, step, None, None, None)


def calls(native) -> list[str] | None:
    return None if native[1] is None else list(native[1])


# ----- decode attention -----

def test_attention_at_the_last_slot_reaches_the_kernel(native):
    attend(native, decode_step([[1, 2, NUM_SLOTS - 1], [5, 6, 7]]))
    assert calls(native) in (["tgi_vlm_decode_attention"], None)


@pytest.mark.parametrize("slot", [NUM_SLOTS, NUM_SLOTS + 1, -1, -NUM_SLOTS])
def test_attention_one_past_the_last_slot_or_before_the_first_is_refused_before_the_kernel(native, slot):
    with pytest.raises(ValueError, match=f"largest slot {NUM_SLOTS if slot == NUM_SLOTS else '.*'}\\)"):
        attend(native, decode_step([[1, 2, slot], [5, 6, 7]]))
    assert calls(native) in ([], None)


def test_attention_at_the_last_row_of_q_reaches_the_kernel_and_one_past_is_refused(native):
    attend(native, decode_step([[1, 2], [3, 4]], rows=[0, 4]), tokens=5)  # row 4 of 5
    with pytest.raises(ValueError, match="inconsistent inputs"):
        attend(native, decode_step([[1, 2], [3, 4]], rows=[0, 5]), tokens=5)  # row 5 of 5
    assert calls(native) in (["tgi_vlm_decode_attention"], None)


def test_a_step_records_its_largest_slot_and_row_and_a_negative_slot_as_past_every_cache():
    step = decode_step([[0, 3, 9], [4, 0, 0]], rows=[2, 7])
    assert (step.max_slot, step.max_row) == (9, 7)
    assert decode_step([[0, 3, -1], [4, 5, 6]]).max_slot == sys.maxsize
    nobody = NativeDecodeStep(DecodeGroup.build([], [], torch.zeros(0, 0, dtype=torch.long), 0))
    assert (nobody.max_slot, nobody.max_row, nobody.num_rows) == (0, -1, 0)  # fits any cache, any query
    assert slot_bound(torch.zeros(0, dtype=torch.long), empty=0) == 0


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
    step = NativeDecodeStep(DecodeGroup.build(list(range(5)), lens, torch.zeros(5, 40, dtype=torch.long), 5))
    got_starts, ends = step.bounds(window, chunk)
    assert got_starts.tolist() == starts and ends.tolist() == lens
    assert step.bounds(window, chunk)[0] is got_starts  # computed once per (window, chunk), shared by the layers


# ----- rotary + K/V store -----

def rotary(native, slots: list[int]):
    wrapper, _ = native
    k, v = cache()
    tokens = len(slots)
    qkv, cos = torch.randn(1, tokens, (HQ + 2 * HKV) * D), torch.randn(1, tokens, D)
    index = torch.tensor(slots, dtype=torch.long)
    return wrapper.rotary_and_store(qkv, cos, cos.clone(), HQ, k, v, index, slot_bound(index, empty=-1))


def test_rotary_at_the_last_slot_reaches_the_kernel(native):
    q, k, v = rotary(native, [0, 17, NUM_SLOTS - 1])
    assert (q.shape, k.shape, v.shape) == ((1, HQ, 3, D), (1, HKV, 3, D), (1, HKV, 3, D))
    assert calls(native) in (["tgi_vlm_rotary_kv"], None)


@pytest.mark.parametrize("slot", [NUM_SLOTS, NUM_SLOTS + 1, -1])
def test_rotary_one_past_the_last_slot_or_a_negative_one_is_refused_before_the_kernel(native, slot):
    with pytest.raises(ValueError, match="rotary_and_store: a slot past the cache, or negative"):
        rotary(native, [0, slot, 3])
    assert calls(native) in ([], None)


def test_rotary_refuses_slots_that_do_not_match_the_rows(native):
    wrapper, _ = native
    k, v = cache()
    qkv, cos = torch.randn(1, 3, (HQ + 2 * HKV) * D), torch.randn(1, 3, D)
    for slots in (torch.tensor([0, 1]), torch.tensor([0, 1, 2], dtype=torch.int32)):
        with pytest.raises(ValueError, match="slots for 3 rows"):
            wrapper.rotary_and_store(qkv, cos, cos, HQ, k, v, slots, 2)
    with pytest.raises(ValueError, match="does not hold 3 \\+ 2 x 2 heads of 16"):
        wrapper.rotary_and_store(qkv, cos, cos, HQ - 1, k, v, torch.tensor([0, 1, 2]), 2)
    assert calls(native) in ([], None)


# ----- what the stand-in library is handed (the C functions' argument order: native/*.c) -----

def int64s(address: int, n: int) -> list[int]:
    return list((ctypes.c_int64 * n).from_address(address))


def test_attention_hands_the_kernel_the_steps_slot_index_rows_and_each_rows_positions():
    library = StandInLibrary()
    wrapper = NativeDecodeAttention(library, native_decode.cache_dir() / "stand-in.so")
    index = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])  # the second sequence: 3 positions of 5
    step = NativeDecodeStep(DecodeGroup.build([2, 0], [5, 3], index, 3))
    k, v = cache()
    q, out = torch.randn(3, HQ, 2 * D)[..., :D], torch.empty(3, HQ, D)  # q: rows and heads further apart than out
    wrapper.attend(q, out, k, v, step, None, 2, None)  # sliding window 2, default scale
    (args,) = library.tgi_vlm_decode_attention.args
    assert (args[1], args[2], args[3]) == (q.data_ptr(), 2 * HQ * D, 2 * D)
    assert (args[11], args[12], args[13]) == (out.data_ptr(), HQ * D, D)
    assert args[19] == torch.get_num_threads()
    assert (args[6], args[7]) == (step.slot_index.data_ptr(), 5)  # slot index and its width
    assert int64s(args[8], 2) == [2, 0]  # rows
    assert (int64s(args[9], 2), int64s(args[10], 2)) == ([3, 1], [5, 3])  # [start, end): the last 2 positions
    assert args[14:18] == (2, HQ, HKV, D) and args[18] == D ** -0.5
    wrapper.attend(q, out, k, v, step, 0.125, None, None)  # a model's own scaling
    args = library.tgi_vlm_decode_attention.args[1]
    assert int64s(args[9], 2) == [0, 0] and args[18] == 0.125


def test_rotary_hands_the_kernel_the_rows_heads_table_stride_and_slots():
    library = StandInLibrary()
    wrapper = NativeDecodeAttention(library, native_decode.cache_dir() / "stand-in.so")
    k, v = cache()
    qkv, tables = torch.randn(1, 3, (HQ + 2 * HKV) * D), torch.randn(1, 3, 2 * D)
    cos, sin = tables[..., :D], tables[..., D:]  # rows of the tables 2 D apart
    slots = torch.tensor([9, 0, NUM_SLOTS - 1])
    wrapper.rotary_and_store(qkv, cos, sin, HQ, k, v, slots, NUM_SLOTS - 1)
    (args,) = library.tgi_vlm_rotary_kv.args
    assert args[2:7] == (qkv.stride(1), 3, HQ, HKV, D)
    assert (args[7], args[8], args[9]) == (cos.data_ptr(), sin.data_ptr(), 2 * D)
    assert (args[12], args[13]) == (k.data_ptr(), v.data_ptr()) and int64s(args[14], 3) == [9, 0, NUM_SLOTS - 1]
