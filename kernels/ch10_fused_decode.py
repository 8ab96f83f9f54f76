"""Chapter 10: fusing the decode step, as Triton kernels.

The notebook ``chapters/10_fused_decode.ipynb`` tells the chapter's story with its
measurements; this docstring summarises what the code does.

A decode step of a small model is hundreds of kernels, most of which move a few kilobytes:
per layer, the torch model (`minillm.model.torch_model`) runs two RMSNorms (a cast, a square,
a mean, an rsqrt, two multiplies and a cast each), two residual adds, three projections for
q, k and v, the rotary embedding of q and of k (a chunk, a negation, a concatenation, two
multiplies, an add, each), the cache write, attention, the output projection, two more
projections for the MLP's gate and up, a SiLU and a multiply, and the down projection. Inside
a CUDA graph each kernel still costs a few microseconds of launch latency and ramp-up, so a
step of ~900 kernels costs milliseconds while its bytes (the weights, once) take a fraction of
that. Fusing means doing several of these operations in one kernel, so each row is read from
memory once and the step has fewer kernels. Three fusions here, as vLLM, SGLang and
FlashInfer ship them:

1. `add_rmsnorm`: the residual add and the next RMSNorm, one program per row:
   ``residual = x + residual``; ``y = residual / rms(residual) · weight``. Returns ``(y,
   residual)``.
2. `rope_write_kv`: the rotary embedding of q and k, and the paged cache write of the rotated
   k and of v, one program per token: q, k and v may be strided views of the merged q/k/v
   projection's output (no copy); the rotated q is written to a contiguous buffer for
   attention.
3. `silu_mul`: SwiGLU's ``silu(gate) · up`` on the merged gate/up projection ``[T, 2I] -> [T, I]``.

At the handful of rows of a decode step the projections are GEMVs (Chapter 8), and the
elementwise step before each can be folded into the GEMV's load of x instead: `add_rmsnorm_gemv`
(each program recomputes its rows' ``1/rms`` from the whole row, a few KB from L2, and
normalises x as it loads it), `silu_mul_gemv` (SwiGLU's activation as the down projection
loads its x) and `decode_gemv` (nothing folded). The step after the q/k/v projection folds
into its end: `add_rmsnorm_gemv_rope` has each program compute both halves of its rotation
pairs, rotate them in registers and write q, and k and v to the cache, instead of storing the
projection for `rope_write_kv` to read back. On Hopper these kernels, and `rope_write_kv`, are
launched as programmatic dependent launches (`pdl_enabled`): inside a CUDA graph the next
kernel is launched and scheduled while this one runs, and waits (``gdc_wait``) for it to
finish before reading anything.

A fourth kernel ends the step: `exponential_race`, the draw of each row's next token from its
probabilities, so that sampling can run inside the step's CUDA graph
(`minillm.decoding.gpu_sampling` does the temperature and the filters around it). Each row draws
with counter-based random numbers (Philox, Salmon et al. 2011): the uniform of token ``i`` is a
pure function of the row's seed, its position and ``i``, so the draw needs no generator state
and gives the same token whatever else is in the batch. The token is the winner of an
*exponential race*: ``argmax_i p_i / E_i`` with ``E_i = -log U_i`` exponential, which picks
token ``i`` with probability ``p_i`` (the Gumbel-max trick in another form: ``log p_i - log E_i``
is ``log p_i`` plus a Gumbel variable).

The kernels round where the torch model rounds (the sum of the residual add to the model's
dtype before normalising; the normalised row to the dtype before the weight; each product of
the rotation before the add; the SiLU before the multiply), so in fp16/bf16 the fused step
agrees with the unfused one to the last bit in most elements; in fp32 they compute in fp32.
`minillm.reference.ch10_fused_decode` holds the float64 oracles.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from minillm.kernels.base import (
    device_capability, graph_ms_per_call, l2_copies, head_dim_offsets, interpreting, launch, power_of_2_at_least, tl,
    triton, unrecorded,
)
from minillm.kernels.ch08_flat_gemm import store_result

__all__ = ["add_rmsnorm", "exponential_race", "race_uniforms", "rope_write_kv", "silu_mul", "add_rmsnorm_gemv",
           "silu_mul_gemv", "decode_gemv", "add_rmsnorm_gemv_rope", "pdl_enabled", "PROLOGUE_CONFIGS"]


# ----------------------------------------------------------------------------------------
# 1. Residual add + RMSNorm
# ----------------------------------------------------------------------------------------
@triton.jit
def _add_rmsnorm_kernel(X, R, W, Y, R_out, stride_x, stride_r, stride_y, stride_ro, hidden, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``t``: row ``t``. ``s = x + r`` (rounded to the residual's dtype, as the model's
    add rounds), stored to ``R_out``; ``y = (s · rsqrt(mean(s²) + eps))`` rounded to the
    output dtype, times ``W``. The whole row (``hidden <= BLOCK``) stays in registers."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    s = tl.load(X + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        summed = (s + r).to(R_out.dtype.element_ty)
        tl.store(R_out + t * stride_ro + offs, summed, mask=mask)
        s = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / hidden + eps)
    n = (s * rstd).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + t * stride_y + offs, (n * w).to(Y.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual) · weight, x + residual)`` in one pass over each row.

    - ``x, residual: [T, hidden]`` (rows may be strided; the last axis contiguous), the same
      dtype; ``residual=None`` (the first layer): no add, returns ``(rmsnorm(x), x)``;
    - ``weight: [hidden]``; ``eps`` the norm's epsilon;
    - ``out``, ``residual_out``: optional ``[T, hidden]`` outputs (new tensors by default;
      ``residual_out=residual`` updates the residual in place, as vLLM's kernel does).
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, hidden] with a contiguous last axis, got {tuple(x.shape)}")
    T, hidden = x.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} must be [{hidden}]")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} must be {tuple(x.shape)}, contiguous rows")
    out = torch.empty_like(x) if out is None else out
    if residual is None:
        r_in = r_out = x
    else:
        r_in = residual
        r_out = torch.empty_like(x) if residual_out is None else residual_out
    if T == 0:
        return out, r_out
    BLOCK = power_of_2_at_least(hidden)
    num_warps = 4 if BLOCK <= 2048 else 8
    launch(_add_rmsnorm_kernel, (T,), x, r_in, weight, out, r_out, x.stride(0), r_in.stride(0), out.stride(0),
           r_out.stride(0), hidden, float(eps), HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=num_warps)
    return out, r_out


# ----------------------------------------------------------------------------------------
# 2. Rotary embedding of q and k + the paged cache write
# ----------------------------------------------------------------------------------------
@triton.jit
def _load_halves(X, stride_h, offs_h, h_ok, offs_i, i_ok, HALF: tl.constexpr):
    """Heads ``offs_h`` of one token: the two halves ``[BLOCK_H, BLOCK_I]`` of each, in fp32."""
    mask = h_ok[:, None] & i_ok[None, :]
    base = X + offs_h[:, None] * stride_h + offs_i[None, :]
    return tl.load(base, mask=mask, other=0.0).to(tl.float32), tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rotate_half(x1, x2, c, s, DT: tl.constexpr):
    """``[x₁·c - x₂·s, x₂·c + x₁·s]``, each product and each sum rounded to ``DT`` (the
    output's dtype) as the torch model's ``x·cos + rotate_half(x)·sin`` rounds."""
    a1 = (x1 * c).to(DT).to(tl.float32)
    b1 = (-x2 * s).to(DT).to(tl.float32)
    a2 = (x2 * c).to(DT).to(tl.float32)
    b2 = (x1 * s).to(DT).to(tl.float32)
    return (a1 + b1).to(DT), (a2 + b2).to(DT)


@triton.jit
def _rope_write_kv_kernel(
    Q, K, V, Cos, Sin, Q_out, K_cache, V_cache, Slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ct, stride_st, stride_ot, stride_oh,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    num_heads, kv_heads, block_size, num_slots,
    HALF: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program ``t``: token ``t``, every head. Rotates its q heads into ``Q_out`` and its k
    heads into the k cache at ``Slots[t]``, and copies its v heads to the v cache there. A
    slot outside ``[0, num_slots)`` (``-1``: padding) writes no K/V; q is rotated anyway.

    Every load comes before the first store: the compiler does not move a load past a store
    that may alias it, and at one token per step each round trip to memory is a visible part
    of the kernel's few microseconds. ``PDL``: as in `_prologue_gemv_kernel`."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_I)
    i_ok = offs_i < HALF
    offs_i = tl.minimum(offs_i, HALF - 1)          # padding columns: clamped, masked
    offs_hq = tl.arange(0, BLOCK_HQ)
    hq_ok = offs_hq < num_heads
    offs_hq = tl.minimum(offs_hq, num_heads - 1).to(tl.int64)
    offs_hk = tl.arange(0, BLOCK_HK)
    hk_real = offs_hk < kv_heads
    offs_hk = tl.minimum(offs_hk, kv_heads - 1).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    q1, q2 = _load_halves(Q + t * stride_qt, stride_qh, offs_hq, hq_ok, offs_i, i_ok, HALF)
    k1, k2 = _load_halves(K + t * stride_kt, stride_kh, offs_hk, hk_real, offs_i, i_ok, HALF)
    v1, v2 = _load_halves(V + t * stride_vt, stride_vh, offs_hk, hk_real, offs_i, i_ok, HALF)
    DT = Q_out.dtype.element_ty
    # The angles of this token: the first half of its cos/sin rows (the second repeats it).
    c = tl.load(Cos + t * stride_ct + offs_i).to(tl.float32)[None, :]
    s = tl.load(Sin + t * stride_st + offs_i).to(tl.float32)[None, :]
    q1, q2 = _rotate_half(q1, q2, c, s, DT)
    k1, k2 = _rotate_half(k1, k2, c, s, DT)

    q_dst = Q_out + t * stride_ot + offs_hq[:, None] * stride_oh + offs_i[None, :]
    q_mask = hq_ok[:, None] & i_ok[None, :]
    tl.store(q_dst, q1, mask=q_mask)
    tl.store(q_dst + HALF, q2, mask=q_mask)
    ok = (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    blk = slot // block_size
    off = slot % block_size
    hk_ok = hk_real & (offs_hk < tl.where(ok, kv_heads, 0))  # a token without a slot: no heads to write
    CT = K_cache.dtype.element_ty
    kv_mask = hk_ok[:, None] & i_ok[None, :]
    k_dst = K_cache + blk * stride_kcb + off * stride_kco + offs_hk[:, None] * stride_kch + offs_i[None, :]
    tl.store(k_dst, k1.to(CT), mask=kv_mask)
    tl.store(k_dst + HALF, k2.to(CT), mask=kv_mask)
    v_dst = V_cache + blk * stride_vcb + off * stride_vco + offs_hk[:, None] * stride_vch + offs_i[None, :]
    tl.store(v_dst, v1.to(CT), mask=kv_mask)
    tl.store(v_dst + HALF, v2.to(CT), mask=kv_mask)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q and k (rotate-half layout), write the rotated k and v to their cache slots;
    returns the rotated q. One launch, one program per token.

    - ``q: [T, H, D]``, ``k, v: [T, Hkv, D]``: any strides over tokens and heads, the head
      dimension contiguous (views of the merged q/k/v projection's output work as they are);
    - ``cos, sin: [T, D]`` as `minillm.model.torch_model.rope_cos_sin` makes them (only their
      first ``D/2`` columns are read: the second half repeats them); ``D`` must be even;
    - ``k_cache, v_cache: [num_blocks, block_size, Hkv, D]`` (the paged layout), written in
      place at ``slot_mapping: [T]`` (``-1``: nothing written);
    - ``q_out``: ``[T, H, D]`` for the rotated q (default: a new contiguous tensor; ``q``
      itself rotates in place).
    """
    T, H, D = q.shape
    if k.dim() != 3 or k.shape != v.shape or k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} must be [T, Hkv, D] with q {tuple(q.shape)}")
    Hkv = k.shape[1]
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (Hkv, D):
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} must be "
                         f"[blocks, block_size, {Hkv}, {D}]")
    if cos.shape != (T, D) or sin.shape != (T, D):
        raise ValueError(f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)} must be [{T}, {D}]")
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("cos", cos),
                    ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last axis must be contiguous")
    if tuple(slot_mapping.shape) != (T,) or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be a contiguous [{T}]")
    q_out = torch.empty((T, H, D), device=q.device, dtype=q.dtype) if q_out is None else q_out
    if T == 0:
        return q_out
    half = D // 2
    num_blocks, block_size = k_cache.shape[:2]
    launch(_rope_write_kv_kernel, (T,), q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
           cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1),
           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
           v_cache.stride(2), H, Hkv, block_size, num_blocks * block_size,
           HALF=half, BLOCK_I=power_of_2_at_least(half), BLOCK_HQ=power_of_2_at_least(H),
           BLOCK_HK=power_of_2_at_least(Hkv), num_warps=4, **_pdl_meta(q.device))
    return q_out


