"""Chapter 1 exercises: naive attention. Grade your work with ``make grade CH=1``.

Replace each ``raise NotImplementedError(...)`` with your implementation. Tests compare your
functions with the float64 reference in ``minillm.reference`` on fresh random inputs.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from minillm.kernels.base import interpreting  # noqa: F401  (also: no GPU -> the interpreter)


def safe_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Exercise 1.1 — softmax along ``axis`` that never overflows.

    ``x``: any shape, float. Returns an array of the same shape whose slices along ``axis``
    are non-negative and sum to 1. A slice that is entirely ``-inf`` (every key masked) must
    come out as all zeros, not NaN.
    """
    raise NotImplementedError(
        "Exercise 1.1 (safe_softmax): subtract the max along `axis` before np.exp (keepdims=True); "
        "treat a max of -inf as 0 and a zero sum as 'all zeros' so fully masked rows don't give NaN."
    )


def attention_mask(q_len: int, kv_len: int, causal: bool = False, window: int | None = None) -> np.ndarray:
    """Exercise 1.2 — which keys each query may see: bool ``[q_len, kv_len]``, True = visible.

    Queries are bottom-right aligned: query ``i`` is at position ``kv_len - q_len + i``.
    ``causal``: key ``j`` visible iff ``j <= position``. ``window=W``: visible only iff
    ``|position - j| < W``. Both may be combined.
    """
    raise NotImplementedError(
        "Exercise 1.2 (attention_mask): build column vectors of query positions "
        "(np.arange(q_len)[:, None] + kv_len - q_len) and row vectors of key positions, then "
        "combine the causal and window conditions with broadcasting and &."
    )


def kv_head_for(q_head: int, q_heads: int, kv_heads: int) -> int:
    """Exercise 1.3 — GQA head mapping: the KV head that query head ``q_head`` reads.

    ``q_heads`` query heads share ``kv_heads`` KV heads in consecutive groups of
    ``q_heads // kv_heads`` (MHA: one each; MQA: all share head 0). Raise ``ValueError`` if
    ``q_heads`` is not a multiple of ``kv_heads``.
    """
    raise NotImplementedError(
        "Exercise 1.3 (kv_head_for): the group size is q_heads // kv_heads; integer-divide the "
        "query head by it. Check q_heads % kv_heads first and raise ValueError."
    )


def attention_scores(q: torch.Tensor, k: torch.Tensor, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Exercise 1.4 — the scores pass as a Triton kernel.

    ``q: [batch, heads, q_len, head_dim]``, ``k: [batch, heads, kv_len, head_dim]`` (same
    number of heads; contiguous; fp32 or fp16; ``head_dim`` a power of two >= 16).
    Returns ``S: [batch, heads, q_len, kv_len]`` float32 with ``S = scale · q kᵀ``
    (default scale ``1/sqrt(head_dim)``) and ``-inf`` where the causal mask (bottom-right
    aligned) hides a key. Must run under ``TRITON_INTERPRET=1`` on CPU and on a GPU.
    """
    raise NotImplementedError(
        "Exercise 1.4 (attention_scores): write a @triton.jit kernel with a 3-D grid "
        "(q tiles, kv tiles, batch*heads); each program loads a [BLOCK_M, D] tile of q and a "
        "[BLOCK_N, D] tile of k (masked at the tails), computes tl.dot(q, tl.trans(k)) "
        "(input_precision='ieee' for fp32), scales, applies the causal mask with tl.where, and "
        "stores a masked [BLOCK_M, BLOCK_N] tile of S. See minillm/kernels/naive_attention.py."
    )
