"""Chapter 10 reference: the operations the fused decode kernels compute, in NumPy (float64).

Each function is the oracle of one kernel of `minillm.kernels.ch10_fused_decode` and states the
same layout. They are written as the model writes them (`minillm.model.torch_model`), only
without rounding: the kernels round where the torch model rounds, so a kernel in fp16/bf16
agrees with these up to that rounding.

- `add_rmsnorm`: ``residual = x + residual``, then RMSNorm of the new residual. A decoder layer
  adds each block's output to the residual stream and normalises the sum for the next block:
  two passes over the same row in the torch model, one in the kernel.
- `rotary`: the rotate-half rotary embedding (Hugging Face's Llama/Qwen2 layout: dimension
  ``i`` is paired with ``i + D/2``, not with ``i + 1``), with the angles of `rope_cos_sin`.
- `rope_write_kv`: rotate q and k, then write the rotated k and the untouched v into their
  slots of the paged cache (slot ``-1``: write nothing); returns the rotated q and the caches.
- `silu_mul`: SwiGLU's activation on the merged gate/up projection: ``[T, 2I] -> [T, I]``.
- `add_rmsnorm_linear`, `silu_mul_linear`: the two above followed by the linear layer that
  reads their output (the oracles of the GEMVs that fold them into their load of x).
"""
from __future__ import annotations

import numpy as np

__all__ = ["rmsnorm", "add_rmsnorm", "rope_cos_sin", "rotary", "rope_write_kv", "silu_mul", "add_rmsnorm_linear",
           "silu_mul_linear"]


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x [..., H] -> x / sqrt(mean(x²) + eps) · weight``."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(weight, dtype=np.float64)


def add_rmsnorm(x: np.ndarray, residual: np.ndarray | None, weight: np.ndarray, eps: float
                ) -> tuple[np.ndarray, np.ndarray]:
    """``(rmsnorm(x + residual), x + residual)`` for ``x, residual [T, H]``; ``residual=None``
    (the first layer): ``(rmsnorm(x), x)``."""
    r = np.asarray(x, dtype=np.float64)
    if residual is not None:
        r = r + np.asarray(residual, dtype=np.float64)
    return rmsnorm(r, weight, eps), r


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """``positions [T] -> cos, sin [T, D]``: angle ``pos · theta^(-2i/D)`` for ``i < D/2``,
    repeated for the second half (the rotate-half layout)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``x [T, heads, D]``, ``cos, sin [T, D]``: ``x · cos + rotate_half(x) · sin`` with
    ``rotate_half(x) = [-x₂, x₁]`` (the two halves of the head dimension)."""
    x = np.asarray(x, dtype=np.float64)
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def rope_write_kv(q: np.ndarray, k: np.ndarray, v: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                  k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` by ``cos, sin [T, D]``, and store the
    rotated k and ``v [T, Hkv, D]`` at ``slot_mapping [T]`` of the caches ``[num_blocks,
    block_size, Hkv, D]`` (slot = block · block_size + offset; ``-1``: nothing). Returns
    ``(rotated q, k_cache, v_cache)`` (new arrays; the inputs are not modified)."""
    q_rot, k_rot = rotary(q, cos, sin), rotary(k, cos, sin)
    k_cache = np.array(k_cache, dtype=np.float64)
    v_cache = np.array(v_cache, dtype=np.float64)
    flat_k = k_cache.reshape(-1, *k_cache.shape[2:])
    flat_v = v_cache.reshape(-1, *v_cache.shape[2:])
    for t, slot in enumerate(np.asarray(slot_mapping)):
        if 0 <= slot < flat_k.shape[0]:
            flat_k[slot] = k_rot[t]
            flat_v[slot] = v[t]
    return q_rot, k_cache, v_cache


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """``gate_up [T, 2I]`` (the gate's ``I`` columns, then the up projection's) -> ``silu(gate)
    · up [T, I]`` with ``silu(g) = g / (1 + e^-g)``."""
    gate_up = np.asarray(gate_up, dtype=np.float64)
    inter = gate_up.shape[-1] // 2
    g, u = gate_up[..., :inter], gate_up[..., inter:]
    return g / (1.0 + np.exp(-g)) * u


def _linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    y = x @ np.asarray(weight, dtype=np.float64).T
    return y if bias is None else y + np.asarray(bias, dtype=np.float64)


def add_rmsnorm_linear(x: np.ndarray, residual: np.ndarray | None, norm_weight: np.ndarray, eps: float,
                       weight: np.ndarray, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(add_rmsnorm(x, residual, norm_weight, eps)[0] @ weightᵀ + bias, x + residual)`` for
    ``x, residual [M, K]``, ``weight [N, K]``, ``bias [N]``: the next block's projection of the
    normalised residual stream, and the stream itself."""
    h, r = add_rmsnorm(x, residual, norm_weight, eps)
    return _linear(h, weight, bias), r


def silu_mul_linear(gate_up: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``silu_mul(gate_up) @ weightᵀ + bias``: ``gate_up [M, 2I]``, ``weight [N, I]`` -> ``[M, N]``
    (the MLP's down projection of SwiGLU's activation)."""
    return _linear(silu_mul(gate_up), weight, bias)
