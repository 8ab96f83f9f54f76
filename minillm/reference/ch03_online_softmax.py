"""Chapter 3 reference: the online softmax and FlashAttention-1's tiled attention, in NumPy.

Everything here is float64 and written to be read next to the chapter. The story in four steps:

1. **Safe softmax.** ``softmax(x) = exp(x - m) / Σ exp(x - m)`` with ``m = max(x)``: the
   shift cancels between numerator and denominator but keeps ``exp`` from overflowing
   (`naive_softmax` shows what happens without it).
2. **Running statistics.** A row can be summarised by two numbers, its max ``m`` and
   ``ℓ = Σ exp(x - m)`` (`softmax_stats`). The statistics of two pieces of a row combine
   into those of the whole row (`merge_stats`)::

       m = max(m₁, m₂)        ℓ = ℓ₁·exp(m₁ - m) + ℓ₂·exp(m₂ - m)

   so a row can be read block by block, keeping only ``(m, ℓ)`` (`online_softmax_update`).
   The merge is associative and commutative, with ``(m, ℓ) = (-∞, 0)`` (an empty or fully
   masked piece) as its identity: blocks can be combined in any grouping and order.
3. **Partial outputs.** Attention needs ``softmax(s) · V``, not the probabilities. The
   *normalised* output of a piece of the keys, ``o = softmax(s_piece) · V_piece``, merges
   with its statistics too (`merge_partials`): weight each partial output by its share of
   the total sum, ``ℓₖ·exp(mₖ - m) / ℓ``.
4. **Tiling.** `tiled_attention` is Algorithm 1 of the FlashAttention paper (Dao et al.
   2022): outer loop over blocks of K/V, inner loop over blocks of Q, with the running
   ``O, ℓ, m`` of every query row kept in (simulated) HBM between visits. `HBM` counts every
   element that moves, and `minillm.costs.fa1_traffic` is the closed form of that count.

Shapes follow `minillm.reference.ch01_naive_attention`: ``q: [batch, q_heads, q_len, head_dim]``,
``k, v: [batch, kv_heads, kv_len, head_dim]``, positions bottom-right aligned.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np

from minillm.reference.ch01_naive_attention import attention_mask, kv_head_for

#: The A100's on-chip memory per SM (L1 and shared memory together), the budget ``M`` of the
#: FlashAttention paper's worked example: 192 KB. (At most 164 KB of it can be shared memory
#: for one kernel; the paper's sizing is an order-of-magnitude argument.)
A100_SRAM_BYTES = 192 * 1024

__all__ = [
    "A100_SRAM_BYTES", "HBM", "fa1_block_sizes", "merge_partials", "merge_stats", "naive_softmax",
    "online_softmax", "online_softmax_trace", "online_softmax_update", "partial_attention", "softmax_stats",
    "tile_step", "tiled_attention",
]


# ----------------------------------------------------------------------------------------
# 1. Safe softmax
# ----------------------------------------------------------------------------------------
def naive_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """``exp(x) / Σ exp(x)`` exactly as the formula reads, **without** subtracting the max.

    Shown only to fail: ``exp`` overflows to ``inf`` past ``x ≈ 709`` in float64 (``≈ 88``
    in fp32, ``≈ 11`` in fp16), and ``inf / inf`` is NaN. `minillm.reference.softmax` is the
    safe version."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x)
        return e / np.sum(e, axis=axis, keepdims=True)


# ----------------------------------------------------------------------------------------
# 2. Running statistics (m, ℓ)
# ----------------------------------------------------------------------------------------
def _finite_or_zero(m: np.ndarray) -> np.ndarray:
    """The max to subtract: ``m``, or 0 where ``m = -inf`` (nothing visible), which avoids
    ``-inf - (-inf) = NaN``; every ``exp`` it feeds is then ``exp(-inf) = 0``, as it should be."""
    return np.where(np.isneginf(m), 0.0, m)


