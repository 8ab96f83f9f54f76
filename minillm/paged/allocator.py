"""The physical side of the paged KV cache: a fixed pool of blocks, reference counts, a free list.

The allocator knows nothing about sequences or tokens. It hands out block ids, counts how many
block-table entries point at each block, and takes a block back when the count drops to zero.
`minillm.paged.block_manager.BlockManager` builds the per-sequence view on top of it.

Every block is in exactly one of three states, and the tests check that the three add up to
the pool:

- **free**: holds nothing anyone wants; on the free list.
- **used**: ``ref_count > 0``; some sequence's block table points at it.
- **evictable**: ``ref_count == 0`` but registered in the prefix cache, so a later request with
  the same prefix can still hit it. Reused, least recently released first, only when the free
  list is empty.
"""
from __future__ import annotations

from collections import deque

from minillm.paged.errors import OutOfBlocks
from minillm.paged.prefix_cache import Block, PrefixCache

__all__ = ["BlockAllocator"]


class BlockAllocator:
    """A pool of ``num_blocks`` blocks with reference counts and an LRU of cached ones.

    Args:
        num_blocks: blocks in the pool, ``>= 1``. The GPU tensors are
            ``[num_blocks, block_size, kv_heads, head_dim]`` per layer, for K and for V.
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        # FIFO: a freed block goes to the back, so recently freed blocks are reused last.
        # (Nothing depends on the order; FIFO just spreads writes over the pool.)
        self._free: deque[int] = deque(range(num_blocks))
        self.cache = PrefixCache()
        self.num_evictions = 0  # cached blocks that lost their contents (reused or freed)

    # -- counters ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Unreferenced blocks kept for the prefix cache."""
        return self.cache.num_evictable

    @property
    def num_used(self) -> int:
        """Blocks with ``ref_count > 0``."""
        return self.num_blocks - self.num_free - self.num_evictable

    @property
    def num_available(self) -> int:
        """Blocks `allocate` can hand out now: free plus evictable."""
        return self.num_free + self.num_evictable

    def free_ids(self) -> list[int]:
        return list(self._free)

    # -- operations -------------------------------------------------------------------------
    def allocate(self) -> int:
        """A fresh block with ``ref_count == 1``; evicts the LRU cached block if none is free.

        Raises:
            OutOfBlocks: every block is referenced.
        """
        if self._free:
            block = self.blocks[self._free.popleft()]
        elif self.cache.num_evictable:
            block, *descendants = self.cache.pop_lru()
            self.num_evictions += 1 + self._release_uncached(descendants)
        else:
            raise OutOfBlocks("allocating a block", 1, 0, 0, 0)
        block.ref_count = 1
        return block.block_id

    def incref(self, block_id: int) -> None:
        """One more block-table entry points at ``block_id`` (a fork, or a prefix-cache hit)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            # Only a cached block can be picked up at ref_count 0: it stops being evictable.
            self.cache.revive(block)
        block.ref_count += 1

    def decref(self, block_id: int) -> None:
        """One block-table entry stopped pointing at ``block_id``; at zero the block is released."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.is_cached:
                self.cache.park(block)      # keep the contents: a later request may hit them
            else:
                self._free.append(block_id)

    def register(self, block_id: int, key: bytes, parent_id: int | None, token_ids) -> bool:
        """Make the full block ``block_id`` findable under ``key``, as the successor of the
        block ``parent_id`` (``None`` for a first block). Returns whether it was cached (see
        `PrefixCache.register`)."""
        parent = None if parent_id is None else self.blocks[parent_id]
        return self.cache.register(self.blocks[block_id], key, parent, token_ids)

    def evict(self, max_blocks: int | None = None) -> int:
        """Free evictable blocks, LRU first, until ``max_blocks`` have moved to the free list
        (all of them if ``None``); returns how many moved. Cached descendants of an evicted
        block leave the cache with it, so slightly more than ``max_blocks`` may move."""
        moved = 0
        while self.cache.num_evictable and (max_blocks is None or moved < max_blocks):
            removed = self.cache.pop_lru()
            moved += self._release_uncached(removed)
        self.num_evictions += moved
        return moved

    def _release_uncached(self, blocks) -> int:
        """Blocks that just left the cache: the unreferenced ones go to the free list."""
        n = 0
        for block in blocks:
            if block.ref_count == 0:
                self._free.append(block.block_id)
                n += 1
        return n
