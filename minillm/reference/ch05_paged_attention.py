"""Chapter 5: attention over a paged KV cache, in NumPy (float64): the oracle of the kernels in
`minillm.kernels.ch05_paged_attention`.

A paged cache stores each sequence's keys and values in fixed-size blocks scattered over one
pool, ``k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]`` (the layout contract of
`minillm.paged`). A sequence's block table lists its blocks in order, so token ``p`` lives in

    slot = block_table[p // block_size] * block_size + p % block_size,

row ``slot`` of the pool viewed as ``[num_blocks * block_size, kv_heads, head_dim]``
(`paged_kv_addresses`). Attention itself does not change: gather a sequence's K and V through
its table (`minillm.paged.gather_slots`) and you have the contiguous ``[kv_len, kv_heads,
head_dim]`` arrays of the earlier chapters, on which `minillm.reference.ch01_naive_attention` runs as
before. That is all these references do; the kernels do the same gathering one tile of keys
at a time, without ever materialising the contiguous copy.

Positions are bottom-right aligned, as everywhere in the book: sequence ``b`` holds
``seq_lens[b]`` tokens in the cache (its cached prefix *and* the new tokens, whose K and V
have already been written there), and its ``q_len`` new queries sit at positions
``seq_lens[b] - q_len … seq_lens[b] - 1``. A decode step is the case ``q_len = 1``.
"""
from __future__ import annotations

import numpy as np

from minillm.paged.layout import PAD, gather_slots
from minillm.reference.ch01_naive_attention import attention

__all__ = ["paged_kv_addresses", "gather_paged_kv", "paged_decode_attention", "paged_prefill_attention"]


def paged_kv_addresses(block_table_row, positions, block_size: int) -> np.ndarray:
    """The cache slots of token positions of one sequence: the address computation of the kernels.

    Args:
        block_table_row: ``[max_blocks]`` block ids of one sequence, in order, padded with
            ``-1`` past its last block.
        positions: ``[n]`` token positions (``0 <= p``), in any order.
        block_size: tokens per block.

    Returns ``[n]`` int64 slots, ``block_table_row[p // block_size] * block_size + p %
    block_size``. Raises ``ValueError`` if a position falls past the table or into a padding
    (``-1``) entry: such a position holds no token, and reading it would read someone else's
    block (or memory before the pool).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    table = np.asarray(block_table_row, dtype=np.int64).reshape(-1)
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    if np.any(pos < 0):
        raise ValueError("positions must be >= 0")
    logical = pos // block_size  # which entry of the table: the sequence's logical block
    if np.any(logical >= len(table)):
        raise ValueError(f"position {int(pos.max())} is past the block table ({len(table)} blocks of {block_size})")
    physical = table[logical]  # where that block lives in the pool
    if np.any(physical < 0):
        raise ValueError(f"a position falls into a padding ({PAD}) entry of the block table")
    return physical * block_size + pos % block_size


def gather_paged_kv(k_cache, v_cache, block_table_row, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``num_tokens`` keys and values of one sequence, gathered through its table:
    ``(k, v)`` float64, each ``[kv_heads, num_tokens, head_dim]`` (the per-sequence layout of
    `minillm.reference.ch01_naive_attention`). Checks the addresses first (`paged_kv_addresses`), then
    reads with `minillm.paged.gather_slots`."""
    k_cache = np.asarray(k_cache, dtype=np.float64)
    v_cache = np.asarray(v_cache, dtype=np.float64)
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must both be "
                         "[num_blocks, block_size, kv_heads, head_dim]")
    slots = paged_kv_addresses(block_table_row, np.arange(num_tokens), k_cache.shape[1])
    if slots.size and slots.max() >= k_cache.shape[0] * k_cache.shape[1]:
        raise ValueError(f"block id past the pool of {k_cache.shape[0]} blocks")
    k = gather_slots(k_cache, block_table_row, num_tokens)  # [num_tokens, kv_heads, head_dim]
    v = gather_slots(v_cache, block_table_row, num_tokens)
    return k.transpose(1, 0, 2), v.transpose(1, 0, 2)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float | None = None):
    """One new query per sequence attending to its whole paged cache.

    Args:
        q: ``[batch, q_heads, head_dim]``, the query of each sequence's newest token.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``, with
            ``q_heads % kv_heads == 0`` (query head ``h`` reads KV head
            ``h // (q_heads // kv_heads)``).
        block_tables: ``[batch, max_blocks]`` block ids, ``-1`` past each sequence's blocks.
        seq_lens: ``[batch]`` tokens in each sequence's cache (the new token's K/V included).
        scale: defaults to ``1/sqrt(head_dim)``.

    Returns ``(out [batch, q_heads, head_dim], lse [batch, q_heads])`` float64; a sequence of
    length 0 gives ``out = 0`` and ``lse = -inf`` (a row with no visible key).
    """
    q = np.asarray(q, dtype=np.float64)
    batch, q_heads, head_dim = q.shape
    out = np.zeros((batch, q_heads, head_dim))
    lse = np.full((batch, q_heads), -np.inf)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        k, v = gather_paged_kv(k_cache, v_cache, block_tables[b], n)
        o, l = attention(q[b][None, :, None], k[None], v[None], scale=scale)  # q_len 1: sees every key
        out[b], lse[b] = o[0, :, 0], l[0, :, 0]
    return out, lse


def paged_prefill_attention(q, cu_seqlens_q, k_cache, v_cache, block_tables, seq_lens, causal: bool = True,
                            scale: float | None = None):
    """New tokens of each sequence attending to its cached prefix and to themselves.

    Args:
        q: ``[total_q, q_heads, head_dim]``, the new tokens of every sequence back to back
            (the packed "varlen" layout of `minillm.kernels.ch04_flash_attention.flash_attention_varlen`).
        cu_seqlens_q: ``[batch + 1]`` prefix sums of the new-token counts: sequence ``b``'s
            queries are rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``.
        k_cache, v_cache, block_tables: as in `paged_decode_attention`.
        seq_lens: ``[batch]`` tokens in each sequence's cache *including* its new ones
            (cached prefix + ``q_len``): their K/V are already written.
        causal: query ``i`` of sequence ``b`` sits at position ``seq_lens[b] - q_len_b + i``
            (bottom-right alignment) and, if causal, sees the keys up to that position.

    Returns ``(out [total_q, q_heads, head_dim], lse [q_heads, total_q])`` float64: the lse is
    head-major, the layout `flash_attention_varlen` returns (``-inf`` for a row that sees no
    key, whose output is 0).
    """
    q = np.asarray(q, dtype=np.float64)
    total_q, q_heads, head_dim = q.shape
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    out = np.zeros((total_q, q_heads, head_dim))
    lse = np.full((q_heads, total_q), -np.inf)
    for b in range(len(cu) - 1):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        n = int(seq_lens[b])
        if q1 == q0:
            continue
        if n == 0:  # nothing cached, not even the queries' own keys: nothing to see
            continue
        k, v = gather_paged_kv(k_cache, v_cache, block_tables[b], n)
        qb = q[q0:q1].transpose(1, 0, 2)[None]  # [1, q_heads, q_len, head_dim]
        o, l = attention(qb, k[None], v[None], causal=causal, scale=scale)
        out[q0:q1] = o[0].transpose(1, 0, 2)
        lse[:, q0:q1] = l[0]
    return out, lse
