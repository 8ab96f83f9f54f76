"""Chapter 1 exercises: naive attention. Grade your work with ``make grade CH=1``.

Replace each ``raise NotImplementedError(...)`` with your implementation. Tests compare your
functions with the float64 reference in ``minillm.reference`` on fresh random inputs.
Exercise 1.5 is a Triton kernel: write the body of its ``@triton.jit`` function, then delete
the ``raise`` at the top of its launcher.
"""
from __future__ import annotations

import numpy as np
import torch

from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)


def safe_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Exercise 1.1 — softmax along ``axis`` that never overflows.

    ``x``: any shape, float. Returns an array of the same shape whose slices along ``axis``
    are non-negative and sum to 1. A slice that is entirely ``-inf`` (every key masked) must
    come out as all zeros, not NaN.
    """
    raise NotImplementedError("Exercise 1.1 (safe_softmax): not started. Read its docstring; hints: python -m minillm.grade 1 --hint 1.1")


def attention_mask(q_len: int, kv_len: int, causal: bool = False, window: int | None = None) -> np.ndarray:
    """Exercise 1.2 — which keys each query may see: bool ``[q_len, kv_len]``, True = visible.

    Queries are bottom-right aligned: query ``i`` is at position ``kv_len - q_len + i``.
    ``causal``: key ``j`` visible iff ``j <= position``. ``window=W``: visible only iff
    ``|position - j| < W``. Both may be combined.
    """
    raise NotImplementedError("Exercise 1.2 (attention_mask): not started. Read its docstring; hints: python -m minillm.grade 1 --hint 1.2")


def kv_head_for(q_head: int, q_heads: int, kv_heads: int) -> int:
    """Exercise 1.3 — GQA head mapping: the KV head that query head ``q_head`` reads.

    ``q_heads`` query heads share ``kv_heads`` KV heads in consecutive groups of
    ``q_heads // kv_heads`` (MHA: one each; MQA: all share head 0). Raise ``ValueError`` if
    ``q_heads`` is not a multiple of ``kv_heads``.
    """
    raise NotImplementedError("Exercise 1.3 (kv_head_for): not started. Read its docstring; hints: python -m minillm.grade 1 --hint 1.3")


def attention_scores(q: torch.Tensor, k: torch.Tensor, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Exercise 1.4 — the scores pass as a Triton kernel.

    ``q: [batch, heads, q_len, head_dim]``, ``k: [batch, heads, kv_len, head_dim]`` (same
    number of heads; contiguous; fp32 or fp16; ``head_dim`` a power of two >= 16).
    Returns ``S: [batch, heads, q_len, kv_len]`` float32 with ``S = scale · q kᵀ``
    (default scale ``1/sqrt(head_dim)``) and ``-inf`` where the causal mask (bottom-right
    aligned) hides a key. Must run under ``TRITON_INTERPRET=1`` on CPU and on a GPU.
    """
    raise NotImplementedError("Exercise 1.4 (attention_scores): not started. Read its docstring; hints: python -m minillm.grade 1 --hint 1.4")


@triton.jit
def softmax_kernel(S, P, n_cols, stride_row, BLOCK_N: tl.constexpr):
    """Exercise 1.5 — softmax of one row of scores per program, the whole row in one tile.

    Program ``r`` reads row ``r`` of ``S`` (``n_cols`` scores starting at ``S + r·stride_row``,
    ``-inf`` where a key is masked; fp32 or fp16) and writes ``softmax`` of it, in fp32, to the
    same place in ``P``. ``BLOCK_N`` is ``n_cols`` rounded up to a power of two, so the row
    fits one tile: the lanes ``n_cols … BLOCK_N-1`` lie past the row's end and must neither
    be read nor written (load them as a value that adds nothing to the softmax). Compute in
    fp32 and never overflow (scores may be in the thousands). A row that is entirely ``-inf``
    (every key masked) must come out as zeros, not NaN.
    """
    row = tl.program_id(0).to(tl.int64)  # int64: row x stride can pass 2^31 for long rows
    cols = tl.arange(0, BLOCK_N)
    pass  # your code: load the row (masked), its max, exp, sum, divide, store (masked)


def row_softmax(s: torch.Tensor) -> torch.Tensor:
    """Exercise 1.5 (launcher, complete) — softmax over the last axis of ``s: [..., n]``.

    Returns ``P`` shaped like ``s``, float32. One program per row of the flattened
    ``[rows, n]`` matrix.
    """
    raise NotImplementedError("Exercise 1.5 (softmax_kernel): not started. Read its docstring; hints: python -m minillm.grade 1 --hint 1.5")
    s = s.contiguous()
    n_cols = s.shape[-1]
    p = torch.empty(s.shape, device=s.device, dtype=torch.float32)
    rows = s.numel() // n_cols
    if rows:
        softmax_kernel[(rows,)](s, p, n_cols, n_cols, BLOCK_N=triton.next_power_of_2(n_cols))
    return p