def _pdl_meta(device: torch.device) -> dict:
    """The meta-parameters of a kernel with a ``PDL`` switch: on, and launched as a
    programmatic dependent launch, where `pdl_enabled`."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {}


# ----------------------------------------------------------------------------------------
# 3. SiLU-and-mul
# ----------------------------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(X, Y, stride_x, stride_y, inter, BLOCK: tl.constexpr):
    """Program ``(t, j)``: columns ``j·BLOCK …`` of row ``t``: ``silu(x[:inter]) ·
    x[inter:]``, the SiLU rounded to the output dtype before the multiply (as ``F.silu(g) · u``)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(X + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + t * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + t * stride_y + offs, (act * u).to(Y.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gate_up [T, 2I]`` (gate columns first, then up) -> ``silu(gate) · up [T, I]``."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must be [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}")
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((T, inter), device=gate_up.device, dtype=gate_up.dtype) if out is None else out
    if T == 0 or inter == 0:
        return out
    BLOCK = min(1024, power_of_2_at_least(inter))
    launch(_silu_mul_kernel, (T, triton.cdiv(inter, BLOCK)), gate_up, out, gate_up.stride(0), out.stride(0), inter,
           BLOCK=BLOCK, num_warps=4)
    return out


# ----------------------------------------------------------------------------------------
# 4. Sampling: the exponential race
# ----------------------------------------------------------------------------------------
@triton.jit
def _race_uniforms(seed, position, offs):
    """The uniforms of tokens ``offs`` of a row with ``seed`` (int64) at ``position``: one
    Philox draw per token, counter ``(token, position, 0, 0)`` under the key ``seed``; its top
    23 bits ``k`` give ``(k + 0.5) / 2²³``, strictly inside ``(0, 1)`` (so ``-log u`` is finite
    and never 0) and exact in fp32."""
    zero = offs.to(tl.uint32) * 0
    bits, _, _, _ = tl.philox(seed, offs.to(tl.uint32), zero + position.to(tl.uint32), zero, zero)
    return ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _exponential_race_kernel(P, Seeds, Positions, Out, stride_p, vocab, BLOCK: tl.constexpr):
    """Program ``b``: row ``b``. Over the vocabulary in tiles of ``BLOCK``, the running winner of
    ``p / E`` (``E = -log u``), tokens with ``p = 0`` excluded; ties go to the lower token id
    (``tl.argmax`` picks the first maximum in a tile, and a later tile must beat the winner
    strictly). Writes the winner's id (0 if every ``p`` is 0)."""
    b = tl.program_id(0).to(tl.int64)
    seed = tl.load(Seeds + b)
    position = tl.load(Positions + b)
    best = tl.full((), -1.0, tl.float32)
    best_id = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        p = tl.load(P + b * stride_p + offs, mask=mask, other=0.0).to(tl.float32)
        e = -tl.log(_race_uniforms(seed, position, offs))
        score = tl.where(p > 0, p / e, -1.0)
        i = tl.argmax(score, axis=0)
        s = tl.max(score, axis=0)
        better = s > best
        best_id = tl.where(better, (start + i).to(tl.int32), best_id)
        best = tl.where(better, s, best)
    tl.store(Out + b, best_id.to(tl.int64))


@triton.jit
def _race_uniforms_kernel(Seeds, Positions, U, stride_u, vocab, BLOCK: tl.constexpr):
    """Program ``(b, j)``: the uniforms `_exponential_race_kernel` uses for tokens ``j·BLOCK …``
    of row ``b`` (for tests and the reference)."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = _race_uniforms(tl.load(Seeds + b), tl.load(Positions + b), offs)
    tl.store(U + b * stride_u + offs, u, mask=offs < vocab)


def _check_race_rows(seeds: torch.Tensor, positions: torch.Tensor, rows: int) -> None:
    for name, t in (("seeds", seeds), ("positions", positions)):
        if tuple(t.shape) != (rows,) or t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int64 [{rows}], got {t.dtype} {tuple(t.shape)}")


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``probs [B, vocab]`` (any float dtype, rows may be strided, each
    row's probabilities need not sum to 1: only their ratios count), drawn with probability
    proportional to ``probs``; returns ``[B]`` int64 (in ``out`` if given).

    - ``seeds: [B]`` int64: the Philox key of each row (the engine: request seed + sample index);
    - ``positions: [B]`` int64: the position of the token being drawn (the Philox counter's
      second word, so every step of a sequence draws fresh numbers).

    No host synchronisation and no data-dependent shape: it can be captured in a CUDA graph.
    `race_uniforms` returns the uniforms it uses; `minillm.reference.ch10_sampling` is its oracle.
    """
    if probs.dim() != 2 or probs.stride(-1) != 1:
        raise ValueError(f"probs must be [B, vocab] with contiguous rows, got {tuple(probs.shape)}")
    B, vocab = probs.shape
    _check_race_rows(seeds, positions, B)
    out = torch.empty(B, device=probs.device, dtype=torch.int64) if out is None else out
    if B == 0:
        return out
    BLOCK = min(4096, power_of_2_at_least(vocab))
    launch(_exponential_race_kernel, (B,), probs, seeds, positions, out, probs.stride(0), vocab, BLOCK=BLOCK,
           num_warps=8 if BLOCK >= 2048 else 4)
    return out


def race_uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, vocab]`` float32: the uniforms `exponential_race` draws for rows with these
    ``seeds`` and ``positions`` (each in ``(0, 1)``)."""
    B = seeds.shape[0]
    _check_race_rows(seeds, positions, B)
    u = torch.empty(B, vocab, device=seeds.device, dtype=torch.float32)
    if B and vocab:
        BLOCK = min(1024, power_of_2_at_least(vocab))
        launch(_race_uniforms_kernel, (B, triton.cdiv(vocab, BLOCK)), seeds, positions, u, u.stride(0), vocab,
               BLOCK=BLOCK, num_warps=4)
    return u


# ----------------------------------------------------------------------------------------
# 5. The GEMV with the elementwise step before it folded into its load of x
# ----------------------------------------------------------------------------------------
#: `_prologue_gemv_kernel`'s ``PROLOGUE``: what the kernel computes x from.
PROLOGUE_NONE = 0
PROLOGUE_ADD_RMSNORM = 1
PROLOGUE_SILU_MUL = 2
#: The prologues whose GEMV loads its first tile of W before the PDL wait (``EARLY_W``, see
#: `_prologue_gemv_kernel`): those with a norm folded in, and none (the o projection, behind
#: attention, whose few programs leave HBM idle). On an H100 (1B Llama, one sequence, context
#: 128, attention a PDL launch too) the o projection's early tile took its effective time from
#: 6.4 to 5.3 µs a layer and slowed attention by 0.7 µs: 0.968 -> 0.964 ms a step.
EARLY_W_PROLOGUES = (PROLOGUE_ADD_RMSNORM, PROLOGUE_NONE)


@triton.jit
def _prologue_rows(X, R, NormW, R_out, m0, M, K, stride_xm, stride_rm, stride_rom, eps, write_residual,
                   PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """For ``PROLOGUE_ADD_RMSNORM``: each of the program's ``ROWS`` rows' ``1 / rms`` over the
    whole row (``[BLOCK_M]``, fp32, as `_add_rmsnorm_kernel` computes it), and the summed
    residual row written to ``R_out`` where ``write_residual`` (one program of the grid).
    Otherwise zeros (unused)."""
    cols = tl.arange(0, BLOCK_M)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:
        offs = tl.arange(0, BLOCK_H)
        ok = offs < K
        for r in tl.static_range(ROWS):
            m = tl.minimum(m0 + r, M - 1).to(tl.int64)
            s = tl.load(X + m * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                s = (s + tl.load(R + m * stride_rm + offs, mask=ok, other=0.0).to(tl.float32))
                s = s.to(R_out.dtype.element_ty)
                # Written by one program only, and not for the repeated last row of a short tile.
                limit = tl.where(write_residual & (m0 + r < M), K, 0)
                tl.store(R_out + m * stride_rom + offs, s, mask=offs < limit)
                s = s.to(tl.float32)
            row = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / K + eps)
            rstd = tl.where(cols == r, row, rstd)
    return rstd


@triton.jit
def _prologue_x(X, R, NormW, m, offs_k, k_ok, K, stride_xm, stride_rm, rstd,
                PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr, DT: tl.constexpr):
    """Row ``m``'s x at columns ``offs_k`` (fp32), rounded where the unfused kernels round:
    ``rmsnorm(x + r) · w`` (`_add_rmsnorm_kernel`) or ``silu(gate) · up`` (`_silu_mul_kernel`,
    ``X`` then being ``[M, 2K]``: the gate's K columns, then the up projection's)."""
    x_row = X + m * stride_xm + offs_k
    if EVEN_K:
        a = tl.load(x_row).to(tl.float32)
    else:
        a = tl.load(x_row, mask=k_ok, other=0.0).to(tl.float32)
    if PROLOGUE == 0:
        return a
    elif PROLOGUE == 1:
        if HAS_RESIDUAL:
            a = (a + tl.load(R + m * stride_rm + offs_k, mask=k_ok, other=0.0).to(tl.float32)).to(DT).to(tl.float32)
        w = tl.load(NormW + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        return ((a * rstd).to(DT).to(tl.float32) * w).to(DT).to(tl.float32)
    else:
        up = tl.load(x_row + K, mask=k_ok, other=0.0).to(tl.float32)
        act = (a / (1.0 + tl.exp(-a))).to(DT).to(tl.float32)
        return (act * up).to(DT).to(tl.float32)


@triton.jit(do_not_specialize=["M"])  # one compiled variant per tile, whatever the batch
def _prologue_gemv_kernel(X, R, NormW, R_out, W, Bias, Out, Partials, Counters, M, N, K, k_per_split, eps,
                          stride_xm, stride_rm, stride_rom, stride_wn, stride_om, stride_on,
                          PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SPLIT: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, EARLY_W: tl.constexpr,
                          ROWS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_H: tl.constexpr):
    """Chapter 8's GEMV (`minillm.kernels.ch08_flat_gemm.gemv`: program ``(i, j, s)``, rows
    ``i·ROWS …`` times features ``j·BLOCK_N …`` over the ``s``-th run of K) whose x is
    computed while it is loaded (`_prologue_x`) instead of read from a kernel before it.

    The tile of W for the next step is loaded one step ahead (into registers), its first one
    before the prologue's pass over the row. With ``PDL`` (a programmatic dependent launch)
    the program waits for the kernel before it (``gdc_wait``), then lets the next one launch
    (``gdc_launch_dependents``): the next kernel's launch and scheduling overlap this one's
    run. With ``EARLY_W`` the first tile of W is loaded before the wait (no kernel before
    writes the weights), so a GEMV launched early starts streaming while its predecessor
    finishes. On an H100 (1B Llama, one sequence, two profiled runs) that saved about 1.5 µs on the q/k/v
    GEMV behind the down projection and cost about 1.5 µs on the o projection, whose early-loading
    successor (gate/up, 4096 programs) then competes with it for HBM. Which GEMVs load early:
    `EARLY_W_PROLOGUES`. W's rows and columns are contiguous (``nn.Linear``'s layout)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_lo = pid_k * k_per_split
    acc = _prologue_gemv_tile(X, R, NormW, R_out, W, tl.minimum(offs_n, N - 1).to(tl.int64), pid_m * ROWS, M, K,
                              k_lo, tl.minimum(k_lo + k_per_split, K), eps, stride_xm, stride_rm, stride_rom,
                              stride_wn, (pid_n == 0) & (pid_k == 0), Out.dtype.element_ty, PROLOGUE, HAS_RESIDUAL,
                              EVEN_K, PDL, EARLY_W, ROWS, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_H)
    cols = tl.arange(0, BLOCK_M)
    offs_m = pid_m * ROWS + cols
    store_result(acc, offs_m[None, :], offs_n[:, None], (cols < ROWS)[None, :] & (offs_m < M)[None, :],
                 n_ok[:, None], Bias, Out, Partials, Counters, M, N, stride_om, stride_on, HAS_BIAS, SPLIT)


