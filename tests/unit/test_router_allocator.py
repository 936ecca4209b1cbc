"""The router's block allocator and next-batch decision (no shard needed)."""

from __future__ import annotations

from tgi_vlm.router.allocator import BlockAllocator
from tgi_vlm.router.queue import Entry, Queue
from tgi_vlm.router.requests import RequestParams


def test_allocation_covers_input_plus_new_tokens_minus_one_with_a_slot_per_position():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    allocation = allocator.allocate(5 + 3 - 1)  # 7 positions → 2 blocks
    assert allocation.blocks == [1, 2]  # block 0 is reserved
    assert allocation.slots == [4, 5, 6, 7, 8, 9, 10]
    assert allocator.num_free == 5 and not allocator.is_full
    allocator.free(allocation)
    assert allocator.is_full and allocator.num_free == 7


def test_allocation_fails_when_too_few_blocks_are_free():
    allocator = BlockAllocator(num_blocks=3, block_size=4)
    assert allocator.allocate(9) is None
    assert allocator.num_free == 2


def entry(i: int, input_len: int, max_new_tokens: int = 4) -> Entry:
    return Entry(id=i, params=RequestParams(["x"], max_new_tokens=max_new_tokens), input_len=input_len, submitted=0.0)


def test_with_chunking_the_request_crossing_the_prefill_budget_joins_with_chunk_len():
    queue = Queue(BlockAllocator(num_blocks=64, block_size=4))
    for i, n in enumerate([10, 30, 5]):
        queue.append(entry(i, n))
    nxt = queue.next_batch(min_size=None, max_size=None, prefill_budget=25, chunking=True)
    assert [r.id for r in nxt.batch.requests] == [0, 1]
    assert not nxt.batch.requests[0].HasField("chunk_len") and nxt.batch.requests[1].chunk_len == 15
    assert len(nxt.batch.requests[1].slots) == 30 + 4 - 1
    assert [e.id for e in queue.waiting] == [2]


def test_without_chunking_a_request_over_the_budget_waits_and_keeps_no_blocks():
    allocator = BlockAllocator(num_blocks=64, block_size=4)
    queue = Queue(allocator)
    queue.append(entry(0, 30))
    assert queue.next_batch(min_size=None, max_size=None, prefill_budget=25, chunking=False) is None
    assert allocator.is_full and len(queue) == 1


def test_a_batch_smaller_than_min_size_is_put_back():
    allocator = BlockAllocator(num_blocks=64, block_size=4)
    queue = Queue(allocator)
    queue.append(entry(0, 4))
    queue.append(entry(1, 4))
    assert queue.next_batch(min_size=3, max_size=None, prefill_budget=100, chunking=False) is None
    assert allocator.is_full and [e.id for e in queue.waiting] == [0, 1]
