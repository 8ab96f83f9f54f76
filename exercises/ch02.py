"""Chapter 2 exercises: the KV cache. Grade your work with ``make grade CH=2``.

Replace each ``raise NotImplementedError(...)`` with your implementation. Exercises 2.1–2.4 are
NumPy for one sequence; their shapes have no batch axis. Exercises 2.5 and 2.6 are Triton
kernels over a batched cache: write the body of the ``@triton.jit`` function, then delete the
``raise`` at the top of its launcher. Tests compare your functions with the
float64 references (``minillm.reference``) and the cost model (``minillm.costs``) on fresh
random inputs.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)


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
    raise NotImplementedError("Exercise 2.1 (kv_cache_write): not started. Read its docstring; hints: python -m minillm.grade 2 --hint 2.1")


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
    raise NotImplementedError("Exercise 2.2 (decode_step): not started. Read its docstring; hints: python -m minillm.grade 2 --hint 2.2")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Exercise 2.3a — KV-cache bytes one token costs (``β`` in the memory budget).

    Every layer caches a key and a value vector of ``head_dim`` elements per KV head, each
    element ``dtype_bytes`` bytes. (Query heads do not count: queries are never cached.)
    """
    raise NotImplementedError("Exercise 2.3a (kv_bytes_per_token): not started. Read its docstring; hints: python -m minillm.grade 2 --hint 2.3")


def max_batch(mem_bytes: int, weight_bytes: int, alpha: int, beta: int, context: int) -> int:
    """Exercise 2.3b — the largest batch that fits: ``Mem ≥ M + α·BS + β·TN``.

    ``mem_bytes`` (Mem) is the GPU memory, ``weight_bytes`` (M) the weights, ``alpha`` (α)
    the temporary bytes per sequence, ``beta`` (β) the KV-cache bytes per token, and every
    sequence holds ``context`` tokens, so ``TN = BS · context``. Return the largest integer
    ``BS >= 0`` satisfying the budget (0 when the weights alone do not fit).
    """
    raise NotImplementedError("Exercise 2.3b (max_batch): not started. Read its docstring; hints: python -m minillm.grade 2 --hint 2.3")


def ring_slot(pos, window: int):
    """Exercise 2.4a — the slot of position ``pos`` in a ring buffer of ``window`` slots.

    Sliding-window attention lets position ``p`` see only ``p-W+1 .. p``, so a cache of ``W``
    slots suffices: the new token overwrites the one ``W`` positions back, which nobody can
    see any more. ``pos`` may be an int or an integer array.
    """
    raise NotImplementedError("Exercise 2.4a (ring_slot): not started. Read its docstring; hints: python -m minillm.grade 2 --hint 2.4")


