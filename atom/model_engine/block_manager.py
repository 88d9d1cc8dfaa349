"""Fixed-size KV blocks with prefix caching by chained block hashes.

A block is identified by the hash of its tokens chained with the hash of the block
before it, so equal hashes mean equal prefixes (token ids are compared too, to rule out
collisions). Blocks whose last user finished stay in the free list with their hash and
can be revived by a later request with the same prefix; a fresh allocation evicts the
least recently freed block first.

Accounting invariant: with no request alive, `num_free_blocks == num_blocks`.
"""

from __future__ import annotations

from collections import OrderedDict

from atom.model_engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self.prefix_hit_blocks = 0  # cumulative, for metrics and tests
        self.prefix_queried_blocks = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _full_block_keys(self, seq: Sequence, num_tokens: int):
        """(hash, tokens) of each full block within the first num_tokens tokens."""
        prev = None
        bs = self.block_size
        for start in range(0, num_tokens - bs + 1, bs):
            tokens = tuple(seq.token_ids[start : start + bs])
            prev = chain_hash(prev, tokens)
            yield prev, tokens

    def find_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of cached full blocks that match the start of `seq` (read-only).

        The last token is never served from the cache: one token must be computed to
        produce the next token's logits.
        """
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []  # prompt log-probabilities need every prompt position computed
        hits = []
        for block_hash, tokens in self._full_block_keys(seq, len(seq) - 1):
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def can_admit(self, seq: Sequence, prefix: list[int], num_new_tokens: int) -> bool:
        """Whether `seq` can start with `prefix` reused and `num_new_tokens` computed."""
        revived = sum(1 for b in prefix if self.blocks[b].ref_count == 0)
        needed = self.blocks_for(len(prefix) * self.block_size + num_new_tokens) - len(prefix)
        return needed + revived <= self.num_free_blocks

    # -- mutations ------------------------------------------------------------------------
    def admit(self, seq: Sequence, prefix: list[int]) -> None:
        """Attach the reused prefix blocks to a sequence that holds no blocks."""
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        self.prefix_queried_blocks += max(0, (len(seq) - 1) // self.block_size)
        self.prefix_hit_blocks += len(prefix)
        for block_id in prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.block_hashes = [self.blocks[b].hash for b in prefix]
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
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict its cached content
                if self._hash_to_block.get(block.hash) == block_id:
                    del self._hash_to_block[block.hash]
                block.hash, block.token_ids = None, ()
            block.ref_count = 1
            seq.block_table.append(block_id)
        return max(needed, 0)

    def register_computed(self, seq: Sequence) -> None:
        """Publish hashes of blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = seq.block_hashes
        bs = self.block_size
        while (len(hashes) + 1) * bs <= seq.num_computed_tokens:
            index = len(hashes)
            tokens = tuple(seq.token_ids[index * bs : (index + 1) * bs])
            block_hash = chain_hash(hashes[-1] if hashes else None, tokens)
            hashes.append(block_hash)
            block = self.blocks[seq.block_table[index]]
            if block.hash is None and block_hash not in self._hash_to_block:
                block.hash, block.token_ids = block_hash, tokens
                self._hash_to_block[block_hash] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (tail first, so the tail is evicted first)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.block_version += 1
