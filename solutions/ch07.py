"""Chapter 7 solutions. Try the exercises in ``exercises/ch07.py`` first."""
from __future__ import annotations

import math

import numpy as np
import torch

# First, before Triton: without a GPU, this selects Triton's interpreter.
from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)


def merge_splits(o: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 7.1: weights relative to the largest lse; empty splits contribute nothing."""
    o = np.asarray(o, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    m = lse.max(axis=-1)
    m_safe = np.where(np.isneginf(m), 0.0, m)           # all empty: subtract 0, every weight e^{-inf} = 0
    w = np.exp(lse - m_safe[..., None])                 # [..., S], in [0, 1]
    empty = np.isneginf(lse)[..., None]
    w_sum = w.sum(axis=-1)
    out = (w[..., None] * np.where(empty, 0.0, o)).sum(axis=-2) / np.where(w_sum == 0, 1.0, w_sum)[..., None]
    with np.errstate(divide="ignore"):
        return out, m_safe + np.log(w_sum)


def fa2_num_splits(batch_heads: int, n_blocks: int, num_sms: int, max_splits: int = 128) -> int:
    """Exercise 7.2: FlashAttention-2's wave-efficiency rule, in the C++'s single precision."""
    f32 = np.float32
    if f32(batch_heads) >= f32(0.8) * f32(num_sms):
        return 1
    cap = min(max_splits, num_sms, n_blocks)

    def blocks_per_split(s: int) -> int:
        return -(-n_blocks // s)

    efficiency = {}
    for s in range(1, cap + 1):
        if s == 1 or blocks_per_split(s) != blocks_per_split(s - 1):
            waves = f32(batch_heads * s) / f32(num_sms)
            efficiency[s] = waves / f32(math.ceil(waves))
    if not efficiency:
        return 1
    best = max(efficiency.values())
    return next(s for s, eff in efficiency.items() if float(eff) >= 0.85 * float(best))


def split_partial(q: np.ndarray, k, v, seq_len: int, start: int, end: int, block_n: int,
                  scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 7.3: the online softmax over the split's tiles, one slice of K and V each."""
    q = np.asarray(q, dtype=np.float64)
    rows, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    stop = min(end, seq_len)
    m = np.full(rows, -np.inf)
    l = np.zeros(rows)
    acc = np.zeros((rows, head_dim))
    for a in range(start, stop, block_n):
        b = min(a + block_n, stop)                        # the ragged last tile
        x = scale * q @ np.asarray(k[a:b], dtype=np.float64).T
        m_new = np.maximum(m, x.max(axis=1))
        alpha = np.exp(m - m_new)                         # 0 on the first tile (m = -inf, m_new finite)
        p = np.exp(x - m_new[:, None])
        l = alpha * l + p.sum(axis=1)
        acc = alpha[:, None] * acc + p @ np.asarray(v[a:b], dtype=np.float64)
        m = m_new
    if stop <= start:
        return np.zeros((rows, head_dim)), np.full(rows, -np.inf)
    return acc / l[:, None], m + np.log(l)


# == Exercise 7.4: the split kernel (stage 1) ====================================================

@triton.jit
def _split_kernel(Q, K, V, SeqLens, O_part, LSE_part,
                  q_heads, group, num_splits, stride_kb, stride_kh, scale,
                  HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Program ``(b, kv_h, s)``: split ``s`` of sequence ``b`` for the heads of KV head ``kv_h``."""
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    s = tl.program_id(2)
    rows = tl.arange(0, GROUP_PAD)
    in_group = rows < group
    heads = kv_h * group + tl.minimum(rows, group - 1)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (b * q_heads + heads[:, None]) * HEAD_DIM + offs_d[None, :], mask=in_group[:, None], other=0.0)

    # This split's keys: whole tiles, ceil(tiles / num_splits) of them per split.
    seq_len = tl.load(SeqLens + b)
    span = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits) * BLOCK_N
    lo = s * span
    hi = tl.minimum(lo + span, seq_len)

    k_head = K + b * stride_kb + kv_h * stride_kh
    v_head = V + b * stride_kb + kv_h * stride_kh
    m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        k = tl.load(k_head + pos[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_head + pos[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
        if IEEE:
            x = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            x = tl.dot(q, tl.trans(k)) * scale
        x = tl.where(ok[None, :], x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(x - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    # The split's partial result: normalised over its own keys. Empty: o = 0, lse = -inf.
    o = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    part = (b * q_heads + heads) * num_splits + s                      # [GROUP_PAD] rows of the workspace
    tl.store(O_part + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=in_group[:, None])
    tl.store(LSE_part + part, m + tl.log(l), mask=in_group)


def flash_decode_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, num_splits: int,
                       block_n: int = 16, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 7.4: one program per (sequence, KV head, split)."""
    batch, q_heads, head_dim = q.shape
    _, kv_heads, max_len, _ = k.shape
    q, k, v, seq_lens = q.contiguous(), k.contiguous(), v.contiguous(), seq_lens.contiguous()
    o_part = torch.empty(batch, q_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(batch, q_heads, num_splits, device=q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = q_heads // kv_heads
    _split_kernel[(batch, kv_heads, num_splits)](
        q, k, v, seq_lens, o_part, lse_part, q_heads, group, num_splits, k.stride(0), k.stride(1), scale,
        HEAD_DIM=head_dim, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32)
    return o_part, lse_part


# == Exercise 7.5: the merge kernel (stage 2) =====================================================

@triton.jit
def _merge_kernel(O_part, LSE_part, Out, LSE, num_splits, HEAD_DIM: tl.constexpr, S_PAD: tl.constexpr):
    """Program ``r``: merge the ``num_splits`` partials of row ``r`` (a (sequence, head) pair)."""
    r = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(LSE_part + r * num_splits + splits, mask=splits < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)          # every split empty: no -inf - -inf
    w = tl.exp(lse - m)                                 # [S_PAD], 0 for empty splits
    o = tl.load(O_part + (r * num_splits + splits[:, None]) * HEAD_DIM + offs_d[None, :],
                mask=(splits < num_splits)[:, None], other=0.0)
    o = tl.where(w[:, None] > 0, o, 0.0)                # an empty split's o may be anything (NaN)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + r * HEAD_DIM + offs_d, out.to(Out.dtype.element_ty))
    tl.store(LSE + r, m + tl.log(total))


def merge_partials(o_part: torch.Tensor, lse_part: torch.Tensor, out_dtype: torch.dtype = torch.float32
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 7.5: one program per (sequence, head)."""
    *lead, num_splits, head_dim = o_part.shape
    o_part, lse_part = o_part.contiguous(), lse_part.contiguous()
    out = torch.empty(*lead, head_dim, device=o_part.device, dtype=out_dtype)
    lse = torch.empty(*lead, device=o_part.device, dtype=torch.float32)
    rows = math.prod(lead)
    if rows:
        _merge_kernel[(rows,)](o_part, lse_part, out, lse, num_splits, HEAD_DIM=head_dim,
                               S_PAD=triton.next_power_of_2(num_splits))
    return out, lse


def plan_splits(batch: int, kv_heads: int, max_seq_len: int, programs: int, block_n: int,
                max_splits: int = 128) -> int:
    """Exercise 7.6: the most splits that keep one unit per program, then the fewest as long."""
    tiles = -(-max(0, max_seq_len) // block_n)
    most = max(1, min(max_splits, tiles, programs // max(1, batch * kv_heads)))
    per_unit = -(-tiles // most)
    return next(s for s in range(1, most + 1) if -(-tiles // s) == per_unit)


def work_line_pieces(seq_lens, kv_heads: int, programs: int, box: int,
                     capacity: int | None = None) -> list[list[tuple]]:
    """Exercise 7.7: each program walks its chunk of the line, unit by unit, as the kernel does."""
    lens = [max(int(n), 0) if capacity is None else min(max(int(n), 0), capacity) for n in seq_lens]
    boxes = [max(-(-n // box), 1) for n in lens]
    starts = np.concatenate([[0], np.cumsum(boxes)]) * kv_heads     # where each sequence's units begin
    line = int(starts[-1])
    chunk = max(1, -(-line // programs))
    out = []
    for p in range(programs):
        pos, end, pieces = p * chunk, min((p + 1) * chunk, line), []
        while pos < end:
            b = int(np.searchsorted(starts, pos, side="right")) - 1  # the sequence whose units hold pos
            h = (pos - int(starts[b])) // boxes[b]
            unit_start = int(starts[b]) + h * boxes[b]
            unit_end = unit_start + boxes[b]
            piece_end = min(unit_end, end)
            first, last = unit_start // chunk, (unit_end - 1) // chunk
            pieces.append((b, h, min((pos - unit_start) * box, lens[b]), min((piece_end - unit_start) * box, lens[b]),
                           p - first, last - first + 1))
            pos = piece_end
        out.append(pieces)
    return out


def claimed_tiles(n_tiles: int, tile_times, claim_first: int) -> tuple[list[list[int]], list[int]]:
    """Exercise 7.8: an event queue of claims, ordered by (time, program)."""
    import heapq

    S, F = len(tile_times), claim_first
    tiles, finish, queue = [[] for _ in range(S)], [0] * S, []
    for p in range(S):
        for k in range(F):
            if p * F + k >= n_tiles:
                break                      # an own tile past the unit: this program never claims
            tiles[p].append(p * F + k)
            finish[p] += tile_times[p]
        else:
            heapq.heappush(queue, (finish[p], p))
    next_tile = S * F
    while queue:
        now, p = heapq.heappop(queue)
        tile, next_tile = next_tile, next_tile + 1
        if tile >= n_tiles:
            continue                       # past the unit: the program is done
        tiles[p].append(tile)
        finish[p] = now + tile_times[p]
        heapq.heappush(queue, (finish[p], p))
    return tiles, finish
