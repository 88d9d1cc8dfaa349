"""BlockManager and Scheduler units: prefix hashing, ref counts, eviction, accounting."""

import pytest

from atom.model_engine.block_manager import BlockManager
from atom.model_engine.scheduler import Scheduler
from atom.model_engine.sequence import FinishReason, Sequence, SequenceStatus
from atom.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _admit(bm, seq):
    prefix = bm.find_prefix(seq)
    bm.admit(seq, prefix)
    bm.grow(seq, len(seq) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(seq)
    bm.register_computed(seq)
    return prefix


def test_shared_prefix_is_reused_with_ref_counts():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = Sequence(list(range(10)), PARAMS)  # 2 full blocks + 2 tokens
    _admit(bm, a)
    assert bm.num_free_blocks == 7
    b = Sequence(list(range(8)) + [99, 98, 97], PARAMS)
    prefix = _admit(bm, b)
    assert prefix == a.block_table[:2]
    assert b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in prefix] == [2, 2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks


def test_freed_blocks_stay_cached_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = Sequence(list(range(9)), PARAMS)
    _admit(bm, a)
    bm.free(a)
    again = Sequence(list(range(9)), PARAMS)
    assert len(bm.find_prefix(again)) == 2  # revived from the free list
    filler = Sequence([50 + i for i in range(16)], PARAMS)  # takes every block: evicts
    _admit(bm, filler)
    bm.free(filler)
    assert bm.find_prefix(again) == []
    assert bm.num_free_blocks == bm.num_blocks


def test_last_token_is_never_served_from_the_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence(list(range(8)), PARAMS)
    _admit(bm, a)
    same = Sequence(list(range(8)), PARAMS)
    assert len(bm.find_prefix(same)) == 1  # the second block holds the last token
    bm.free(a)


def test_hash_collision_is_rejected_by_token_comparison():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence(list(range(9)), PARAMS)
    _admit(bm, a)
    block = bm.blocks[a.block_table[0]]
    block.token_ids = (7, 7, 7, 7)  # simulate a collision: same hash, other tokens
    assert bm.find_prefix(Sequence(list(range(9)), PARAMS)) == []
    bm.free(a)


def test_can_admit_counts_revived_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = Sequence(list(range(9)), PARAMS)
    _admit(bm, a)
    bm.free(a)
    b = Sequence(list(range(8)) + [5, 6, 7, 8, 9], PARAMS)  # 2 cached + 5 new tokens
    prefix = bm.find_prefix(b)
    assert len(prefix) == 2
    assert bm.can_admit(b, prefix, 4)  # 2 revived + 1 new block = 3
    assert not bm.can_admit(b, prefix, 5)  # would need a 4th


def test_scheduler_decodes_first_and_chunks_prefill():
    bm = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(
        bm, max_num_seqs=8, max_num_batched_tokens=10, max_model_len=64, eos_token_ids={2}
    )
    first = Sequence(list(range(3, 9)), PARAMS)
    scheduler.add(first)
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [6]
    scheduler.on_launch(batch)
    scheduler.on_complete(batch, [11])
    long = Sequence(list(range(100, 125)), PARAMS)  # 25 tokens: chunked by the budget
    scheduler.add(long)
    batch = scheduler.schedule()
    assert batch.seqs == [first, long] and batch.num_new_tokens == [1, 9]
    assert batch.num_decodes == 1
    scheduler.on_launch(batch)
    scheduler.on_complete(batch, [12])  # only `first` samples
    assert long.num_computed_tokens == 9 and len(long) == 25
    for seq in (first, long):
        scheduler.finish(seq, FinishReason.ABORT)
    assert bm.num_free_blocks == bm.num_blocks


def test_scheduler_preempts_latest_and_requeues_it_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(
        bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, eos_token_ids=set()
    )
    a, b = Sequence(list(range(8)), PARAMS), Sequence(list(range(20, 28)), PARAMS)
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    scheduler.on_launch(batch)
    scheduler.on_complete(batch, [1, 1])
    batch = scheduler.schedule()  # each needs a third block: only one fits
    assert batch.seqs == [a]
    assert b.status == SequenceStatus.WAITING and scheduler.waiting[0] is b
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert scheduler.num_preemptions == 1
    scheduler.on_launch(batch)
    scheduler.on_complete(batch, [1])


@pytest.mark.parametrize("blocks", [0, -1])
def test_block_manager_needs_blocks(blocks):
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(num_blocks=blocks, block_size=16)