@triton.jit
def _prologue_gemv_tile(X, R, NormW, R_out, W, w_rows, m0, M, K, k_lo, k_hi, eps, stride_xm, stride_rm, stride_rom,
                        stride_wn, write_residual, DT: tl.constexpr, PROLOGUE: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, EARLY_W: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_H: tl.constexpr, LATE_TRIGGER: tl.constexpr = False):
    """The body of `_prologue_gemv_kernel` up to its store: the fp32 products ``[BLOCK_N,
    BLOCK_M]`` of W's rows ``w_rows`` (``[BLOCK_N]``, int64, in range) with x's rows ``m0 …
    m0 + ROWS`` over K's columns ``[k_lo, k_hi)`` (the PDL wait, the prologue and the
    pipelined loads of W included). ``write_residual``: this program stores the summed
    residual (one program of the grid). ``LATE_TRIGGER``: the caller lets the next kernel
    launch itself, later (``gdc_launch_dependents`` not called after the wait here)."""
    cols = tl.arange(0, BLOCK_M)
    offs_k0 = tl.arange(0, BLOCK_K)
    w_ptrs = W + w_rows[:, None] * stride_wn + (k_lo + offs_k0).to(tl.int64)[None, :]
    if EARLY_W:  # no kernel before this one writes the weights
        w_next = tl.load(w_ptrs, mask=(k_lo + offs_k0 < k_hi)[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        if not LATE_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    if not EARLY_W:
        w_next = tl.load(w_ptrs, mask=(k_lo + offs_k0 < k_hi)[None, :], other=0.0)
    rstd = _prologue_rows(X, R, NormW, R_out, m0, M, K, stride_xm, stride_rm, stride_rom, eps, write_residual,
                          PROLOGUE, HAS_RESIDUAL, ROWS, BLOCK_M, BLOCK_H)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + offs_k0
        k_ok = offs_k < K
        w = w_next.to(tl.float32)
        w_ptrs += BLOCK_K
        w_next = tl.load(w_ptrs, mask=(offs_k + BLOCK_K < k_hi)[None, :], other=0.0)  # the next step's tile
        for r in tl.static_range(ROWS):
            m = tl.minimum(m0 + r, M - 1).to(tl.int64)
            row_rstd = tl.sum(tl.where(cols == r, rstd, 0.0), axis=0)
            x = _prologue_x(X, R, NormW, m, offs_k, k_ok, K, stride_xm, stride_rm, row_rstd, PROLOGUE,
                            HAS_RESIDUAL, EVEN_K, DT)
            dots = tl.sum(w * x[None, :], axis=1)
            acc += tl.where(cols[None, :] == r, dots[:, None], 0.0)
    return acc


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch as programmatic dependent launches (PDL): on a GPU
    of compute capability 9.0 or later (Hopper), outside the interpreter, unless
    ``MINILLM_PDL=0``. Inside a CUDA graph the launches become programmatic edges: the next
    kernel is scheduled while this one's last programs run, and waits (``gdc_wait``) only
    before it touches memory. On an H100 a chain of one-program kernels in a graph costs
    0.99 µs a kernel with PDL against 1.44 without (measured, Triton 3.6)."""
    if device.type != "cuda" or interpreting() or os.environ.get("MINILLM_PDL", "1") == "0":
        return False
    return device_capability(device) >= (9, 0)


@dataclass
class _GemvPlan:
    """A `_prologue_gemv_kernel` launch that depends only on shapes: grid, K per split,
    meta-parameters and the split-K workspace (kept for the process: a captured CUDA graph
    keeps using its addresses, as Chapter 8's plans)."""
    grid: tuple[int, int, int]
    k_per_split: int
    meta: dict
    partials: torch.Tensor | None
    counters: torch.Tensor | None


_GEMV_PLANS: dict[tuple, _GemvPlan] = {}


def _gemv_plan(prologue: int, x: torch.Tensor, weight: torch.Tensor, has_bias: bool, has_residual: bool,
               cfg, pdl: bool) -> _GemvPlan:
    M, K = x.shape
    N = weight.shape[0]
    key = (prologue, cfg, M, N, K, x.dtype, x.device, has_bias, has_residual, pdl)
    plan = _GEMV_PLANS.get(key)
    if plan is not None:
        return plan
    k_tiles = triton.cdiv(K, cfg.block_k)
    per_split = triton.cdiv(k_tiles, max(1, min(cfg.split_k, k_tiles)))
    split = triton.cdiv(k_tiles, per_split)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), split)
    partials = counters = None
    if split > 1:
        partials = torch.empty(split, M, N, device=x.device, dtype=torch.float32)
        with unrecorded():  # kept in the plan; the kernel leaves the counters at zero
            counters = torch.zeros(grid[0] * grid[1], device=x.device, dtype=torch.int32)
    meta = dict(PROLOGUE=prologue, HAS_RESIDUAL=has_residual, HAS_BIAS=has_bias, SPLIT=split > 1,
                EVEN_K=K % cfg.block_k == 0, PDL=pdl, EARLY_W=prologue in EARLY_W_PROLOGUES, ROWS=cfg.block_m,
                BLOCK_M=power_of_2_at_least(cfg.block_m),
                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                BLOCK_H=power_of_2_at_least(K) if prologue == PROLOGUE_ADD_RMSNORM else 1,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if pdl:
        meta["launch_pdl"] = True
    plan = _GEMV_PLANS[key] = _GemvPlan(grid, per_split * cfg.block_k, meta, partials, counters)
    return plan


def _norm_residual_out(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                       residual_out: torch.Tensor | None) -> torch.Tensor:
    """Check a norm prologue's operands and return the tensor its new residual goes to: ``x``
    itself without a residual (the first layer), else ``residual_out`` or a new one."""
    K = x.shape[-1]
    if norm_weight.shape != (K,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} must be a contiguous [{K}]")
    if residual is None:
        return x
    if residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError(f"residual {tuple(residual.shape)} must be {tuple(x.shape)}, contiguous rows")
    r_out = torch.empty_like(x) if residual_out is None else residual_out
    if r_out.data_ptr() in (x.data_ptr(), residual.data_ptr()):
        raise ValueError("residual_out must not alias x or residual")
    return r_out


def _check_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, K: int) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, *] with a contiguous last axis, got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} must be [N, {K}] with contiguous rows")
    if weight.dtype != x.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x and weight must share one dtype among fp16/bf16/fp32, got {x.dtype}, {weight.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{weight.shape[0]}]")


