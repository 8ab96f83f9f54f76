"""Chapter 2 solutions. Try the exercises in ``exercises/ch02.py`` first."""
from __future__ import annotations

import math

import numpy as np


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
