"""Prefix caching: find full blocks whose keys and values some earlier sequence computed.

Two requests that start with the same tokens (a system prompt, a few-shot preamble, the
history of a chat) have the same keys and values for those tokens, because a token's K and V
depend only on the tokens up to it. So a full block can be named by *all the tokens up to
its end*, and any later sequence with that prefix can reuse the block instead of computing
and storing it again.

Naming a block by its whole prefix would cost ``O(position)`` per block. A **hash chain**
does it in ``O(block_size)``: block ``i``'s key is ``H(key of block i-1, tokens of block
i)``, so equal keys mean, up to a hash collision, equal prefixes. The hash must be stable
across processes and runs (Python's ``hash()`` of bytes is salted per process, see
``PYTHONHASHSEED``), so it is BLAKE2b over the parent's digest and the token ids as
little-endian int32.

A collision would silently serve the wrong keys and values, so a hit is also *verified*, and
exactly, whatever the hash: a cached block keeps its token ids and a reference to its parent
block, and block ``i`` of a request hits only if its tokens are equal **and** its parent is the
very block the request just hit for ``i - 1``. By induction the whole prefix matches. For that
induction to hold, a block is cached only if its parent is, and a block whose parent leaves the
cache leaves it too (`PrefixCache.unregister` removes a block's cached descendants with it).
With the release order below the LRU never evicts a parent before its children, so this is a
safety net that keeps the guarantee independent of the eviction policy.

Only *full* blocks are cached: a partially filled block still changes as tokens are appended.
If a key is already taken, the block that holds it stays and the newcomer is not cached (first
wins): nothing that other requests can find ever changes under them.

Eviction. A cached block that nobody references any more is not wiped: it stays in the cache,
*evictable*, in case a later request wants it, and is reused for something else only when the
free list is empty, least recently released first (LRU). Sequences release their blocks last
block first, so within one sequence the tail is evicted before the head: the head is the part
other requests are most likely to share, and evicting a child before its parent throws away
nothing else.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Block", "PrefixCache", "chain_hash", "HASH_BYTES", "HashFn"]

HASH_BYTES = 16  # 128 bits: collisions are astronomically unlikely, and verification catches them anyway

HashFn = Callable[["bytes | None", Sequence[int]], bytes]


def chain_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The key of a full block: BLAKE2b-128 of the parent block's key and this block's tokens.

    Args:
        parent: key of the previous block of the sequence, ``None`` for the first block.
        token_ids: the block's ``block_size`` token ids, each in ``[0, 2**31)``.

    Returns:
        ``HASH_BYTES`` bytes, the same in every process and on every machine.
    """
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    # The first block hashes an empty parent; every other parent is exactly HASH_BYTES long,
    # so the boundary between parent and tokens is never ambiguous.
    h.update(parent or b"")
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.digest()


@dataclass(eq=False)
class Block:
    """One physical block of the KV pool: ``block_size`` slots of every layer's K and V.

    Attributes:
        block_id: index into the pool's first axis (``k_cache[block_id]``).
        ref_count: how many block-table entries point here (sequences sharing it).
        hash: the block's prefix-cache key while it is cached, else ``None``.
        token_ids: the tokens whose K and V the block holds, kept only while cached.
        parent: while cached, the cached block holding the tokens just before these
            (``None`` for a sequence's first block).
        children: the cached blocks whose ``parent`` this is.

    The manager owns these objects: read them, never modify them. Blocks compare by identity.
    """

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    parent: Block | None = field(default=None, repr=False)
    children: set[Block] = field(default_factory=set, repr=False)

    @property
    def is_cached(self) -> bool:
        """Whether the prefix cache can find this block."""
        return self.hash is not None


class PrefixCache:
    """The key -> block table of cached full blocks, and the LRU order of evictable ones.

    Invariants (checked by the tests): ``block.hash is not None`` exactly when
    ``self.get(block.hash) is block``; a cached block's parent is cached; a block is evictable
    exactly when it is cached and its ``ref_count`` is 0.
    """

    def __init__(self):
        self._by_hash: dict[bytes, Block] = {}
        # Insertion order is release order: the first entry is the least recently released.
        self._evictable: OrderedDict[int, Block] = OrderedDict()

    def __len__(self) -> int:
        """Cached blocks, referenced or not."""
        return len(self._by_hash)

    @property
    def num_evictable(self) -> int:
        """Cached blocks with no reference: reusable once the free list is empty."""
        return len(self._evictable)

    def get(self, key: bytes) -> Block | None:
        return self._by_hash.get(key)

    def entries(self) -> dict[bytes, int]:
        """A copy of the table: key -> block id."""
        return {h: b.block_id for h, b in self._by_hash.items()}

    def evictable_ids(self) -> Iterator[int]:
        """Evictable block ids, least recently released first (the eviction order)."""
        return iter(list(self._evictable))

    def lookup(self, key: bytes, parent: Block | None, token_ids: Sequence[int]) -> Block | None:
        """The cached block for ``key`` if it holds ``token_ids`` right after block ``parent``.

        ``parent`` is the block this same lookup returned for the previous block of the
        request (``None`` for the first). A key whose block fails either check is a hash
        collision and counts as a miss.
        """
        block = self._by_hash.get(key)
        if block is None or block.parent is not parent or block.token_ids != tuple(token_ids):
            return None
        return block

    def register(self, block: Block, key: bytes, parent: Block | None, token_ids: Sequence[int]) -> bool:
        """Cache the full ``block`` under ``key``; returns whether it was cached.

        Not cached when ``key`` is taken (first wins) or when ``parent`` (the block before it
        in its sequence, ``None`` for the first) is not cached: no lookup could reach it.
        """
        if key in self._by_hash or (parent is not None and not parent.is_cached):
            return False
        block.hash, block.token_ids, block.parent = key, tuple(token_ids), parent
        if parent is not None:
            parent.children.add(block)
        self._by_hash[key] = block
        return True

    def unregister(self, block: Block) -> list[Block]:
        """Uncache ``block`` and every cached descendant; returns them all, ``block`` first.

        They keep their contents for whoever references them, but can no longer be hit, and
        are no longer evictable: the caller must free the ones with ``ref_count == 0``.
        """
        if block.parent is not None:
            block.parent.children.discard(block)
        removed, stack = [], [block]
        while stack:  # iterative: with block_size 1 a chain is as long as the sequence
            b = stack.pop()
            stack.extend(b.children)
            del self._by_hash[b.hash]
            self._evictable.pop(b.block_id, None)
            b.hash, b.token_ids, b.parent, b.children = None, (), None, set()
            removed.append(b)
        return removed

    def park(self, block: Block) -> None:
        """``block`` (cached) just lost its last reference: keep it, as most recently released."""
        self._evictable[block.block_id] = block

    def revive(self, block: Block) -> None:
        """``block`` (evictable) is referenced again by a hit: it may no longer be evicted."""
        del self._evictable[block.block_id]

    def pop_lru(self) -> list[Block]:
        """Evict the least recently released block; returns it first, then the evictable or
        used descendants that left the cache with it (see `unregister`)."""
        _, block = self._evictable.popitem(last=False)
        return self.unregister(block)
