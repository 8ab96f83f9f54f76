"""Chapter 6: the block copies of copy-on-write, as one Triton kernel.

The notebook `chapters/06_cow_beam_prefix.ipynb` develops this kernel (section "The block
copy as a kernel"); this is the library's version, which the engine calls.

When a sequence appends a token to a block it shares with another sequence (after a fork:
parallel sampling, beam search), copy-on-write first gives it a private copy of that block:
`minillm.paged.BlockManager.append_slots` returns the ``(src, dst)`` pairs to copy, and the
copies must be done, **in every layer, for K and for V**, before the step writes its new
tokens into ``dst``. `minillm.paged.layout.copy_blocks` is the reference (NumPy or torch
indexing); `copy_blocks` here does all of a step's copies in one launch.

Layout: ``pool: [..., num_blocks, block_size, kv_heads, head_dim]``: any leading axes, e.g.
the engine's single tensor ``[2, layers, num_blocks, block_size, kv_heads, head_dim]``
(`minillm.model.paged.PagedKVCache`), or one layer's ``k_cache``. Every (leading index,
block) is one run of ``block_size · kv_heads · head_dim`` contiguous elements, so a copy is
a plain memcpy of that run; the leading axes are flattened into ``planes`` (2 × layers).

The kernel: program ``(pair, plane, chunk)`` copies ``BLOCK`` elements of block ``src`` of
one plane to block ``dst`` of the same plane. The copy is a byte copy: the pool is viewed
as integers of its element size, so every dtype works (bf16 and fp8 too, even under the
interpreter, which has no bf16) and NaN payloads are kept bit for bit.

Why the pairs need no ordering: programs run in any order and at the same time, so a
destination that is also a source would be read before or after it is written, depending
on timing. The block manager never asks for that (a copy's destination is a fresh block),
and the launcher checks it, as the reference does: destinations distinct, none of them a
source.
"""
from __future__ import annotations

import numpy as np
import torch

from minillm.kernels.base import power_of_2_at_least, tl, triton  # (no GPU: Triton's interpreter)

__all__ = ["copy_blocks", "check_pairs", "copy_block_size"]


@triton.jit
def _copy_blocks_kernel(Pool, Pairs, stride_plane, stride_block, block_elems, BLOCK: tl.constexpr):
    """Program ``(i, plane, chunk)``: elements ``chunk·BLOCK …`` of block ``Pairs[i, 0]`` of
    ``plane`` to the same elements of block ``Pairs[i, 1]``.

    ``Pool`` is viewed as ``[planes, num_blocks, block_elems]`` with strides ``stride_plane``,
    ``stride_block`` and 1; ``Pairs: [n, 2]`` int32 or int64, contiguous."""
    i = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_elems
    src = tl.load(Pairs + 2 * i).to(tl.int64)        # int64: block x block stride passes 2^31
    dst = tl.load(Pairs + 2 * i + 1).to(tl.int64)
    base = Pool + plane * stride_plane
    x = tl.load(base + src * stride_block + offs, mask=mask)
    tl.store(base + dst * stride_block + offs, x, mask=mask)


#: Elements one program copies at most: 4096 (8 KB in bf16) keeps enough loads in flight per
#: program and gives a 16-token block of 8 heads x 128 four programs per plane.
MAX_BLOCK = 4096


def copy_block_size(block_elems: int) -> int:
    """``BLOCK`` of the kernel: the block's elements rounded up to a power of two, at most
    `MAX_BLOCK` (a larger block is copied by several programs)."""
    return min(MAX_BLOCK, power_of_2_at_least(max(1, block_elems)))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_pairs(pairs, num_blocks: int) -> np.ndarray:
    """``pairs`` as an int64 ``[n, 2]`` array, checked: block ids in ``[0, num_blocks)``,
    destinations distinct, no destination also a source. Raises ``ValueError`` otherwise."""
    arr = np.asarray(pairs.cpu() if isinstance(pairs, torch.Tensor) else pairs, dtype=np.int64).reshape(-1, 2)
    if arr.size and (arr.min() < 0 or arr.max() >= num_blocks):
        raise ValueError(f"block ids must lie in [0, {num_blocks}), got {arr.tolist()}")
    src, dst = arr[:, 0], arr[:, 1]
    if len(np.unique(dst)) != len(dst) or np.intersect1d(src, dst).size:
        raise ValueError("copies must have distinct destinations, none of which is a source")
    return arr


def copy_blocks(pools, pairs) -> None:
    """Copy-on-write in place: ``block[dst] = block[src]`` for every ``(src, dst)`` pair, in
    every plane of every pool given.

    - ``pools``: a tensor ``[..., num_blocks, block_size, kv_heads, head_dim]`` (e.g. the
      engine's ``[2, layers, ...]`` pool, K and V of every layer at once), or a list/tuple
      of such tensors (e.g. ``(k_pool, v_pool)``: one launch each). Each block's
      ``[block_size, kv_heads, head_dim]`` must be contiguous and the leading axes must
      flatten into one (true of any contiguous pool and of its per-layer views).
    - ``pairs``: ``(src, dst)`` pairs (`AppendResult.copies`), an ``[n, 2]`` array, or a
      tensor. Checked on the host (`check_pairs`) unless it is already a CUDA tensor
      (checking that would wait for the GPU): then the caller vouches for it.
    """
    if isinstance(pools, (list, tuple)):
        for pool in pools:
            copy_blocks(pool, pairs)
        return
    pool = pools
    if pool.dim() < 4:
        raise ValueError(f"pool must be [..., num_blocks, block_size, kv_heads, head_dim], got {tuple(pool.shape)}")
    num_blocks = pool.shape[-4]
    if isinstance(pairs, torch.Tensor) and pairs.is_cuda:
        pairs_t = pairs.reshape(-1, 2)
    else:
        pairs_t = torch.from_numpy(check_pairs(pairs, num_blocks)).to(pool.device)
    if pairs_t.shape[0] == 0 or pool.numel() == 0:
        return
    block_elems = pool.shape[-3] * pool.shape[-2] * pool.shape[-1]
    try:
        flat = pool.view(_BITS[pool.element_size()]).view(-1, num_blocks, block_elems)
    except RuntimeError as exc:
        raise ValueError("each block of the pool must be contiguous and its leading axes flatten into one "
                         f"(shape {tuple(pool.shape)}, strides {pool.stride()})") from exc
    BLOCK = copy_block_size(block_elems)
    grid = (pairs_t.shape[0], flat.shape[0], triton.cdiv(block_elems, BLOCK))
    _copy_blocks_kernel[grid](flat, pairs_t.contiguous(), flat.stride(0), flat.stride(1), block_elems,
                              BLOCK=BLOCK, num_warps=4)
