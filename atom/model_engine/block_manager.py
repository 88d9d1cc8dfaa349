"""Fixed-size KV blocks with prefix caching by chained SHA-256 block hashes.

A full block is identified by the SHA-256 of its parent block's digest and its own token
ids, so a digest names the whole prefix up to and including the block. Equal digests
mean equal prefixes: unlike Python's `hash()`, SHA-256 collisions cannot be crafted, so
a prompt cannot be served another request's KV (vLLM moved to SHA-256 for the same
reason, CVE-2025-25183).

Per-block state lives in flat numpy arrays (12 bytes a block: a reference count and the
two links of the free list), allocated untouched, so a cache of tens of millions of
blocks costs nothing to set up. Free blocks are either *fresh* (never handed out: the
range `[_next_fresh, num_blocks)`, taken in order) or *freed* (their last user finished):
a doubly linked list, least recently freed first, whose blocks keep their digest and can
be revived by a later request with the same prefix. A fresh allocation takes fresh
blocks first, then evicts the least recently freed block. Only blocks that hold a cached
prefix have a digest (two dict entries).

Accounting invariant: with no request alive, `num_free_blocks == num_blocks`.
"""

from __future__ import annotations

import hashlib
from array import array

import numpy as np

from atom.model_engine.sequence import Sequence
from atom.model_engine.state_slots import StateSlots

ROOT_HASH = b"atom-prefix-cache-v1"  # the parent digest of a sequence's first block


