"""Chapter 10 exercises: two fused decode kernels and the sampler's draw in Triton. Grade your work with ``make grade CH=10``.

Write the body of each ``@triton.jit`` function, then delete the ``raise`` at the top of its
launcher (the launchers are complete).

Exercise 10.1 fuses the residual add with the RMSNorm that follows it; Exercise 10.2 fuses the
rotary embedding of q and k with the paged cache write. Tests compare with the float64
references in `minillm.reference.ch10_fused_decode` on fresh random inputs of odd sizes.
Exercise 10.3 is the draw at the end of the sampler, the exponential race, checked against
`minillm.reference.ch10_sampling` on given uniforms.
"""
from __future__ import annotations

import torch

from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)


# ---------------------------------------------------------------------------------------------
# Exercise 10.1: residual add + RMSNorm
# ---------------------------------------------------------------------------------------------
@triton.jit
def add_rmsnorm_kernel(X, R, W, Y, R_out, stride_x, stride_r, stride_y, stride_ro, hidden, eps,
                       BLOCK: tl.constexpr):
    """Exercise 10.1 — one program per row ``t``: ``s = X[t] + R[t]``; store ``s`` to
    ``R_out[t]`` (the updated residual, in its dtype); ``Y[t] = s / sqrt(mean(s²) + eps) · W``.

    ``X, R, Y, R_out: [T, hidden]`` with row strides ``stride_x, stride_r, stride_y,
    stride_ro`` (columns contiguous); ``W: [hidden]``. ``BLOCK`` is ``hidden`` rounded up to a
    power of two: the whole row is one tile; mask the columns past ``hidden`` on every load and
    store (and make sure they add nothing to the mean). Compute in float32."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    pass  # your code: load the row of X and of R, add, store the residual, normalise, scale by W, store Y


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 10.1 (launcher, complete) — ``x, residual: [T, hidden]`` (rows may be strided,
    columns contiguous), ``weight: [hidden]`` -> ``(rmsnorm(x + residual) · weight, x + residual)``."""
    raise NotImplementedError("Exercise 10.1 (add_rmsnorm_kernel): not started. Read its docstring; hints: python -m minillm.grade 10 --hint 10.1")
    if x.shape != residual.shape or x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight {tuple(weight.shape)}")
    x, residual = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, residual))
    T, hidden = x.shape
    y, r_out = torch.empty_like(x), torch.empty_like(x)
    if T:
        add_rmsnorm_kernel[(T,)](x, residual, weight, y, r_out, x.stride(0), residual.stride(0), y.stride(0),
                                 r_out.stride(0), hidden, eps, BLOCK=triton.next_power_of_2(hidden))
    return y, r_out