def softmax_stats(x: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """The statistics of ``x`` along ``axis``: ``(m, ℓ)`` with ``m = max(x)`` and
    ``ℓ = Σ exp(x - m)`` (so ``1 <= ℓ <= n`` for a row of ``n`` finite values).

    An empty or all ``-inf`` slice gives ``(-inf, 0)``: the identity of `merge_stats`. The
    log-sum-exp of the slice is ``m + log ℓ``."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, initial=-np.inf)
    l = np.sum(np.exp(x - np.expand_dims(_finite_or_zero(m), axis)), axis=axis)
    return m, l


def merge_stats(m1, l1, m2, l2) -> tuple[np.ndarray, np.ndarray]:
    """The statistics of the concatenation of two pieces from those of the pieces.

    Each ``ℓₖ`` was summed relative to its own max ``mₖ``; relative to the common max
    ``m = max(m₁, m₂)`` it becomes ``ℓₖ·exp(mₖ - m)`` (a factor ``<= 1``: nothing overflows)."""
    m = np.maximum(m1, m2)
    m_safe = _finite_or_zero(m)
    return m, l1 * np.exp(m1 - m_safe) + l2 * np.exp(m2 - m_safe)


def online_softmax_update(m, l, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One step of the online softmax: running ``(m, ℓ)`` of the rows seen so far
    (``[rows]``), a new ``block: [rows, B]`` of each row -> the updated ``(m, ℓ)``::

        m_new = max(m, max(block))
        ℓ_new = ℓ·exp(m - m_new) + Σ exp(block - m_new)

    The first factor *rescales* what was summed against the old max; on the first block
    ``(m, ℓ) = (-inf, 0)`` and it vanishes. This is `merge_stats` with the block's own stats."""
    block = np.asarray(block, dtype=np.float64)
    m_new = np.maximum(m, np.max(block, axis=-1, initial=-np.inf))
    m_safe = _finite_or_zero(m_new)
    return m_new, l * np.exp(m - m_safe) + np.sum(np.exp(block - m_safe[..., None]), axis=-1)


def online_softmax(x: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over the last axis of ``x: [..., n]`` the way `minillm.kernels.ch03_online_softmax`
    computes it: sweep 1 reads the row ``block_size`` elements at a time, keeping only
    ``(m, ℓ)``; sweep 2 reads it again and writes ``exp(x - m) / ℓ``.

    Returns ``(p, lse)``: ``p`` shaped like ``x``, ``lse = m + log ℓ`` shaped ``x.shape[:-1]``
    (``-inf`` and a row of zeros for an all ``-inf`` row)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    x = np.asarray(x, dtype=np.float64)
    m = np.full(x.shape[:-1], -np.inf)
    l = np.zeros(x.shape[:-1])
    for start in range(0, x.shape[-1], block_size):        # sweep 1: the statistics
        m, l = online_softmax_update(m, l, x[..., start:start + block_size])
    p = np.empty_like(x)
    m_safe = _finite_or_zero(m)[..., None]
    l_safe = np.where(l == 0, 1.0, l)[..., None]
    for start in range(0, x.shape[-1], block_size):        # sweep 2: the output
        p[..., start:start + block_size] = np.exp(x[..., start:start + block_size] - m_safe) / l_safe
    with np.errstate(divide="ignore"):
        return p, m + np.log(l)


def online_softmax_trace(x, block_size: int) -> list[dict]:
    """Sweep 1 of `online_softmax` on one row, step by step (for the chapter's worked
    example and its figure). One dict per block: ``block`` (its values), ``block_max`` and
    ``block_sum`` (its own statistics), ``rescale`` (``exp(m_old - m_new)``, the factor the
    running sum is multiplied by) and the running ``m`` and ``l`` after the block.

    ``online_softmax_trace([1, 2, 3, 4], 2)``: block ``[1, 2]`` gives ``m = 2``,
    ``ℓ = e⁻¹ + 1``; block ``[3, 4]`` raises the max to 4, so the old sum is rescaled by
    ``e⁻²`` and ``ℓ = e⁻³ + e⁻² + e⁻¹ + 1``, the sum of ``exp(x - 4)`` over the whole row."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"one row at a time: x has shape {x.shape}")
    m, l = -np.inf, 0.0
    steps = []
    for start in range(0, x.size, block_size):
        block = x[start:start + block_size]
        bm, bl = softmax_stats(block)
        m_new, l_new = online_softmax_update(np.float64(m), np.float64(l), block)
        rescale = float(np.exp(m - _finite_or_zero(m_new)))
        steps.append({"block": block.copy(), "block_max": float(bm), "block_sum": float(bl),
                      "rescale": rescale, "m": float(m_new), "l": float(l_new)})
        m, l = m_new, l_new
    return steps


# ----------------------------------------------------------------------------------------
# 3. Partial attention outputs
# ----------------------------------------------------------------------------------------
def partial_attention(scores: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Attention over one piece of the keys: ``scores: [..., n]`` (``-inf`` = hidden),
    ``v: [..., n, d]`` -> ``(m, ℓ, o)`` with ``(m, ℓ) = softmax_stats(scores)`` and
    ``o = softmax(scores) · v`` (normalised; zeros where nothing is visible)."""
    m, l = softmax_stats(scores)
    p = np.exp(np.asarray(scores, dtype=np.float64) - _finite_or_zero(m)[..., None])
    o = (p @ np.asarray(v, dtype=np.float64)) / np.where(l == 0, 1.0, l)[..., None]
    return m, l, o


def merge_partials(m1, l1, o1, m2, l2, o2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge the attention outputs of two disjoint pieces of the keys.

    ``m, l: [...]``, ``o: [..., d]`` as `partial_attention` returns them (``o`` normalised
    within its piece). The whole-row output is the average of the two, each weighted by its
    share of the total softmax sum::

        (m, ℓ) = merge_stats(m₁, ℓ₁, m₂, ℓ₂)
        o = (ℓ₁·exp(m₁ - m)·o₁ + ℓ₂·exp(m₂ - m)·o₂) / ℓ

    Like `merge_stats` it is associative and commutative with identity ``(-inf, 0, 0)``.
    FlashAttention-1 applies it once per tile; flash-decoding merges the outputs of splits."""
    m, l = merge_stats(m1, l1, m2, l2)
    m_safe = _finite_or_zero(m)
    w1 = (l1 * np.exp(m1 - m_safe))[..., None]
    w2 = (l2 * np.exp(m2 - m_safe))[..., None]
    return m, l, (w1 * o1 + w2 * o2) / np.where(l == 0, 1.0, l)[..., None]


# ----------------------------------------------------------------------------------------
# 4. FlashAttention-1: block sizes, one tile step, the loops, the traffic
# ----------------------------------------------------------------------------------------
def fa1_block_sizes(sram_bytes: int, head_dim: int, elem_bytes: int = 2) -> tuple[int, int]:
    """FlashAttention-1's block sizes ``(Br, Bc)`` for an on-chip budget of ``sram_bytes``.

    The paper states the budget ``M`` in **elements** ("words"), not bytes:
    ``Bc = ⌈M / 4d⌉`` and ``Br = min(⌈M / 4d⌉, d)``. So the bytes are first turned into
    elements of ``elem_bytes`` each, ``M = sram_bytes // elem_bytes``. The reasoning: the
    inner loop holds ``K_j, V_j`` (``Bc × d`` each) and ``Q_i, O_i`` (``Br × d`` each), at
    most ``4·Bc·d ≈ M`` elements since ``Br <= Bc``; ``Br <= d`` bounds the ``Br × Bc``
    score tile by ``d·Bc ≈ M/4`` as well.

    The A100 example: 192 KB and ``d = 64`` in fp16 give ``M = 98304`` elements,
    ``Bc = 384`` and ``Br = 64``. (Reading 192 KB as 192K *elements* would give
    ``Bc = 768``: twice the memory there is.)"""
    if sram_bytes <= 0 or head_dim <= 0 or elem_bytes <= 0:
        raise ValueError(f"need positive sizes, got sram_bytes={sram_bytes}, head_dim={head_dim}, "
                         f"elem_bytes={elem_bytes}")
    words = sram_bytes // elem_bytes
    block_kv = math.ceil(words / (4 * head_dim))
    return min(block_kv, head_dim), block_kv


class HBM:
    """A stand-in for GPU memory that counts what moves in and out of it.

    Arrays are stored under a name (``HBM(q=…, o=…)``); the algorithm may only touch them
    through `read` (HBM -> "SRAM": returns a copy) and `write` ("SRAM" -> HBM). ``reads``
    and ``writes`` count the elements moved per name; `bytes` turns them into bytes."""

    def __init__(self, **arrays: np.ndarray):
        self.arrays = dict(arrays)
        self.reads: Counter = Counter()
        self.writes: Counter = Counter()

    def read(self, name: str, index) -> np.ndarray:
        tile = np.array(self.arrays[name][index], copy=True)
        self.reads[name] += tile.size
        return tile

    def write(self, name: str, index, value) -> None:
        self.arrays[name][index] = value
        self.writes[name] += np.asarray(self.arrays[name][index]).size

    def bytes(self, elem_bytes: dict[str, int]) -> dict[str, dict[str, int]]:
        """``{name: {"read": bytes, "write": bytes}}`` with ``elem_bytes[name]`` bytes per element."""
        names = sorted(set(self.reads) | set(self.writes))
        return {n: {"read": self.reads[n] * elem_bytes[n], "write": self.writes[n] * elem_bytes[n]} for n in names}


def tile_step(q_i, k_j, v_j, o_i, l_i, m_i, scale: float, visible=None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lines 9-12 of FlashAttention-1's Algorithm 1: fold one K/V block into the running
    state of one Q block.

    ``q_i: [Br, d]``, ``k_j, v_j: [Bc, d]``, ``o_i: [Br, d]`` (normalised output so far),
    ``l_i, m_i: [Br]`` (statistics so far; ``(0, -inf)`` before the first block), ``visible``:
    bool ``[Br, Bc]`` or None (all visible). Returns the new ``(o_i, l_i, m_i)``::

        S = scale · q_i k_jᵀ                        (hidden entries -> -inf)
        m̃ = rowmax(S),  P̃ = exp(S - m̃),  ℓ̃ = rowsum(P̃)
        m_new = max(m_i, m̃),  ℓ_new = exp(m_i - m_new)·ℓ_i + exp(m̃ - m_new)·ℓ̃
        o_new = (ℓ_i·exp(m_i - m_new)·o_i + exp(m̃ - m_new)·P̃ v_j) / ℓ_new

    which is `merge_partials` of the state with the tile's `partial_attention`."""
    s = scale * (np.asarray(q_i, dtype=np.float64) @ np.asarray(k_j, dtype=np.float64).T)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    m_t, l_t = softmax_stats(s)                                  # m̃, ℓ̃
    p_t = np.exp(s - _finite_or_zero(m_t)[:, None])              # P̃
    m_new = np.maximum(m_i, m_t)
    m_safe = _finite_or_zero(m_new)
    alpha, beta = np.exp(m_i - m_safe), np.exp(m_t - m_safe)
    l_new = alpha * l_i + beta * l_t
    o_new = (l_i * alpha)[:, None] * o_i + beta[:, None] * (p_t @ np.asarray(v_j, dtype=np.float64))
    return o_new / np.where(l_new == 0, 1.0, l_new)[:, None], l_new, m_new


def tiled_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False, scale: float | None = None,
                    window: int | None = None, block_q: int | None = None, block_kv: int | None = None,
                    sram_bytes: int = A100_SRAM_BYTES, elem_bytes: int = 2, hbm: HBM | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Attention in FlashAttention-1's loop order; returns ``(out, lse)`` like
    `minillm.reference.ch01_naive_attention`.

    Block sizes: ``block_q`` (``Br``) and ``block_kv`` (``Bc``) if given, else
    `fa1_block_sizes` of ``sram_bytes`` (bytes; default the A100's 192 KB) for elements of
    ``elem_bytes``. For each ``(batch, query head)``, with ``O, ℓ, m`` living in HBM::

        for j over K/V blocks:                  # outer
            read K_j, V_j
            for i over Q blocks:                # inner
                read Q_i, and O_i, ℓ_i, m_i (except when j = 0: they are 0, 0, -inf)
                O_i, ℓ_i, m_i = tile_step(...)
                write O_i, ℓ_i, m_i (on the last j: write out_i and lse_i = m_i + log ℓ_i)

    Two small departures from the paper's Algorithm 1, both savings the kernel makes too:
    the initial ``O = 0, ℓ = 0, m = -inf`` are not written to HBM and read back, and the
    final rows go straight to ``out`` and ``lse`` (FlashAttention-2's single statistic)
    instead of ``O, ℓ, m``. Pass an `HBM` as ``hbm`` to get the traffic counted in it
    (arrays ``q, k, v, o, l, m, out, lse``); `minillm.costs.fa1_traffic` is the closed form.
    """
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    default_br, default_bc = fa1_block_sizes(sram_bytes, head_dim, elem_bytes)
    br, bc = block_q or default_br, block_kv or default_bc
    visible = attention_mask(q_len, kv_len, causal, window)

    mem = hbm if hbm is not None else HBM()
    mem.arrays.update(q=q, k=k, v=v,
                      o=np.full(q.shape, np.nan), l=np.full(q.shape[:3], np.nan), m=np.full(q.shape[:3], np.nan),
                      out=np.zeros(q.shape), lse=np.full(q.shape[:3], -np.inf))
    n_kv_blocks = math.ceil(kv_len / bc)
    for b in range(batch):
        for h in range(q_heads):
            kv_h = kv_head_for(h, q_heads, kv_heads)
            for j in range(n_kv_blocks):                                    # outer: K/V blocks
                cols = slice(j * bc, min((j + 1) * bc, kv_len))
                k_j, v_j = mem.read("k", (b, kv_h, cols)), mem.read("v", (b, kv_h, cols))
                first, last = j == 0, j == n_kv_blocks - 1
                for start in range(0, q_len, br):                           # inner: Q blocks
                    rows = slice(start, min(start + br, q_len))
                    q_i = mem.read("q", (b, h, rows))
                    if first:   # the initial state is known: no need to fetch it
                        n = rows.stop - rows.start
                        o_i, l_i, m_i = np.zeros((n, head_dim)), np.zeros(n), np.full(n, -np.inf)
                    else:
                        o_i, l_i, m_i = mem.read("o", (b, h, rows)), mem.read("l", (b, h, rows)), mem.read("m", (b, h, rows))
                    o_i, l_i, m_i = tile_step(q_i, k_j, v_j, o_i, l_i, m_i, scale, visible[rows, cols])
                    if last:
                        with np.errstate(divide="ignore"):
                            mem.write("out", (b, h, rows), o_i)
                            mem.write("lse", (b, h, rows), m_i + np.log(l_i))
                    else:
                        mem.write("o", (b, h, rows), o_i)
                        mem.write("l", (b, h, rows), l_i)
                        mem.write("m", (b, h, rows), m_i)
    return mem.arrays["out"], mem.arrays["lse"]