def chain_hash(parent: bytes | None, token_ids) -> bytes:
    """SHA-256 digest of a block: its parent's digest and its token ids (int64)."""
    digest = hashlib.sha256(ROOT_HASH if parent is None else parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        state_slots: StateSlots | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Per-sequence state (atom/model_engine/state_slots.py): one slot per admitted
        # sequence, handed out in `admit` and returned in `free` with the blocks.
        self.state_slots = state_slots
        # zeros/empty only reserve memory: pages are touched when blocks are first used.
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        # Freed-block list: index num_blocks is the sentinel (head = _next[sentinel]).
        self._next = np.empty(num_blocks + 1, dtype=np.int32)
        self._prev = np.empty(num_blocks + 1, dtype=np.int32)
        self._next[num_blocks] = self._prev[num_blocks] = num_blocks
        self._next_fresh = 0
        self._num_free = num_blocks
        self._block_hash: dict[int, bytes] = {}
        self._hash_to_block: dict[bytes, int] = {}
        self.prefix_hit_blocks = 0  # cumulative, for metrics and tests
        self.prefix_queried_blocks = 0

    @property
    def bookkeeping_bytes(self) -> int:
        """Host bytes of the per-block arrays (the prefix-cache dicts come on top)."""
        return self.ref_counts.nbytes + self._next.nbytes + self._prev.nbytes

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_hash(self, block_id: int) -> bytes | None:
        """The digest of the prefix a block holds, or None (not cached)."""
        return self._block_hash.get(block_id)

    def _full_block_hashes(self, seq: Sequence, num_tokens: int):
        """Chained digest of each full block within the first num_tokens tokens."""
        parent = None
        bs = self.block_size
        for start in range(0, num_tokens - bs + 1, bs):
            parent = chain_hash(parent, seq.token_ids[start : start + bs])
            yield parent

    def find_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of cached full blocks that match the start of `seq` (read-only).

        The last token is never served from the cache: one token must be computed to
        produce the next token's logits.
        """
        if (
            not self.enable_prefix_caching
            or not self._hash_to_block
            or seq.sampling_params.prompt_logprobs is not None
        ):
            return []  # prompt log-probabilities need every prompt position computed
        hits = []
        for block_hash in self._full_block_hashes(seq, len(seq) - 1):
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_admit(self, seq: Sequence, prefix: list[int], num_new_tokens: int) -> bool:
        """Whether `seq` can start with `prefix` reused and `num_new_tokens` computed."""
        revived = sum(1 for b in prefix if self.ref_counts[b] == 0)
        needed = self.blocks_for(len(prefix) * self.block_size + num_new_tokens) - len(prefix)
        if self.state_slots is not None and self.state_slots.num_free == 0:
            return False
        return needed + revived <= self.num_free_blocks

    # -- the free list ---------------------------------------------------------------------
    def _unlink(self, block_id: int) -> None:
        prev, nxt = self._prev[block_id], self._next[block_id]
        self._next[prev] = nxt
        self._prev[nxt] = prev

    def _push_freed(self, block_id: int) -> None:
        """Append to the tail (most recently freed)."""
        sentinel = self.num_blocks
        tail = self._prev[sentinel]
        self._next[tail] = block_id
        self._prev[block_id] = tail
        self._next[block_id] = sentinel
        self._prev[sentinel] = block_id

    def _take_free(self) -> int:
        """A free block for new content: a fresh one, else evict the least recently freed."""
        if self._next_fresh < self.num_blocks:
            block_id = self._next_fresh
            self._next_fresh += 1
            return block_id
        block_id = int(self._next[self.num_blocks])
        self._unlink(block_id)
        block_hash = self._block_hash.pop(block_id, None)
        if block_hash is not None and self._hash_to_block.get(block_hash) == block_id:
            del self._hash_to_block[block_hash]
        return block_id

    # -- mutations ------------------------------------------------------------------------
    def admit(self, seq: Sequence, prefix: list[int]) -> None:
        """Attach the reused prefix blocks to a sequence that holds no blocks."""
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        self.prefix_queried_blocks += max(0, (len(seq) - 1) // self.block_size)
        self.prefix_hit_blocks += len(prefix)
        if self.state_slots is not None:
            seq.state_slot = self.state_slots.allocate()
        for block_id in prefix:
            if self.ref_counts[block_id] == 0:  # revived from the freed list
                self._unlink(block_id)
                self._num_free -= 1
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.block_hashes = [self._block_hash[b] for b in prefix]
        seq.num_computed_tokens = seq.num_cached_tokens = len(prefix) * self.block_size

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """Give `seq` enough blocks to hold its computed tokens plus `num_new_tokens`;
        returns how many blocks it received."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(
                f"out of KV blocks: {seq} needs {needed}, {self.num_free_blocks} free"
            )
        for _ in range(needed):
            block_id = self._take_free()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)
        self._num_free -= max(needed, 0)
        return max(needed, 0)

    def trim(self, seq: Sequence, num_new_tokens: int) -> int:
        """Return the tail blocks `seq` holds beyond its computed tokens plus
        `num_new_tokens` (blocks reserved for rejected speculative drafts); returns how
        many. They hold no computed token, so no hash: they go back like fresh blocks."""
        keep = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        surplus = len(seq.block_table) - keep
        for _ in range(surplus):
            block_id = seq.block_table.pop()
            assert self.ref_counts[block_id] == 1 and block_id not in self._block_hash, (
                f"block {block_id} is shared"
            )
            self.ref_counts[block_id] = 0
            self._push_freed(block_id)
            self._num_free += 1
        if surplus > 0:
            seq.block_trims += 1
        return max(surplus, 0)

    def register_computed(self, seq: Sequence) -> None:
        """Publish digests of blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = seq.block_hashes
        bs = self.block_size
        while (len(hashes) + 1) * bs <= seq.num_computed_tokens:
            index = len(hashes)
            tokens = seq.token_ids[index * bs : (index + 1) * bs]
            block_hash = chain_hash(hashes[-1] if hashes else None, tokens)
            hashes.append(block_hash)
            block_id = seq.block_table[index]
            if block_id not in self._block_hash and block_hash not in self._hash_to_block:
                self._block_hash[block_id] = block_hash
                self._hash_to_block[block_hash] = block_id

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (tail first, so the tail is evicted first)."""
        for block_id in reversed(seq.block_table):
            count = self.ref_counts[block_id] - 1
            assert count >= 0, f"block {block_id} freed twice"
            self.ref_counts[block_id] = count
            if count == 0:
                self._push_freed(block_id)
                self._num_free += 1
        seq.block_table = []
        seq.block_hashes = []
        if seq.state_slot is not None:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = None
        seq.block_version += 1
