"""Chapter 13: what the router remembers about each instance's prefix cache.

The router cannot see an instance's KV pool, but it knows every prompt it sent there. It
names a prompt's full blocks exactly as the engine does, with Chapter 6's hash chain
(`minillm.paged.chain_hash`): block ``i``'s key is ``H(key of block i-1, tokens of block i)``,
so one key stands for the whole prefix up to the end of its block, and two prompts that share
``k`` full blocks share their first ``k`` keys (`block_hashes`).

`PrefixIndex` keeps, per instance, the keys of the blocks it was sent, in least-recently-used
order and bounded in size. It is *approximate*: the instance may have evicted a block the
router still lists (its pool is smaller, or other traffic pushed it out), and an instance that
restarts has forgotten everything. A wrong guess costs only a cache miss, never a wrong answer:
the engine verifies every hit itself.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from minillm.paged.prefix_cache import chain_hash

__all__ = ["PrefixIndex", "block_hashes"]


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chain-hash keys of ``token_ids``' full blocks (``len // block_size`` of them), the
    keys the engine's prefix cache files those blocks under."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        keys.append(chain_hash(keys[-1] if keys else None, token_ids[i * block_size:(i + 1) * block_size]))
    return keys


class PrefixIndex:
    """A bounded LRU set of block keys: the blocks one instance was sent, newest last."""

    def __init__(self, capacity: int = 65536):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the index holds (a chain: the first miss ends the match).
        Changes nothing."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def insert(self, keys: Iterable[bytes]) -> None:
        """Record ``keys`` as just sent (most recently used); the least recently used keys
        leave once the index holds more than ``capacity``."""
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        """Forget everything (the instance went down: its cache is presumed lost)."""
        self._keys.clear()
