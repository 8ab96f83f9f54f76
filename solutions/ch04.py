"""Chapter 4 solutions. Try the exercises in ``exercises/ch04.py`` first."""
from __future__ import annotations

import math

import numpy as np
import torch

from minillm.kernels.base import num_sms, tl, triton  # Triton as this machine runs it (no GPU: the interpreter)

SKIP, MASKED, FULL = 0, 1, 2


def _safe(m: np.ndarray) -> np.ndarray:
    """The max to subtract: 0 where nothing is visible (m = -inf), so -inf - (-inf) never happens."""
    return np.where(np.isneginf(m), 0.0, m)


def fa2_tile_step(q_i: np.ndarray, k_j: np.ndarray, v_j: np.ndarray, acc: np.ndarray, l: np.ndarray,
                  m: np.ndarray, scale: float, visible: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exercise 4.1: raise the max, shrink the old state to it, add the tile; no division."""
    s = scale * (q_i @ k_j.T)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    m_new = np.maximum(m, np.max(s, axis=-1, initial=-np.inf))
    m_sub = _safe(m_new)
    p = np.exp(s - m_sub[:, None])
    alpha = np.exp(m - m_sub)              # exp(m_old - m_new) <= 1; 0 while nothing was seen
    return alpha[:, None] * acc + p @ v_j, alpha * l + p.sum(axis=-1), m_new


def fa2_finalize(acc: np.ndarray, l: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 4.1: the one division per row, and the logsumexp."""
    o = acc / np.where(l == 0, 1.0, l)[:, None]
    with np.errstate(divide="ignore"):
        return o, m + np.log(l)


def classify_causal_blocks(q_len: int, kv_len: int, block_m: int, block_n: int) -> np.ndarray:
    """Exercise 4.2: compare each K block's first and last key with the block's first and
    last query position."""
    offset = kv_len - q_len
    n_q, n_k = -(-q_len // block_m), -(-kv_len // block_n)
    classes = np.empty((n_q, n_k), dtype=np.int8)
    for i in range(n_q):
        p_first = i * block_m + offset                       # the block's first row sees keys <= p_first
        p_last = min((i + 1) * block_m, q_len) - 1 + offset  # its last row sees keys <= p_last
        for j in range(n_k):
            k_first, k_last = j * block_n, min((j + 1) * block_n, kv_len) - 1
            if k_first > p_last:
                classes[i, j] = SKIP
            elif k_last <= p_first:
                classes[i, j] = FULL
            else:
                classes[i, j] = MASKED
    return classes


def fa2_backward_tile(q_i: np.ndarray, k_j: np.ndarray, v_j: np.ndarray, do_i: np.ndarray, lse_i: np.ndarray,
                      delta_i: np.ndarray, scale: float, visible: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exercise 4.3: recompute P from L, then the five products of the backward."""
    s = scale * (q_i @ k_j.T)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    # L = -inf only for rows that saw nothing: subtracting +inf there makes every p exactly 0.
    p = np.exp(s - np.where(np.isneginf(lse_i), np.inf, lse_i)[:, None])
    dv = p.T @ do_i
    dp = do_i @ v_j.T
    ds = p * (dp - delta_i[:, None])
    return scale * (ds @ k_j), scale * (ds.T @ q_i), dv


def backward_delta(o: np.ndarray, do: np.ndarray) -> np.ndarray:
    """Exercise 4.4: D_i = dO_i · O_i."""
    return np.sum(o * do, axis=-1)


@triton.jit
def _q_block(Q, K, V, O, LSE, m_block, q_len, kv_len, scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
             DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Query block ``m_block`` of one head (``Q, O, LSE`` at that head, ``K, V`` at its KV head):
    the Q block's state stays in registers; causal blocks past the diagonal are skipped."""
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    in_m = rows < q_len
    q = tl.load(Q + rows[:, None] * HEAD_DIM + d[None, :], mask=in_m[:, None], other=0.0)

    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    hi = kv_len
    if CAUSAL:  # the block's last row sits at position kv_len - q_len + its index: no key past it
        hi = tl.minimum(kv_len, (m_block + 1) * BLOCK_M + (kv_len - q_len))
    for start_n in tl.range(0, hi, BLOCK_N, num_stages=NUM_STAGES):  # loads NUM_STAGES - 1 blocks ahead
        cols = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[:, None] * HEAD_DIM + d[None, :], mask=cols[:, None] < kv_len, other=0.0)
        v = tl.load(V + cols[:, None] * HEAD_DIM + d[None, :], mask=cols[:, None] < kv_len, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = cols[None, :] < kv_len
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + (kv_len - q_len))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: subtract 0
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = alpha * l + tl.sum(p, axis=1)
        acc = alpha[:, None] * acc + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # no division
        m = m_new

    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # FA2: divide once, at the end
    tl.store(O + rows[:, None] * HEAD_DIM + d[None, :], out.to(O.dtype.element_ty), mask=in_m[:, None])
    tl.store(LSE + rows, m + tl.log(l), mask=in_m)  # -inf + log(0) = -inf for a row that saw no key


@triton.jit
def fa2_forward_kernel(Q, K, V, O, LSE, q_heads, kv_heads, q_len, kv_len, scale,
                       HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Exercise 4.5: one program per (Q block, sequence and query head)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // q_heads, bh % q_heads
    kv_bh = (b * kv_heads + h // (q_heads // kv_heads)).to(tl.int64)  # GQA: this head's K/V slab
    _q_block(Q + bh.to(tl.int64) * q_len * HEAD_DIM, K + kv_bh * kv_len * HEAD_DIM, V + kv_bh * kv_len * HEAD_DIM,
             O + bh.to(tl.int64) * q_len * HEAD_DIM, LSE + bh.to(tl.int64) * q_len, pid_m, q_len, kv_len, scale,
             HEAD_DIM, CAUSAL, DOT_PRECISION, BLOCK_M, BLOCK_N, 2)


def fa2_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 4.5 (launcher): one program per (Q block, sequence and query head)."""
    batch, q_heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    BLOCK_M, BLOCK_N = 32, 16
    fa2_forward_kernel[(triton.cdiv(q_len, BLOCK_M), batch * q_heads)](
        q, k, v, out, lse, q_heads, kv_heads, q_len, kv_len, scale, HEAD_DIM=d, CAUSAL=causal,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return out, lse


@triton.jit
def delta_kernel(O, DO, Delta, n_rows, head_dim, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Exercise 4.6: one [BLOCK_M, BLOCK_D] tile of O and of dO, multiplied and summed along rows."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < head_dim)
    offs = rows[:, None].to(tl.int64) * head_dim + cols[None, :]
    o = tl.load(O + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + rows, tl.sum(o * do, axis=1), mask=rows < n_rows)


def backward_delta_triton(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """Exercise 4.6 (launcher): one program per block of 16 rows."""
    o, do = o.contiguous(), do.contiguous()
    head_dim = o.shape[-1]
    n_rows = o.numel() // head_dim
    delta = torch.empty(o.shape[:-1], device=o.device, dtype=torch.float32)
    BLOCK_M = 16
    delta_kernel[(triton.cdiv(n_rows, BLOCK_M),)](o, do, delta, n_rows, head_dim, BLOCK_M=BLOCK_M,
                                                   BLOCK_D=triton.next_power_of_2(head_dim))
    return delta


@triton.jit
def tma_forward_kernel(desc_q, desc_k, desc_v, desc_o, q_heads, kv_heads, kv_len, scale,
                       HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Exercise 4.7: every tile through a descriptor; the scores of block j + 1 are computed
    before the softmax of block j."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // q_heads, bh % q_heads
    kv_h = h // (q_heads // kv_heads)
    start_m = pid_m * BLOCK_M
    keys = tl.arange(0, BLOCK_N)
    q = desc_q.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    k = desc_k.load([b, kv_h, 0, 0]).reshape(BLOCK_N, HEAD_DIM)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    for start_n in range(0, kv_len, BLOCK_N):
        # The next block's scores first (past the end they are scores of zero rows, unused).
        k_next = desc_k.load([b, kv_h, start_n + BLOCK_N, 0]).reshape(BLOCK_N, HEAD_DIM)
        s_next = tl.dot(q, tl.trans(k_next), input_precision=DOT_PRECISION)
        # Zero rows past kv_len score 0, not -inf: mask them.
        s = tl.where((start_n + keys < kv_len)[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every block has a key below kv_len
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = desc_v.load([b, kv_h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m = m_new
        s = s_next
    out = acc / l[:, None]
    desc_o.store([b, h, start_m, 0], out.to(desc_o.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))


def tma_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Exercise 4.7 (launcher): host-made 4-d descriptors, one program per block of 32 rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, q_heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    BLOCK_M, BLOCK_N = 32, 16
    descs = [TensorDescriptor.from_tensor(t, [1, 1, rows, d]) for t, rows in ((q, BLOCK_M), (k, BLOCK_N),
                                                                              (v, BLOCK_N), (out, BLOCK_M))]
    tma_forward_kernel[(triton.cdiv(q_len, BLOCK_M), batch * q_heads)](
        *descs, q_heads, kv_heads, kv_len, scale, HEAD_DIM=d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return out


def causal_tile_order(key_blocks, batch_heads: int, num_programs: int) -> np.ndarray:
    """Exercise 4.8 (part 1): the longest tiles first, in rounds of ``num_programs`` that
    alternate direction (zig-zag), so that the program that drew the longest tile of one
    round draws the shortest of the next."""
    work = np.tile(np.asarray(key_blocks, dtype=np.int64), batch_heads)   # work of tile bh·n + i
    longest_first = np.argsort(-work, kind="stable")  # ties stay in tile order: heads together
    order = longest_first.copy()
    for start in range(num_programs, len(order), 2 * num_programs):     # every second round backwards
        order[start:start + num_programs] = longest_first[start:start + num_programs][::-1]
    return order


@triton.jit
def persistent_forward_kernel(Q, K, V, O, LSE, TileOrder, Owner, q_heads, kv_heads, q_len, kv_len, n_m_blocks,
                              n_tiles, scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                              DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              NUM_STAGES: tl.constexpr):
    """Exercise 4.8 (part 2): Exercise 4.5's program, once per tile of this program's share
    of the schedule; every pointer is computed from the bases for each tile."""
    pid = tl.program_id(0)
    for i in tl.range(pid, n_tiles, tl.num_programs(0)):  # this program's tiles: pid, pid + P, ...
        tile = tl.load(TileOrder + i)
        bh, m_block = tile // n_m_blocks, tile % n_m_blocks
        b, h = bh // q_heads, bh % q_heads
        kv_bh = (b * kv_heads + h // (q_heads // kv_heads)).to(tl.int64)  # GQA: this head's K/V slab
        _q_block(Q + bh.to(tl.int64) * q_len * HEAD_DIM, K + kv_bh * kv_len * HEAD_DIM,
                 V + kv_bh * kv_len * HEAD_DIM, O + bh.to(tl.int64) * q_len * HEAD_DIM, LSE + bh.to(tl.int64) * q_len,
                 m_block, q_len, kv_len, scale, HEAD_DIM, CAUSAL, DOT_PRECISION, BLOCK_M, BLOCK_N, NUM_STAGES)
        tl.store(Owner + tile, pid)


def persistent_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       scale: float | None = None, num_programs: int | None = None, tile_order=None,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exercise 4.8 (launcher): a grid of ``num_programs`` programs and the schedule they walk."""
    batch, q_heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    BLOCK_M, BLOCK_N = 32, 16
    n_m_blocks = triton.cdiv(q_len, BLOCK_M)
    n_tiles = batch * q_heads * n_m_blocks
    num_programs = num_sms(q.device) if num_programs is None else num_programs
    if tile_order is None:
        # The work of query block i: the key blocks its loop visits, up to the diagonal when causal.
        ends = np.full(n_m_blocks, kv_len)
        if causal:
            ends = np.clip((np.arange(n_m_blocks) + 1) * BLOCK_M + kv_len - q_len, 0, kv_len)
        tile_order = causal_tile_order(-(-ends // BLOCK_N), batch * q_heads, num_programs)
    tile_order = np.asarray(tile_order)
    if tile_order.shape != (n_tiles,) or not np.array_equal(np.sort(tile_order), np.arange(n_tiles)):
        raise ValueError(f"tile_order must hold each of the {n_tiles} tiles 0 … {n_tiles - 1} exactly once, "
                         f"got {tile_order.tolist()[:20]}")
    order = torch.as_tensor(tile_order, dtype=torch.int32).to(q.device)
    owner = torch.full((n_tiles,), -1, dtype=torch.int32, device=q.device)
    persistent_forward_kernel[(num_programs,)](
        q, k, v, out, lse, order, owner, q_heads, kv_heads, q_len, kv_len, n_m_blocks, n_tiles, scale,
        HEAD_DIM=d, CAUSAL=causal, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, NUM_STAGES=2)
    return out, lse, owner


# ---------------------------------------------------------------------------------------------
# Exercise 4.9: the key order that keeps an 8-bit P in registers.
# ---------------------------------------------------------------------------------------------
def relabel_order(accumulator_columns, operand_keys) -> np.ndarray:
    """Exercise 4.9 (part 1): the register that holds key ``accumulator_columns[lane, r]`` is
    read at position ``operand_keys[lane, r]``, so ``order`` maps the second to the first."""
    columns = np.asarray(accumulator_columns).ravel()
    order = np.empty(columns.size, dtype=np.int64)
    order[np.asarray(operand_keys).ravel()] = columns
    return order


def permute_keys(vt, order) -> np.ndarray:
    """Exercise 4.9 (part 2): the last axis viewed as ``[seq / G, G]``, gathered by ``order``."""
    vt, order = np.asarray(vt), np.asarray(order)
    group, seq = order.size, vt.shape[-1]
    if seq % group:
        raise ValueError(f"the keys ({seq}) must come in whole groups of {group}")
    return vt.reshape(*vt.shape[:-1], seq // group, group)[..., order].reshape(vt.shape)


# Exercise 4.10: 2^x on the FMA units.
@triton.jit
def exp2_fma_kernel(X, Y, n, C0, C1, C2, C3, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.maximum(tl.load(X + offs, mask=inside, other=0.0), -125.0)
    t = x + 12582912.0  # 1.5 * 2^23: the sum is x rounded to an integer, in t's low bits
    f = x - (t - 12582912.0)
    p = ((C3 * f + C2) * f + C1) * f + C0
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    tl.store(Y + offs, bits.to(tl.float32, bitcast=True), mask=inside)


def exp2_on_fma(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    from minillm.reference.ch04_fp8 import EXP2_POLY_COEFFS

    flat = x.contiguous().view(-1)
    out = torch.empty_like(flat) if out is None else out
    exp2_fma_kernel[(triton.cdiv(flat.numel(), 128),)](flat, out, flat.numel(), *EXP2_POLY_COEFFS, BLOCK=128)
    return out[:flat.numel()].view(x.shape)


# Exercise 4.11: the row sums as a matmul.
@triton.jit
def row_sums_kernel(S, V, O, LSE, n_q, n_k, stride_s, stride_v, stride_o,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    in_rows = rows < n_q
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    l_acc = tl.zeros([BLOCK_M, 16], tl.float32)
    ones = tl.full([BLOCK_N, 16], 1.0, tl.float32)
    for start in range(0, n_k, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        in_keys = keys < n_k
        s = tl.load(S + rows[:, None] * stride_s + keys[None, :], mask=in_rows[:, None] & in_keys[None, :],
                    other=float("-inf"))
        v = tl.load(V + keys[:, None] * stride_v + dims[None, :], mask=in_keys[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # (rows past n_q see only -inf)
        alpha = tl.exp2(m - m_new)
        p8 = tl.exp2(s - m_new[:, None]).to(tl.float8e4nv).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p8, v, input_precision="ieee")
        l_acc = l_acc * alpha[:, None] + tl.dot(p8, ones, input_precision="ieee")
        m = m_new
    l = tl.where(in_rows, tl.max(l_acc, axis=1), 1.0)  # (rows past n_q: nothing to divide)
    tl.store(O + rows[:, None] * stride_o + dims[None, :], acc / l[:, None], mask=in_rows[:, None])
    tl.store(LSE + rows, m + tl.log2(l), mask=in_rows)


def row_sums_attention(s: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
                       lse: torch.Tensor | None = None, block_m: int = 32, block_n: int = 32):
    n_q, n_k = s.shape
    d = v.shape[1]
    out = torch.empty((n_q, d), device=s.device, dtype=torch.float32) if out is None else out
    lse = torch.empty((n_q,), device=s.device, dtype=torch.float32) if lse is None else lse
    row_sums_kernel[(triton.cdiv(n_q, block_m),)](s, v, out, lse, n_q, n_k, s.stride(0), v.stride(0), out.stride(0),
                                                   BLOCK_M=block_m, BLOCK_N=block_n, D=d)
    return out, lse