# ---------------------------------------------------------------------------------------------
# Exercise 10.2: rotary embedding of q and k + the paged cache write
# ---------------------------------------------------------------------------------------------
@triton.jit
def rope_write_kv_kernel(Q, K, V, Cos, Sin, Q_out, K_cache, V_cache, Slots,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                         stride_ot, stride_oh, stride_cb, stride_co, stride_ch,
                         num_heads, kv_heads, block_size,
                         HALF: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr):
    """Exercise 10.2 — one program per token ``t``, every head.

    - ``Q: [T, num_heads, 2·HALF]``, ``K, V: [T, kv_heads, 2·HALF]`` with strides ``stride_*t``
      (token) and ``stride_*h`` (head), the head dimension contiguous; ``Cos, Sin: [T, 2·HALF]``
      (row stride ``stride_ct``; the second half of a row repeats the first, read only the
      first ``HALF`` columns);
    - rotate-half rotary: with ``x₁ = x[:HALF]``, ``x₂ = x[HALF:]``, ``c, s`` the first halves
      of the token's cos/sin rows: ``out = [x₁·c − x₂·s, x₂·c + x₁·s]``;
    - store the rotated q to ``Q_out[t]`` (strides ``stride_ot, stride_oh``); store the rotated
      k and the unchanged v at slot ``Slots[t]`` of ``K_cache, V_cache: [num_blocks,
      block_size, kv_heads, 2·HALF]`` (strides ``stride_cb, stride_co, stride_ch``, shared by
      both caches): block ``slot // block_size``, offset ``slot % block_size``. A slot of
      ``-1`` writes nothing to the caches (q is still rotated).

    ``BLOCK_I`` is ``HALF`` and ``BLOCK_H`` is ``max(num_heads, kv_heads)``, each rounded up to
    a power of two: mask the padding on every load and store. Compute in float32."""
    t = tl.program_id(0).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_I)
    offs_h = tl.arange(0, BLOCK_H)
    pass  # your code: the token's angles; rotate and store q; find the slot; rotate k, store k and v there


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Exercise 10.2 (launcher, complete) — ``q: [T, H, D]``, ``k, v: [T, Hkv, D]`` (head
    dimension contiguous), ``cos, sin: [T, D]``, caches ``[num_blocks, block_size, Hkv, D]``
    (contiguous, one dtype with q), ``slot_mapping: [T]`` -> the rotated q ``[T, H, D]``; the
    rotated k and v are written to their slots."""
    raise NotImplementedError("Exercise 10.2 (rope_write_kv_kernel): not started. Read its docstring; hints: python -m minillm.grade 10 --hint 10.2")
    T, H, D = q.shape
    Hkv = k.shape[1]
    if D % 2 or k.shape != (T, Hkv, D) or v.shape != k.shape or cos.shape != (T, D) or sin.shape != (T, D):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cos {tuple(cos.shape)}")
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (Hkv, D) or not k_cache.is_contiguous() \
            or not v_cache.is_contiguous():
        raise ValueError(f"caches {tuple(k_cache.shape)} must be contiguous [blocks, block_size, {Hkv}, {D}]")
    cos, sin, slot_mapping = cos.contiguous(), sin.contiguous(), slot_mapping.contiguous()
    q_out = torch.empty((T, H, D), device=q.device, dtype=q.dtype)
    if T:
        rope_write_kv_kernel[(T,)](
            q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            H, Hkv, k_cache.shape[1],
            HALF=D // 2, BLOCK_I=triton.next_power_of_2(D // 2), BLOCK_H=triton.next_power_of_2(max(H, Hkv)))
    return q_out


# ---------------------------------------------------------------------------------------------
# Exercise 10.3: the exponential race (the sampler's draw)
# ---------------------------------------------------------------------------------------------
@triton.jit
def race_kernel(P, U, Out, stride_p, stride_u, vocab, BLOCK: tl.constexpr):
    """Exercise 10.3 — one program per row ``b``: the token ``argmax_i P[b, i] / E_i`` with
    ``E_i = -log U[b, i]``, over the tokens with ``P[b, i] > 0`` (the lowest id on a tie; 0 if
    no token has ``P > 0``), stored to ``Out[b]`` (int64).

    ``P, U: [B, vocab]`` float32 with row strides ``stride_p, stride_u``; every ``U`` lies in
    ``(0, 1)``. The row may be longer than ``BLOCK``: loop over it in tiles of ``BLOCK`` tokens,
    keeping the best score so far and its token id; a later tile must beat it *strictly*."""
    b = tl.program_id(0).to(tl.int64)
    pass  # your code: loop over the row's tiles; score = p / (-log u) where p > 0; keep the running best


def race(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Exercise 10.3 (launcher, complete) — ``probs, uniforms: [B, vocab]`` float32 (rows
    contiguous) -> ``[B]`` int64: each row's winner of the exponential race."""
    raise NotImplementedError("Exercise 10.3 (race_kernel): not started. Read its docstring; hints: python -m minillm.grade 10 --hint 10.3")
    if probs.dim() != 2 or probs.shape != uniforms.shape or probs.stride(-1) != 1 or uniforms.stride(-1) != 1:
        raise ValueError(f"probs {tuple(probs.shape)} and uniforms {tuple(uniforms.shape)} must be [B, vocab], rows contiguous")
    B, vocab = probs.shape
    out = torch.empty(B, device=probs.device, dtype=torch.int64)
    if B:
        race_kernel[(B,)](probs, uniforms, out, probs.stride(0), uniforms.stride(0), vocab,
                          BLOCK=min(1024, triton.next_power_of_2(vocab)))
    return out