def _prologue_gemv(prologue: int, x: torch.Tensor, K: int, weight: torch.Tensor, bias, residual, norm_weight,
                   r_out, eps: float, out: torch.Tensor | None, config) -> torch.Tensor:
    """Launch `_prologue_gemv_kernel`; returns ``out [M, N]``. ``x`` is ``[M, K]`` (``[M, 2K]``
    for SiLU-and-mul); the tile comes from Chapter 8's `pick_config` for a plain GEMV of
    this shape (the prologue adds a few loads from L2 to each step, not to the weights')."""
    from minillm.kernels.ch08_flat_gemm import pick_config

    M, N = x.shape[0], weight.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype) if out is None else out
    if M == 0 or N == 0:
        return out
    x_view = x[:, :K]
    if bias is not None:
        bias = bias.contiguous()
    r = residual if residual is not None else x
    nw = norm_weight if norm_weight is not None else x
    ro = r_out if r_out is not None else x

    def run(cfg, w=weight, pdl=pdl_enabled(x.device)):
        plan = _gemv_plan(prologue, x_view, w, bias is not None, residual is not None, cfg, pdl)
        launch(_prologue_gemv_kernel, plan.grid, x, r, nw, ro, w, bias, out, plan.partials, plan.counters,
               M, N, K, plan.k_per_split, float(eps), x.stride(0), r.stride(0), ro.stride(0), w.stride(0),
               out.stride(0), out.stride(1), **plan.meta)

    if config is None:
        config = _prologue_config(prologue, x_view, weight, bias, residual is not None, run)
    run(config)
    return out


