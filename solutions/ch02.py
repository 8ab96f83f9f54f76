"""Chapter 2 solutions. Try the exercises in ``exercises/ch02.py`` first."""
from __future__ import annotations

import math

import numpy as np
import torch

from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)


def kv_cache_write(cache_k: np.ndarray, cache_v: np.ndarray, k_new: np.ndarray, v_new: np.ndarray,
                   start: int) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 2.1: slot ``p`` holds position ``p``, so the new rows go to ``start .. start+T-1``."""
    end = start + k_new.shape[1]
    if end > cache_k.shape[1]:
        raise ValueError(f"KV cache full: need {end} slots, have {cache_k.shape[1]}")
    cache_k[:, start:end] = k_new
    cache_v[:, start:end] = v_new
    return cache_k[:, :end], cache_v[:, :end]  # basic slices are views: nothing is copied


def decode_step(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray,
                pos: int, scale: float | None = None) -> np.ndarray:
    """Exercise 2.2: store the new key/value, then one query row per head against the cache."""
    heads, head_dim = q.shape
    kv_heads = cache_k.shape[0]
    cache_k[:, pos], cache_v[:, pos] = k_new, v_new
    k, v = cache_k[:, :pos + 1], cache_v[:, :pos + 1]                  # [kv_heads, pos+1, head_dim]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    # GQA: view the query heads as [kv_heads, group] so each group meets its own KV head.
    qg = q.reshape(kv_heads, heads // kv_heads, head_dim)
    scores = scale * qg @ k.transpose(0, 2, 1)                         # [kv_heads, group, pos+1]
    # The newest token sees every cached position: no mask, just a safe softmax.
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ v).reshape(heads, head_dim)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Exercise 2.3a: a key and a value vector per KV head, per layer."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def max_batch(mem_bytes: int, weight_bytes: int, alpha: int, beta: int, context: int) -> int:
    """Exercise 2.3b: ``M + BS·(α + β·context) ≤ Mem``, solved for the largest integer ``BS``."""
    free = mem_bytes - weight_bytes
    if free <= 0:
        return 0
    return free // (alpha + beta * context)  # integers: floor division is exact


def ring_slot(pos, window: int):
    """Exercise 2.4a: position ``pos`` overwrites ``pos - window``, which nobody can see any more."""
    return pos % window


def ring_read(ring_k: np.ndarray, ring_v: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 2.4b: gather the last ``min(seq_len, W)`` positions back into position order."""
    window = ring_k.shape[1]
    slots = ring_slot(np.arange(max(0, seq_len - window), seq_len), window)
    return ring_k[:, slots], ring_v[:, slots]


@triton.jit
def cache_write_kernel(K_new, V_new, K_cache, V_cache, Pos,
                       stride_cb, stride_ch, stride_cn, kv_heads, head_dim,
                       BLOCK_D: tl.constexpr):
    """Exercise 2.5: one program copies one (sequence, KV head) row of K and of V."""
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # int64: caches pass 2^31 elements
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(Pos + b).to(tl.int64)
    mask = d < tl.where(slot >= 0, head_dim, 0)  # padding lanes, and padding sequences, copy nothing
    src = (b * kv_heads + h) * head_dim + d
    dst = b * stride_cb + h * stride_ch + slot * stride_cn + d
    tl.store(K_cache + dst, tl.load(K_new + src, mask=mask), mask=mask)
    tl.store(V_cache + dst, tl.load(V_new + src, mask=mask), mask=mask)


def cache_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                pos: torch.Tensor) -> None:
    """Exercise 2.5 (launcher): one program per (sequence, KV head)."""
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
    """Exercise 2.6: the whole cache of one sequence as one [BLOCK_N, BLOCK_D] tile."""
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    n = tl.arange(0, BLOCK_N)  # slot index
    d = tl.arange(0, BLOCK_D)
    kv_h = h // group  # GQA: consecutive query heads share one KV head
    in_d = d < head_dim
    q = tl.load(Q + (b * q_heads + h) * head_dim + d, mask=in_d, other=0.0).to(tl.float32)
    seq_len = tl.load(SeqLens + b)
    in_n = n < seq_len
    offs = b * stride_kb + kv_h * stride_kh + n[:, None] * stride_kn + d[None, :]
    mask = in_n[:, None] & in_d[None, :]
    k = tl.load(K + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sum(q[None, :] * k, axis=1) * scale         # [BLOCK_N]: one score per slot
    s = tl.where(in_n, s, float("-inf"))               # slots past the sequence: invisible
    m = tl.max(s, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)           # seq_len = 0: no NaN
    p = tl.exp(s - m)
    total = tl.sum(p, axis=0)
    o = tl.sum(p[:, None] * v, axis=0) / tl.where(total == 0.0, 1.0, total)  # [BLOCK_D]
    tl.store(O + (b * q_heads + h) * head_dim + d, o.to(O.dtype.element_ty), mask=in_d)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Exercise 2.6 (launcher): one program per (sequence, query head)."""
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
