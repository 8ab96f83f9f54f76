"""Chapters 5 and 6: the paged KV cache, on the CPU side (the bookkeeping, not the kernels).

A contiguous KV cache must reserve, per sequence, room for the longest sequence it might
become. Paging (vLLM's PagedAttention) cuts the cache into fixed-size blocks handed out one at
a time, so a sequence wastes at most the unfilled part of its last block, and sequences can
share blocks: forks for parallel sampling and beam search, and common prompt prefixes.

Modules, one job each:

- `minillm.paged.block_manager`: per-sequence block tables, admission, copy-on-write, fork, free
  (the API an engine's scheduler calls).
- `minillm.paged.allocator`: the pool of physical blocks, reference counts, the free list.
- `minillm.paged.prefix_cache`: hash-chained keys of full blocks, verified hits, LRU eviction.
- `minillm.paged.layout`: the padded arrays the kernels read, and NumPy/torch references of
  the pool operations.

The measurements of Chapters 5 and 6 (how much memory contiguous and paged caches waste, how much
fork-sharing saves) use these classes from `minillm.experiments`.

KV layout (the contract with the Triton kernels)
------------------------------------------------
- Per layer, ``k_cache`` and ``v_cache`` are ``[num_blocks, block_size, kv_heads, head_dim]``.
  One block id names the same rows in every layer, for K and for V.
- A **slot** is ``block_id * block_size + offset``: the row of the cache viewed as
  ``[num_blocks * block_size, kv_heads, head_dim]``. Token ``p`` of a sequence lives in slot
  ``block_table[p // block_size] * block_size + p % block_size``.
- **Block tables** go to the kernels as int32 ``[batch, max_blocks_per_seq]``, padded with
  ``-1`` (`padded_block_tables`); with each sequence's length, that is all attention needs.
- **Slot mappings** (where to write the new tokens' K and V) are int64, ``-1`` for a padding
  token that must not be written (`padded_slot_mapping`, `flat_slot_mapping`).
- **Block copies** for copy-on-write are ``(src, dst)`` block-id pairs, applied to every layer's
  K and V before the step's writes (`copy_blocks` is the reference).
"""
from minillm.paged.allocator import BlockAllocator
from minillm.paged.block_manager import Admission, AppendResult, BlockManager, BlockManagerStats, blocks_for
from minillm.paged.errors import BlockManagerError, DuplicateSequence, OutOfBlocks, RequestTooLong, UnknownSequence
from minillm.paged.layout import (
    PAD, copy_blocks, flat_slot_mapping, gather_slots, padded_block_tables, padded_slot_mapping, write_slots,
)
from minillm.paged.prefix_cache import Block, PrefixCache, chain_hash

__all__ = [
    "PAD", "Admission", "AppendResult", "Block", "BlockAllocator", "BlockManager", "BlockManagerError",
    "BlockManagerStats", "DuplicateSequence", "OutOfBlocks", "PrefixCache", "RequestTooLong", "UnknownSequence",
    "blocks_for", "chain_hash", "copy_blocks", "flat_slot_mapping", "gather_slots", "padded_block_tables",
    "padded_slot_mapping", "write_slots",
]