#: Tiles `_prologue_config` times on a GPU, as ``(BLOCK_N, BLOCK_K, num_warps)`` (one stage, no
#: split of K). Every program redoes the prologue over its run of K (for the norm, over the whole
#: row first), a cost the weights do not pay per feature: wider tiles than Chapter 8's best
#: (2 x 2048) spread it thinner, at the price of fewer programs. On an H100 (bf16, M = 1, the 1B
#: Llama's shapes, CUDA graphs) these four were the fastest somewhere: 4 x 1024 for the norm
#: before q/k/v and gate/up, 8 x 1024 for SiLU-and-mul before down (14.1 µs, against 15.6 for
#: the two kernels) and for o, 16 x 512 for the LM head; 16 x 256 and every split-K variant
#: (2 or 4 runs) lost by 1-4 µs.
PROLOGUE_GEMV_TILES = [(4, 1024, 4), (8, 1024, 8), (16, 512, 8), (2, 2048, 4)]
#: SiLU-and-mul's prologue (two loads and an exponential per element of x, K = the MLP's width)
#: is the heaviest, and every program redoes it over all of K: only tiles at least this wide
#: are timed for it. On an H100 (the 1B Llama's down projection) 8 x 1024 was the fastest in
#: isolation (14.1 µs, 2 x 2048 14.4), and in profiled decode steps it took 14.3-15.7 µs
#: against 14.6-16.7 for 2 x 2048, which the tuner picked in some runs.
SILU_MIN_BLOCK_N = 8
#: `_prologue_config`'s tuned choices, for inspection: (prologue, with a residual, dtype, rows
#: bucket, N, K, device, rope_half) -> config.
PROLOGUE_CONFIGS: dict[tuple, object] = {}


