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
    assert [bm.ref_counts[i] for i in prefix] == [2, 2]
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


# CPython's tuple hash (xxHash-style lanes), inverted to craft colliding chains the way
# an attacker could against `hash((parent, tokens))` keys.
_MASK, _M61 = (1 << 64) - 1, (1 << 61) - 1
_P1, _P2, _P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261


def _rotl(x):
    return ((x << 31) | (x >> 33)) & _MASK


def _rotr(x):
    return ((x >> 31) | (x << 33)) & _MASK


def _signed(x):
    return x - (1 << 64) if x >> 63 else x


def _lane_for(first_lanes, length, target):
    """The hash the last item of a tuple needs for hash(tuple) == target."""
    acc = _P5
    for lane in first_lanes:
        acc = _rotl((acc + (lane & _MASK) * _P2) & _MASK) * _P1 & _MASK
    final = ((target & _MASK) - (length ^ (_P5 ^ 3527539))) & _MASK
    before = _rotr(final * pow(_P1, -1, 1 << 64) & _MASK)
    return _signed((before - acc) * pow(_P2, -1, 1 << 64) & _MASK)


def _colliding_first_block(block: tuple[int, ...]) -> tuple[int, ...]:
    """Other tokens whose hash((None, tokens)) equals hash((None, block)) mod 2**61 - 1,
    so hash((that, next_block)) collides for every next block: a collision of the chain."""
    h = hash((None, block))
    # another int with the same hash: step away from zero by the modulus, keeping the sign
    # (an int hashes to sign(n) * (|n| mod 2**61 - 1))
    step = _M61 if h >= 0 else -_M61
    target = h + step if -(1 << 63) <= h + step < (1 << 63) else h - step
    inner = _lane_for([hash(None)], 2, target)
    for first in range(1000):
        last = _lane_for([first, *block[1:-1]], len(block), inner)
        if 0 <= last < _M61:  # an int hashes to itself in this range
            return (first, *block[1:-1], last)
    raise AssertionError("no colliding block found")


def test_a_crafted_chain_collision_is_not_served_another_prompts_blocks():
    """A victim caches X + T; an attacker caches X' (X' != X) and then asks for X' + T.
    With `hash((parent, tokens))` keys, X' is built so that the chain hashes of X + T and
    X' + T are equal at block 2 (same block tokens T, different parents): the old
    manager served the victim's block 2 (its KV attends to X). SHA-256 chains must not."""
    victim_first, shared = (1, 2, 3, 4), (5, 6, 7, 8)
    attacker_first = _colliding_first_block(victim_first)
    assert attacker_first != victim_first
    assert hash((hash((None, victim_first)), shared)) == hash(
        (hash((None, attacker_first)), shared)
    )  # the crafted collision holds for Python's hash
    bm = BlockManager(num_blocks=16, block_size=4)
    victim = Sequence([*victim_first, *shared, 9], PARAMS)
    _admit(bm, victim)
    attacker = Sequence([*attacker_first, 9], PARAMS)
    _admit(bm, attacker)
    probe = Sequence([*attacker_first, *shared, 9], PARAMS)
    assert bm.find_prefix(probe) == attacker.block_table[:1]  # its own block only
    assert victim.block_table[1] not in bm.find_prefix(probe)
    bm.free(victim)
    bm.free(attacker)


def test_chain_hash_is_sha256_of_the_parent_and_the_tokens():
    import hashlib

    from atom.model_engine.block_manager import ROOT_HASH, chain_hash

    first = chain_hash(None, [1, 2, 3, 4])
    tokens = b"".join(t.to_bytes(8, "little", signed=True) for t in (1, 2, 3, 4))
    assert first == hashlib.sha256(ROOT_HASH + tokens).digest()
    second = chain_hash(first, [5, 6, 7, 8])
    tokens = b"".join(t.to_bytes(8, "little", signed=True) for t in (5, 6, 7, 8))
    assert second == hashlib.sha256(first + tokens).digest()


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