def ring_read(ring_k: np.ndarray, ring_v: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 2.4b — the ring's contents in position order.

    ``ring_k, ring_v: [kv_heads, window, head_dim]`` after ``seq_len`` tokens were written,
    position ``p`` in slot ``ring_slot(p, window)``. Return ``(k, v)``, each
    ``[kv_heads, min(seq_len, window), head_dim]``: the positions still held, oldest first.
    Attention over them with ``causal=True, window=window`` must equal the sliding-window
    attention of the full sequence.
    """
    raise NotImplementedError("Exercise 2.4b (ring_read): not started. Read its docstring; hints: python -m minillm.grade 2 --hint 2.4")


# ---------------------------------------------------------------------------------------------
# Triton kernels (Exercises 2.5 and 2.6): a batch of sequences, each at its own length.
# Caches are ``[batch, kv_heads, max_len, head_dim]`` (any strides, head_dim contiguous).
# ---------------------------------------------------------------------------------------------
@triton.jit
def cache_write_kernel(K_new, V_new, K_cache, V_cache, Pos,
                       stride_cb, stride_ch, stride_cn, kv_heads, head_dim,
                       BLOCK_D: tl.constexpr):
    """Exercise 2.5 — store one decode step's key and value rows into the cache.

    Program ``(b, h)`` copies ``k_new[b, h, :]`` to ``k_cache[b, h, Pos[b], :]`` and
    ``v_new[b, h, :]`` to ``v_cache[b, h, Pos[b], :]``.

    - ``K_new, V_new``: ``[batch, kv_heads, head_dim]``, contiguous;
    - ``K_cache, V_cache``: ``[batch, kv_heads, max_len, head_dim]`` with strides
      ``(stride_cb, stride_ch, stride_cn, 1)`` (the same for both caches; head_dim contiguous);
    - ``Pos``: ``[batch]`` int32, the slot of sequence ``b``'s new token. ``Pos[b] < 0`` marks
      a padding row (a finished sequence in the batch): write nothing for it.

    ``BLOCK_D`` is ``head_dim`` rounded up to a power of two: lanes ``d >= head_dim`` must not
    be read or written (a store there would land in the next slot). Every other element of
    the caches must stay as it was.
    """
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # int64: caches pass 2^31 elements
    d = tl.arange(0, BLOCK_D)
    pass  # your code: load Pos[b]; load the two rows of head_dim values; store them at slot Pos[b]


def cache_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                pos: torch.Tensor) -> None:
    """Exercise 2.5 (launcher, complete) — ``cache[b, :, pos[b]] = new[b]`` in place.

    ``k_cache, v_cache: [batch, kv_heads, max_len, head_dim]`` (equal strides, head_dim
    contiguous), ``k_new, v_new: [batch, kv_heads, head_dim]`` in the cache's dtype,
    ``pos: [batch]`` int32 (negative: skip that sequence).
    """
    raise NotImplementedError("Exercise 2.5 (cache_write_kernel): not started. Read its docstring; hints: python -m minillm.grade 2 --hint 2.5")
    batch, kv_heads, max_len, head_dim = k_cache.shape
    assert v_cache.stride() == k_cache.stride() and k_cache.stride(3) == 1, "equal strides, head_dim contiguous"
    k_new, v_new, pos = k_new.contiguous(), v_new.contiguous(), pos.to(torch.int32).contiguous()
    cache_write_kernel[(batch, kv_heads)](
        k_new, v_new, k_cache, v_cache, pos, *k_cache.stride()[:3], kv_heads, head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim))


@triton.jit
def decode_kernel(Q, K, V, SeqLens, O,
                  stride_kb, stride_kh, stride_kn, q_heads, group, head_dim, scale,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Exercise 2.6 — attention of one new token over its sequence's cache, one query head per program.

    Program ``(b, h)`` computes ``O[b, h, :] = softmax(scale · K q) V`` for the query
    ``Q[b, h, :]`` over the first ``SeqLens[b]`` slots of KV head ``h // group`` (GQA:
    ``group = q_heads // kv_heads`` consecutive query heads share a KV head).

    - ``Q, O``: ``[batch, q_heads, head_dim]``, contiguous (``O`` has Q's dtype);
    - ``K, V``: ``[batch, kv_heads, max_len, head_dim]`` with strides
      ``(stride_kb, stride_kh, stride_kn, 1)`` (the same for both);
    - ``SeqLens``: ``[batch]`` int32. Slots at or past ``SeqLens[b]`` may hold anything, even
      NaN: never let them into the result. ``SeqLens[b] = 0`` gives ``O[b, h] = 0``.

    ``BLOCK_N >= max_len`` (a power of two): the whole cache of a sequence is one tile, as in
    Exercise 1.5 (Chapter 3 lifts this limit). ``BLOCK_D``: ``head_dim`` rounded up to a power
    of two. One query row is a vector, not a matrix: ``tl.sum(q[None, :] * k, axis=1)``
    gives the scores. Compute in fp32.
    """
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    n = tl.arange(0, BLOCK_N)  # slot index
    d = tl.arange(0, BLOCK_D)
    pass  # your code: the KV head, q, the tile of K, scores, masked safe softmax, P·V, store


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Exercise 2.6 (launcher, complete) — ``q: [batch, q_heads, head_dim]``, caches
    ``[batch, kv_heads, max_len, head_dim]``, ``seq_lens: [batch]`` -> ``out: [batch, q_heads, head_dim]``."""
    raise NotImplementedError("Exercise 2.6 (decode_kernel): not started. Read its docstring; hints: python -m minillm.grade 2 --hint 2.6")
    batch, q_heads, head_dim = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    assert v_cache.stride() == k_cache.stride() and k_cache.stride(3) == 1, "equal strides, head_dim contiguous"
    q = q.contiguous()
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    decode_kernel[(batch, q_heads)](
        q, k_cache, v_cache, seq_lens.to(torch.int32).contiguous(), out, *k_cache.stride()[:3],
        q_heads, q_heads // kv_heads, head_dim, scale,
        BLOCK_N=triton.next_power_of_2(max_len), BLOCK_D=triton.next_power_of_2(head_dim))
    return out