def _prologue_config(prologue: int, x_view: torch.Tensor, weight: torch.Tensor, bias, has_residual: bool, run,
                     rope_half: int = 0):
    """The tile of a prologue GEMV: under the interpreter, for fp32, or with
    ``MINILLM_FLAT_GEMM_AUTOTUNE=0``, Chapter 8's `pick_config` for a plain GEMV of this
    shape; otherwise each of `PROLOGUE_GEMV_TILES` timed with ``run(cfg, w, pdl)`` inside a
    CUDA graph (`minillm.kernels.base.graph_ms_per_call`), over copies of the weights that
    outsize the L2 cache, and the fastest kept for the process. The launches are timed without
    PDL: chained to copies of itself, a kernel overlaps its own tail, which it does not in a model (on an H100 the
    chained timing picked 2 x 2048 for the 1B Llama's q/k/v projection, 2 µs slower in the
    decode step than 4 x 1024). Timed one launch at a time with ``do_bench`` instead, the
    choice was 1-1.5 µs off for some shapes (launch overheads that a graph does not pay).
    Call once before capturing a CUDA graph, as with any autotuner.

    The choice is shared by the row counts of one power-of-two bucket (rows per program =
    the bucket, up to 16; the rows past M are masked): an eager engine whose batch shrinks
    one request at a time then tunes and compiles five variants, not one per batch size.

    ``rope_half``: for `add_rmsnorm_gemv_rope` (half the head dim; 0 for the plain GEMVs): every
    tile is first fitted to its rotation pairs (`_rope_tile`), and tuned under its own key."""
    from minillm.kernels.ch08_flat_gemm import GEMV_MAX_ROWS, TileConfig, pick_config

    fit = (lambda cfg: _rope_tile(cfg, rope_half)) if rope_half else (lambda cfg: cfg)
    autotune = os.environ.get("MINILLM_FLAT_GEMM_AUTOTUNE", "1") != "0"
    if not x_view.is_cuda or interpreting() or x_view.dtype == torch.float32 or not autotune:
        return fit(pick_config("gemv", x_view, weight, bias))
    M, K = x_view.shape
    N = weight.shape[0]
    rows = min(power_of_2_at_least(M), GEMV_MAX_ROWS)
    key = (prologue, has_residual, x_view.dtype, rows, N, K, x_view.device, rope_half)
    cfg = PROLOGUE_CONFIGS.get(key)
    if cfg is None:
        n_copies = l2_copies(weight.numel() * weight.element_size(), x_view.device, most=16)
        copies = [weight] + [torch.empty_like(weight) for _ in range(n_copies - 1)]
        best = math.inf
        tried = set()
        for block_n, block_k, warps in PROLOGUE_GEMV_TILES:
            if prologue == PROLOGUE_SILU_MUL and block_n < SILU_MIN_BLOCK_N:
                continue
            cand = fit(TileConfig(rows, block_n, block_k, warps, 1))
            if cand in tried:
                continue
            tried.add(cand)
            fns = [lambda w=w, cand=cand: run(cand, w, False) for w in copies]
            with unrecorded():  # timing runs, not part of the call
                ms = graph_ms_per_call(fns, -(-48 // len(fns)) * len(fns), replays=7)
            if ms < best:
                cfg, best = cand, ms
        del copies
        PROLOGUE_CONFIGS[key] = cfg
    return cfg


def add_rmsnorm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                     residual_out: torch.Tensor | None = None, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(add_rmsnorm(x, residual, norm_weight, eps)[0], weight, bias), x + residual)``
    in one kernel: `add_rmsnorm` folded into Chapter 8's GEMV, for decode steps of a few rows.

    - ``x, residual: [M, K]`` (rows may be strided, the last axis contiguous); ``residual=None``
      (the first layer): no add, the residual returned is ``x`` itself;
    - ``norm_weight: [K]``; ``weight: [N, K]`` with contiguous rows; ``bias: [N]`` or None;
    - ``out: [M, N]``, ``residual_out: [M, K]``: optional outputs (``residual_out`` must not
      be ``x`` or ``residual``: every program reads them, one writes it).
    - ``config``: a `minillm.kernels.ch08_flat_gemm.TileConfig` (default: `pick_config`'s).

    Every program recomputes its rows' ``1/rms`` from the whole row (a few KB from L2) and
    normalises x as it loads it, rounding as `add_rmsnorm` rounds: the product equals the
    unfused pair's up to the order of the fp32 sums."""
    K = x.shape[-1]
    _check_gemv(x, weight, bias, K)
    r_out = _norm_residual_out(x, residual, norm_weight, residual_out)
    y = _prologue_gemv(PROLOGUE_ADD_RMSNORM, x, K, weight, bias, residual, norm_weight,
                       None if residual is None else r_out, eps, out, config)
    return y, r_out


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """``linear(silu_mul(gate_up), weight, bias)`` in one kernel: ``gate_up [M, 2I]`` (gate
    columns first, contiguous rows), ``weight [N, I]``, ``bias [N]`` or None -> ``[M, N]``.
    SwiGLU's activation is computed as the GEMV loads its x, rounded as `silu_mul` rounds."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [M, 2I], got {tuple(gate_up.shape)}")
    inter = gate_up.shape[1] // 2
    _check_gemv(gate_up, weight, bias, inter)
    return _prologue_gemv(PROLOGUE_SILU_MUL, gate_up, inter, weight, bias, None, None, None, 0.0, out, config)


def decode_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """``linear(x, weight, bias)`` by the same kernel with nothing folded in (``x [M, K]``,
    contiguous last axis): Chapter 8's GEMV, launched as a programmatic dependent launch
    where `pdl_enabled`, so that it chains with the fused kernels around it."""
    _check_gemv(x, weight, bias, x.shape[-1])
    return _prologue_gemv(PROLOGUE_NONE, x, x.shape[-1], weight, bias, None, None, None, 0.0, out, config)


# ----------------------------------------------------------------------------------------
# 6. The q/k/v GEMV with the rotary embedding and the cache write folded into its end
# ----------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _rope_gemv_kernel(X, R, NormW, R_out, W, Bias, Cos, Sin, Slots, Q_out, K_cache, V_cache,
                      M, K, eps, num_heads, kv_heads, block_size, num_slots,
                      stride_xm, stride_rm, stride_rom, stride_wn, stride_ct, stride_st, stride_ot, stride_oh,
                      stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
                      HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
                      EARLY_W: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """`add_rmsnorm_gemv` on the merged q/k/v weight, ending as `rope_write_kv` does instead of
    with a store of the projection. Program ``(i, j)``: rows ``i·ROWS …`` and ``PAIRS =
    BLOCK_N / 2`` rotation pairs of one head: features ``c … c + PAIRS`` of its first half and
    the same of its second (``c + HALF …``), the two runs of W's rows the rotation mixes. So
    the rotation happens in registers, in the program that computed both halves, and the
    projection never goes to memory: a q head's rotated features go to ``Q_out``, a k head's
    to the k cache and a v head's (unrotated) to the v cache, at the row's slot (none outside
    ``[0, num_slots)``). Rows of W are 4 KB runs at the 1B Llama's width either way, so
    reading two runs of ``PAIRS`` rows costs what one run of ``BLOCK_N`` does. No split of K
    (the rotation needs the whole dot). ``HALF % PAIRS == 0``: a program never straddles heads.
    On an H100 (1B Llama, one sequence, context 128, CUDA graph) the kernel took 6.2 µs a layer
    where the pair took 5.8 + 4.9, and the step went from 1.051 to 0.978 ms.

    With ``PDL`` the program lets the next kernel launch only once its dots are done, not right
    after its wait as `_prologue_gemv_kernel` does: attention, launched early beside the GEMV's
    hundreds of programs, ended 8.8 µs after it instead of 5.4 (on the H100, as above; the step
    1.024 ms against 0.968). Its few programs have nothing to prefetch, only a launch to hide."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    PAIRS: tl.constexpr = BLOCK_N // 2
    head = pid_n // (HALF // PAIRS)
    c = (pid_n % (HALF // PAIRS)) * PAIRS
    # Tile row 2p + s: pair p's first (s = 0) or second (s = 1) half.
    offs_r = tl.arange(0, BLOCK_N)
    w_rows = (head * 2 * HALF + (offs_r % 2) * HALF + c + offs_r // 2).to(tl.int64)
    m0 = pid_m * ROWS
    DT = Q_out.dtype.element_ty
    acc = _prologue_gemv_tile(X, R, NormW, R_out, W, w_rows, m0, M, K, 0, K, eps, stride_xm, stride_rm, stride_rom,
                              stride_wn, pid_n == 0, DT, 1, HAS_RESIDUAL, EVEN_K, PDL, EARLY_W,
                              ROWS, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_H, True)  # PROLOGUE 1: the norm; [BLOCK_N, BLOCK_M]
    if PDL:  # the next kernel (attention) launches as this one's programs finish their dots
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc += tl.load(Bias + w_rows).to(tl.float32)[:, None]
    y = acc.to(DT)  # the projection, rounded as its store would round it
    x1, x2 = tl.split(tl.permute(tl.reshape(y, (PAIRS, 2, BLOCK_M)), (0, 2, 1)))       # [PAIRS, BLOCK_M] each

    cols = tl.arange(0, BLOCK_M)
    row_ok = (cols < ROWS) & (m0 + cols < M)
    rows = tl.minimum(m0 + cols, M - 1).to(tl.int64)
    offs_c = c + tl.arange(0, PAIRS)
    cs = tl.load(Cos + rows[None, :] * stride_ct + offs_c[:, None]).to(tl.float32)
    sn = tl.load(Sin + rows[None, :] * stride_st + offs_c[:, None]).to(tl.float32)
    slot = tl.load(Slots + rows).to(tl.int64)
    r1, r2 = _rotate_half(x1.to(tl.float32), x2.to(tl.float32), cs, sn, DT)

    head_m = head + tl.zeros_like(cols)  # per row: a scalar bool in a mask trips the interpreter (Triton 3.9)
    is_q = head_m < num_heads
    is_k = (head_m >= num_heads) & (head_m < num_heads + kv_heads)
    is_v = head_m >= num_heads + kv_heads
    q_dst = Q_out + rows[None, :] * stride_ot + tl.minimum(head, num_heads - 1) * stride_oh + offs_c[:, None]
    in_half = offs_c[:, None] < HALF  # all true: spells the masks out to their full [PAIRS, BLOCK_M] shape
    q_mask = in_half & (row_ok & is_q)[None, :]
    tl.store(q_dst, r1, mask=q_mask)
    tl.store(q_dst + HALF, r2, mask=q_mask)
    ok = row_ok & (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    kv_h = tl.maximum(head - num_heads - tl.where(is_v, kv_heads, 0), 0)
    CT = K_cache.dtype.element_ty
    k_dst = K_cache + (slot // block_size) * stride_kcb + (slot % block_size) * stride_kco + kv_h * stride_kch
    k_mask = in_half & (ok & is_k)[None, :]
    tl.store(k_dst[None, :] + offs_c[:, None], r1.to(CT), mask=k_mask)
    tl.store(k_dst[None, :] + HALF + offs_c[:, None], r2.to(CT), mask=k_mask)
    v_dst = V_cache + (slot // block_size) * stride_vcb + (slot % block_size) * stride_vco + kv_h * stride_vch
    v_mask = in_half & (ok & is_v)[None, :]
    tl.store(v_dst[None, :] + offs_c[:, None], x1.to(CT), mask=v_mask)
    tl.store(v_dst[None, :] + HALF + offs_c[:, None], x2.to(CT), mask=v_mask)


def _rope_tile(cfg, half: int):
    """``cfg`` fitted to `_rope_gemv_kernel`: ``BLOCK_N / 2`` pairs that divide ``half`` (the
    largest power of two dividing both), no split of K."""
    pairs = math.gcd(max(1, cfg.block_n // 2), half)
    return dataclasses.replace(cfg, block_n=2 * pairs, split_k=1)


def add_rmsnorm_gemv_rope(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int, cos: torch.Tensor,
                          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, *, q_out: torch.Tensor | None = None,
                          residual_out: torch.Tensor | None = None, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rmsnorm_gemv` on the merged q/k/v projection followed by `rope_write_kv`, in one
    kernel; returns ``(q, x + residual)`` with ``q [M, num_heads, D]`` rotated (in ``q_out``
    if given) and the rotated k and the v of each row written to its cache slot.

    - ``x, residual, norm_weight, eps, residual_out``: as `add_rmsnorm_gemv`;
    - ``weight: [(num_heads + 2·Hkv)·D, K]`` (q heads, then k, then v; contiguous rows),
      ``bias`` the same rows or None;
    - ``cos, sin: [M, D]``, ``k_cache, v_cache: [num_blocks, block_size, Hkv, D]``,
      ``slot_mapping: [M]``: as `rope_write_kv` (``D`` even; ``-1``: nothing written);
    - ``config``: a `TileConfig` (fitted to the rotation pairs by `_rope_tile`; default tuned).
    """
    K = x.shape[-1]
    _check_gemv(x, weight, bias, K)
    M = x.shape[0]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} must be [blocks, block_size, Hkv, D]")
    num_blocks, block_size, Hkv, D = k_cache.shape
    if D % 2 or weight.shape[0] != (num_heads + 2 * Hkv) * D:
        raise ValueError(f"weight {tuple(weight.shape)} must have (num_heads + 2·Hkv)·D = "
                         f"{(num_heads + 2 * Hkv) * D} rows, D even (D = {D})")
    if cos.shape != (M, D) or sin.shape != (M, D) or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)} must be [{M}, {D}], contiguous rows")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last axis must be contiguous")
    if tuple(slot_mapping.shape) != (M,) or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be a contiguous [{M}]")
    r_out = _norm_residual_out(x, residual, norm_weight, residual_out)
    q_out = torch.empty((M, num_heads, D), device=x.device, dtype=x.dtype) if q_out is None else q_out
    if q_out.shape != (M, num_heads, D) or q_out.stride(-1) != 1:
        raise ValueError(f"q_out {tuple(q_out.shape)} must be [{M}, {num_heads}, {D}], contiguous heads")
    if M == 0:
        return q_out, r_out
    half = D // 2
    if bias is not None:
        bias = bias.contiguous()
    r = residual if residual is not None else x
    ro = r_out if residual is not None else x

    def run(cfg, w=weight, pdl=pdl_enabled(x.device)):
        meta = dict(HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, EVEN_K=K % cfg.block_k == 0,
                    PDL=pdl, EARLY_W=PROLOGUE_ADD_RMSNORM in EARLY_W_PROLOGUES, ROWS=cfg.block_m,
                    BLOCK_M=power_of_2_at_least(cfg.block_m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                    BLOCK_H=power_of_2_at_least(K), HALF=half, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages)
        if pdl:
            meta["launch_pdl"] = True
        grid = (triton.cdiv(M, cfg.block_m), weight.shape[0] // cfg.block_n)
        launch(_rope_gemv_kernel, grid, x, r, norm_weight, ro, w, bias, cos, sin, slot_mapping, q_out, k_cache,
               v_cache, M, K, float(eps), num_heads, Hkv, block_size, num_blocks * block_size,
               x.stride(0), r.stride(0), ro.stride(0), w.stride(0), cos.stride(0), sin.stride(0), q_out.stride(0),
               q_out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
               v_cache.stride(1), v_cache.stride(2), **meta)

    config = _prologue_config(PROLOGUE_ADD_RMSNORM, x, weight, bias, residual is not None, run, half) \
        if config is None else _rope_tile(config, half)
    run(config)
    return q_out, r_out
