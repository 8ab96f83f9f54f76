"""Chapter 2 exercises: the KV cache. Grade your work with ``make grade CH=2``.

Replace each ``raise NotImplementedError(...)`` with your implementation. Everything here is
NumPy for one sequence; shapes have no batch axis. Tests compare your functions with the
float64 references (``minillm.reference``) and the cost model (``minillm.costs``) on fresh
random inputs.
"""
from __future__ import annotations

import numpy as np


def kv_cache_write(cache_k: np.ndarray, cache_v: np.ndarray, k_new: np.ndarray, v_new: np.ndarray,
                   start: int) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 2.1 — append ``T`` new tokens to a preallocated cache.

    ``cache_k, cache_v: [kv_heads, capacity, head_dim]``: slot ``p`` holds position ``p``;
    positions ``0 .. start-1`` are already filled. ``k_new, v_new: [kv_heads, T, head_dim]``
    are the new tokens' keys and values (positions ``start .. start+T-1``).

    Write them into the cache *in place* (leave every other slot untouched) and return
    ``(k, v)``, the visible prefix ``[kv_heads, start+T, head_dim]`` as *views* of the cache
    (no copies: the point of preallocating). Raise ``ValueError`` if the cache is too small.
    """
    raise NotImplementedError(
        "Exercise 2.1 (kv_cache_write): end = start + k_new.shape[1]; check it against "
        "cache_k.shape[1]; assign cache_k[:, start:end] = k_new (same for v); return the basic "
        "slices cache_k[:, :end], cache_v[:, :end] (basic slicing gives views, not copies)."
    )


def decode_step(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray,
                pos: int, scale: float | None = None) -> np.ndarray:
    """Exercise 2.2 — one decode step of grouped-query attention with a cache.

    The new token sits at position ``pos``; ``cache_k, cache_v: [kv_heads, capacity,
    head_dim]`` hold positions ``0 .. pos-1``. ``q: [heads, head_dim]`` is its query,
    ``k_new, v_new: [kv_heads, head_dim]`` its key and value (RoPE already applied).

    Store ``k_new, v_new`` in slot ``pos``, then return the attention output
    ``[heads, head_dim]`` of the new token over positions ``0 .. pos``:
    ``softmax(scale · q kᵀ) v`` with ``scale`` defaulting to ``1/sqrt(head_dim)``. Query head
    ``h`` reads KV head ``h // (heads // kv_heads)`` (Exercise 1.3). It must equal the last
    row of full causal attention recomputed over the whole sequence.
    """
    raise NotImplementedError(
        "Exercise 2.2 (decode_step): write cache_k[:, pos] = k_new (and v), take the first pos+1 "
        "slots, reshape q to [kv_heads, group, head_dim] so each group of query heads meets its KV "
        "head, compute scores = scale * qg @ k.transpose(0, 2, 1), a safe softmax over the last "
        "axis (no mask: the newest token sees every cached position), multiply by v, reshape back."
    )


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Exercise 2.3a — KV-cache bytes one token costs (``β`` in the memory budget).

    Every layer caches a key and a value vector of ``head_dim`` elements per KV head, each
    element ``dtype_bytes`` bytes. (Query heads do not count: queries are never cached.)
    """
    raise NotImplementedError(
        "Exercise 2.3a (kv_bytes_per_token): count the elements one token adds to the cache: "
        "K and V (2), in every layer, for every KV head, head_dim each; times dtype_bytes."
    )


def max_batch(mem_bytes: int, weight_bytes: int, alpha: int, beta: int, context: int) -> int:
    """Exercise 2.3b — the largest batch that fits: ``Mem ≥ M + α·BS + β·TN``.

    ``mem_bytes`` (Mem) is the GPU memory, ``weight_bytes`` (M) the weights, ``alpha`` (α)
    the temporary bytes per sequence, ``beta`` (β) the KV-cache bytes per token, and every
    sequence holds ``context`` tokens, so ``TN = BS · context``. Return the largest integer
    ``BS >= 0`` satisfying the budget (0 when the weights alone do not fit).
    """
    raise NotImplementedError(
        "Exercise 2.3b (max_batch): each sequence costs alpha + beta * context bytes; divide the "
        "memory left after the weights by that and round down (integer //); 0 if nothing is left."
    )


def ring_slot(pos, window: int):
    """Exercise 2.4a — the slot of position ``pos`` in a ring buffer of ``window`` slots.

    Sliding-window attention lets position ``p`` see only ``p-W+1 .. p``, so a cache of ``W``
    slots suffices: the new token overwrites the one ``W`` positions back, which nobody can
    see any more. ``pos`` may be an int or an integer array.
    """
    raise NotImplementedError(
        "Exercise 2.4a (ring_slot): which slot does position pos - window leave free? "
        "One arithmetic operator, and it works on arrays too."
    )


def ring_read(ring_k: np.ndarray, ring_v: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 2.4b — the ring's contents in position order.

    ``ring_k, ring_v: [kv_heads, window, head_dim]`` after ``seq_len`` tokens were written,
    position ``p`` in slot ``ring_slot(p, window)``. Return ``(k, v)``, each
    ``[kv_heads, min(seq_len, window), head_dim]``: the positions still held, oldest first.
    Attention over them with ``causal=True, window=window`` must equal the sliding-window
    attention of the full sequence.
    """
    raise NotImplementedError(
        "Exercise 2.4b (ring_read): the held positions are max(0, seq_len - window) .. seq_len-1; "
        "turn them into slots with ring_slot (np.arange works) and index the slot axis with them."
    )
