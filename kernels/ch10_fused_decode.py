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

import torch

from minillm.kernels.base import head_dim_offsets, launch, tl, triton

__all__ = ["add_rmsnorm", "exponential_race", "race_uniforms", "rope_write_kv", "silu_mul"]


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
    BLOCK = triton.next_power_of_2(hidden)
    num_warps = 4 if BLOCK <= 2048 else 8
    launch(_add_rmsnorm_kernel, (T,), x, r_in, weight, out, r_out, x.stride(0), r_in.stride(0), out.stride(0),
           r_out.stride(0), hidden, float(eps), HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, num_warps=num_warps)
    return out, r_out


# ----------------------------------------------------------------------------------------
# 2. Rotary embedding of q and k + the paged cache write
# ----------------------------------------------------------------------------------------
@triton.jit
def _rotate_half(X, stride_h, offs_h, h_ok, offs_i, i_ok, c, s, Like, HALF: tl.constexpr):
    """Load heads ``offs_h`` of one token and rotate them: ``[x₁·c - x₂·s, x₂·c + x₁·s]``,
    each product and each sum rounded to the element type ``DT`` of the pointer ``Like`` (the
    output) as the torch model's ``x·cos + rotate_half(x)·sin`` rounds. Returns the two halves
    ``[BLOCK_H, BLOCK_I]`` in ``DT``."""
    DT = Like.dtype.element_ty
    mask = h_ok[:, None] & i_ok[None, :]
    base = X + offs_h[:, None] * stride_h + offs_i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
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
):
    """Program ``t``: token ``t``, every head. Rotates its q heads into ``Q_out`` and its k
    heads into the k cache at ``Slots[t]``, and copies its v heads to the v cache there. A
    slot outside ``[0, num_slots)`` (``-1``: padding) writes no K/V; q is rotated anyway."""
    t = tl.program_id(0).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_I)
    i_ok = offs_i < HALF
    offs_i = tl.minimum(offs_i, HALF - 1)          # padding columns: clamped, masked
    # The angles of this token: the first half of its cos/sin rows (the second repeats it).
    c = tl.load(Cos + t * stride_ct + offs_i).to(tl.float32)[None, :]
    s = tl.load(Sin + t * stride_st + offs_i).to(tl.float32)[None, :]

    offs_hq = tl.arange(0, BLOCK_HQ)
    hq_ok = offs_hq < num_heads
    offs_hq = tl.minimum(offs_hq, num_heads - 1).to(tl.int64)
    q1, q2 = _rotate_half(Q + t * stride_qt, stride_qh, offs_hq, hq_ok, offs_i, i_ok, c, s, Q_out, HALF)
    q_dst = Q_out + t * stride_ot + offs_hq[:, None] * stride_oh + offs_i[None, :]
    q_mask = hq_ok[:, None] & i_ok[None, :]
    tl.store(q_dst, q1, mask=q_mask)
    tl.store(q_dst + HALF, q2, mask=q_mask)

    slot = tl.load(Slots + t).to(tl.int64)
    ok = (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0)
    blk = slot // block_size
    off = slot % block_size
    offs_hk = tl.arange(0, BLOCK_HK)
    hk_ok = offs_hk < tl.where(ok, kv_heads, 0)     # a token without a slot: no heads to write
    offs_hk = tl.minimum(offs_hk, kv_heads - 1).to(tl.int64)
    CT = K_cache.dtype.element_ty
    k1, k2 = _rotate_half(K + t * stride_kt, stride_kh, offs_hk, hk_ok, offs_i, i_ok, c, s, Q_out, HALF)
    kv_mask = hk_ok[:, None] & i_ok[None, :]
    k_dst = K_cache + blk * stride_kcb + off * stride_kco + offs_hk[:, None] * stride_kch + offs_i[None, :]
    tl.store(k_dst, k1.to(CT), mask=kv_mask)
    tl.store(k_dst + HALF, k2.to(CT), mask=kv_mask)
    v_src = V + t * stride_vt + offs_hk[:, None] * stride_vh + offs_i[None, :]
    v_dst = V_cache + blk * stride_vcb + off * stride_vco + offs_hk[:, None] * stride_vch + offs_i[None, :]
    tl.store(v_dst, tl.load(v_src, mask=kv_mask).to(CT), mask=kv_mask)
    tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=kv_mask).to(CT), mask=kv_mask)


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
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} must be [blocks, block_size, {Hkv}, {D}]")
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
           HALF=half, BLOCK_I=triton.next_power_of_2(half), BLOCK_HQ=triton.next_power_of_2(H),
           BLOCK_HK=triton.next_power_of_2(Hkv), num_warps=4)
    return q_out


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
    BLOCK = min(1024, triton.next_power_of_2(inter))
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
    BLOCK = min(4096, triton.next_power_of_2(vocab))
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
        BLOCK = min(1024, triton.next_power_of_2(vocab))
        launch(_race_uniforms_kernel, (B, triton.cdiv(vocab, BLOCK)), seeds, positions, u, u.stride(0), vocab,
               BLOCK=BLOCK, num_warps=4)
    return u
