"""KV caches in NumPy for one sequence: the contiguous cache and the sliding-window ring.

Why a cache at all: a decoder's keys and values for position ``p`` depend only on tokens
``0..p``, so once computed they never change. Decoding token ``t`` needs the keys and values
of every earlier position; recomputing them costs a whole forward pass over the prefix at
every step (quadratic work), keeping them costs memory (linear in the context). Every engine
keeps them: that memory is the KV cache.

Shapes, per layer: ``k, v: [kv_heads, slots, head_dim]`` (one sequence, no batch axis).
The new keys and values a forward step hands to `KVCache.append` are ``[kv_heads, T,
head_dim]`` for ``T`` new tokens, already rotated by RoPE (so a cached key never needs to
know its position again).

Both caches return, from ``append``, the keys and values of a *contiguous run of positions
that ends with the newest token*. That is exactly what the bottom-right aligned masks of
`minillm.reference.ch01_naive_attention` assume, so the attention call is the same for both:
``attention(q, k, v, causal=True, window=cache.window)``.

These are the NumPy twins of ``minillm.model.torch_model.KVCache`` (batched, torch); later
chapters replace the contiguous layout with paged blocks.
"""
from __future__ import annotations

import numpy as np

__all__ = ["KVCache", "RingKVCache"]


class KVCache:
    """Contiguous cache: slot ``p`` holds position ``p``, up to ``capacity`` positions.

    ``k, v: [num_layers, kv_heads, capacity, head_dim]``, allocated once up front (an engine
    cannot afford to grow arrays during decoding). Each layer counts its own cached tokens in
    ``lengths``; between forward calls all layers agree, and `seq_len` is that count.
    """

    window: int | None = None  # no sliding window: every cached position stays visible

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype=np.float64):
        shape = (num_layers, kv_heads, capacity, head_dim)
        self.k = np.zeros(shape, dtype=dtype)
        self.v = np.zeros(shape, dtype=dtype)
        self.lengths = [0] * num_layers

    @classmethod
    def for_model(cls, config, slots: int, dtype=np.float64):
        """A cache shaped for ``config`` (a `minillm.model.config.ModelConfig`) with ``slots``
        slots per layer (the capacity, or the window of a `RingKVCache`)."""
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, slots, dtype)

    @property
    def slots(self) -> int:
        """Slots per layer and KV head: what the cache costs, however many tokens it holds."""
        return self.k.shape[2]

    @property
    def seq_len(self) -> int:
        """Tokens processed so far, i.e. the position the next token will get."""
        return self.lengths[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values: ``2 · layers · kv_heads · slots · head_dim · itemsize``."""
        return self.k.nbytes + self.v.nbytes

    def append(self, layer: int, k_new: np.ndarray, v_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store ``T`` new tokens' ``k_new, v_new: [kv_heads, T, head_dim]`` for ``layer``.

        Returns the keys and values the new tokens attend over, ``[kv_heads, S, head_dim]``
        with ``S = seq_len + T``: every cached position, the new ones last. They are views
        into the cache (no copy): the point of preallocating.
        """
        start, T = self.lengths[layer], k_new.shape[1]
        if start + T > self.slots:
            raise ValueError(f"KV cache full: need {start + T} slots, have {self.slots}")
        self.k[layer, :, start:start + T] = k_new
        self.v[layer, :, start:start + T] = v_new
        self.lengths[layer] = start + T
        return self.keys(layer), self.values(layer)

    def keys(self, layer: int) -> np.ndarray:
        """Cached keys of ``layer`` in position order, ``[kv_heads, seq_len, head_dim]``."""
        return self.k[layer, :, :self.lengths[layer]]

    def values(self, layer: int) -> np.ndarray:
        """Cached values of ``layer`` in position order, ``[kv_heads, seq_len, head_dim]``."""
        return self.v[layer, :, :self.lengths[layer]]


class RingKVCache(KVCache):
    """Sliding-window cache: only the last ``window`` positions, in ``window`` slots.

    With sliding-window attention (Mistral-style; ``window=W``) the token at position ``p``
    sees positions ``p-W+1 .. p`` only, so anything older can be thrown away. Position ``p``
    lives in slot ``p % W`` and overwrites position ``p - W``, which no later token can see.
    The memory is ``W`` slots however long the sequence grows.

    The slots are not in position order once the ring has wrapped: `keys`/`values` gather
    them back into order, and `positions` says which position each slot holds.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, window: int, dtype=np.float64):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        super().__init__(num_layers, kv_heads, head_dim, window, dtype)
        self.window = window

    @staticmethod
    def slot(pos, window: int):
        """The slot of position ``pos`` (an int or an array): ``pos % window``."""
        return pos % window

    def positions(self, layer: int = 0) -> np.ndarray:
        """``[window]`` int array: the position held in each slot, ``-1`` where still empty."""
        n, W = self.lengths[layer], self.window
        held = np.arange(max(0, n - W), n)
        out = np.full(W, -1)
        out[self.slot(held, W)] = held
        return out

    def _gather(self, cache: np.ndarray, first: int, last: int) -> np.ndarray:
        """Entries of positions ``first .. last-1`` (all still in the ring), in order."""
        return cache[:, self.slot(np.arange(first, last), self.window)]

    def append(self, layer: int, k_new: np.ndarray, v_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store ``T`` new tokens for ``layer``; ``k_new, v_new: [kv_heads, T, head_dim]``.

        Returns what the new tokens attend over, in position order: the cached positions the
        first new token can still see (at most ``W - 1`` of them) followed by all ``T`` new
        ones, ``[kv_heads, min(seq_len, W-1) + T, head_dim]``. This is read *before* the new
        tokens are written: a chunk longer than the window would otherwise overwrite keys its
        own first queries need. Only the last ``min(T, W)`` new tokens are kept.
        """
        start, T, W = self.lengths[layer], k_new.shape[1], self.window
        first = max(0, start - W + 1)                              # oldest position still visible
        k = np.concatenate([self._gather(self.k[layer], first, start), k_new], axis=1)
        v = np.concatenate([self._gather(self.v[layer], first, start), v_new], axis=1)
        kept = np.arange(max(start, start + T - W), start + T)     # the new positions worth keeping
        self.k[layer][:, self.slot(kept, W)] = k_new[:, kept - start]
        self.v[layer][:, self.slot(kept, W)] = v_new[:, kept - start]
        self.lengths[layer] = start + T
        return k, v

    def keys(self, layer: int) -> np.ndarray:
        """The cached keys in position order: the last ``min(seq_len, W)`` positions."""
        n = self.lengths[layer]
        return self._gather(self.k[layer], max(0, n - self.window), n)

    def values(self, layer: int) -> np.ndarray:
        """The cached values in position order: the last ``min(seq_len, W)`` positions."""
        n = self.lengths[layer]
        return self._gather(self.v[layer], max(0, n - self.window), n)
