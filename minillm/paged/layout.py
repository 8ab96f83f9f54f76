"""The arrays the kernels read, built from the block manager's lists, and CPU references of the
three memory operations on a paged pool (copy blocks, write slots, gather a sequence).

Layout (shared with the Triton kernels; see the `minillm.paged` package docstring):

- ``k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]`` per layer;
- slot ``s = block_id * block_size + offset`` is row ``s`` of the cache viewed as
  ``[num_blocks * block_size, kv_heads, head_dim]``;
- block tables: int32 ``[batch, max_blocks_per_seq]``, padded with ``-1``;
- slot mappings: int64, ``-1`` for a padding token (nothing is written for it).

The functions accept NumPy arrays or torch tensors alike (indexing works the same on both);
the builders return NumPy unless given a torch ``device``.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

__all__ = ["PAD", "padded_block_tables", "padded_slot_mapping", "flat_slot_mapping", "copy_blocks",
           "write_slots", "gather_slots"]

PAD = -1  # the padding value of block tables and slot mappings


def _to(array: np.ndarray, device):
    if device is None:
        return array
    import torch  # only when asked: the bookkeeping itself needs no torch

    return torch.from_numpy(array).to(device)


def padded_block_tables(tables: Sequence[Sequence[int]], max_blocks: int | None = None, *, device=None):
    """Stack block tables into an int32 ``[batch, max_blocks]`` array padded with ``-1``.

    Args:
        tables: one list of block ids per sequence (`BlockManager.block_table`).
        max_blocks: columns; defaults to the longest table. A fixed width (``max_model_len /
            block_size``, rounded up) keeps the kernel from recompiling as sequences grow.
        device: ``None`` for a NumPy array, else a torch device for a tensor.
    """
    lengths = np.fromiter(map(len, tables), count=len(tables), dtype=np.intp)
    longest = int(lengths.max()) if len(tables) else 0
    width = longest if max_blocks is None else max_blocks
    if longest > width:
        raise ValueError(f"a block table has {longest} blocks, more than max_blocks={width}")
    out = np.full((len(tables), width), PAD, dtype=np.int32)
    # One fill for all rows (the engine builds this every step): the mask's True entries, in
    # row-major order, are each row's first len(table) columns.
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    out[np.arange(width) < lengths[:, None]] = flat
    return _to(out, device)


def padded_slot_mapping(slots: Sequence[Sequence[int]], max_len: int | None = None, *, device=None):
    """Stack per-sequence slot lists into an int64 ``[batch, max_len]`` array padded with ``-1``.

    For a padded batch layout: row ``b`` holds the slots of sequence ``b``'s new tokens, and a
    ``-1`` marks a padding token whose K and V must not be written.
    """
    width = max((len(s) for s in slots), default=0) if max_len is None else max_len
    if any(len(s) > width for s in slots):
        raise ValueError(f"a slot list has {max(len(s) for s in slots)} entries, more than max_len={width}")
    out = np.full((len(slots), width), PAD, dtype=np.int64)
    for row, s in zip(out, slots):
        row[:len(s)] = s
    return _to(out, device)


def flat_slot_mapping(slots: Sequence[Sequence[int]], *, device=None):
    """Concatenate per-sequence slot lists into one int64 ``[total_tokens]`` array, for the
    packed (varlen) layout where the new tokens of the batch are laid end to end."""
    parts = [np.asarray(s, dtype=np.int64) for s in slots]
    return _to(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64), device)


def copy_blocks(caches, copies) -> None:
    """Perform copy-on-write copies in place: ``cache[dst] = cache[src]`` for every pair.

    Args:
        caches: arrays (or tensors) whose first axis is the block: ``[num_blocks, ...]``,
            e.g. every layer's ``k_cache`` and ``v_cache``.
        copies: ``(src, dst)`` pairs (`AppendResult.copies`), or an ``[n, 2]`` array.
    """
    pairs = np.asarray(copies, dtype=np.int64).reshape(-1, 2)
    if len(pairs) == 0:
        return
    src, dst = pairs[:, 0], pairs[:, 1]
    if len(set(dst.tolist())) != len(dst) or set(src.tolist()) & set(dst.tolist()):
        raise ValueError("copies must have distinct destinations, none of which is a source")
    for cache in caches:
        # The right-hand side gathers a copy first, so the batch reads only old contents.
        cache[_index(dst, cache)] = cache[_index(src, cache)]


def write_slots(cache, slots, values) -> None:
    """Write ``values[i]`` into slot ``slots[i]`` of ``cache``, skipping ``-1`` (padding).

    Args:
        cache: ``[num_blocks, block_size, ...]``, contiguous (it is viewed as
            ``[num_blocks * block_size, ...]``).
        slots: ``[n]`` slot indices.
        values: ``[n, ...]`` (e.g. ``[n, kv_heads, head_dim]``).
    """
    flat = cache.reshape(-1, *cache.shape[2:])
    if not _shares_memory(flat, cache):  # reshape copied: writes would be lost
        raise ValueError("write_slots needs a contiguous cache (the flat view must alias it)")
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    keep = slots != PAD
    if np.any(keep):
        flat[_index(slots[keep], cache)] = values[_index(np.flatnonzero(keep), cache)]


def gather_slots(cache, block_table: Sequence[int], num_tokens: int):
    """Read a sequence's first ``num_tokens`` entries through its block table:
    ``[num_tokens, ...]``, position ``p`` from block ``block_table[p // block_size]``."""
    block_size = cache.shape[1]
    table = np.asarray(block_table, dtype=np.int64)
    pos = np.arange(num_tokens)
    if num_tokens > len(table) * block_size:
        raise ValueError(f"{num_tokens} tokens need more than the table's {len(table)} blocks of {block_size}")
    blocks = table[pos // block_size]
    if np.any(blocks < 0):  # a padding entry: NumPy would silently read from the end of the pool
        raise ValueError(f"a position below num_tokens={num_tokens} falls into a padding ({PAD}) entry")
    slots = blocks * block_size + pos % block_size
    return cache.reshape(-1, *cache.shape[2:])[_index(slots, cache)]


def _index(idx: np.ndarray, like):
    """``idx`` as an index for ``like``: a torch tensor on its device, or the NumPy array."""
    if isinstance(like, np.ndarray):
        return idx
    import torch

    return torch.as_tensor(idx, device=like.device)


def _shares_memory(view, base) -> bool:
    if isinstance(base, np.ndarray):
        return np.shares_memory(view, base)
    return view.data_ptr() == base.data_ptr()
