"""Chapter 4 reference: FP8 attention with block quantization and incoherent processing, in NumPy.

The reference of `minillm.kernels.ch04_flash_attention_hopper.flash_attention_fp8`
(FlashAttention-3's FP8 forward; Shah et al., 2024). Everything is float64; the e4m3 format is
simulated by rounding (`round_e4m3`), so no FP8 support is needed.

- **e4m3** (``torch.float8_e4m3fn``): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits;
  normal numbers from ``2^-6`` to 448, subnormals down to ``2^-9``, no infinities. A normal
  value rounds to within a relative ``2^-4`` (`UNIT_ROUNDOFF`), a subnormal to within an
  absolute ``2^-10``.
- **Block quantization** (`quantize_blocks`): one scale per block of rows (the kernel's tile
  of queries or keys), chosen so the block's largest magnitude maps to 448. An outlier then
  coarsens only its own block.
- **Incoherent processing** (`random_hadamard`): Q and K are multiplied by the same random
  orthogonal matrix before quantizing. ``(QR)(KR)ᵀ = QKᵀ``, so the scores are unchanged, but
  each rotated coordinate mixes all the original ones: an outlier coordinate is spread out,
  the block maxima drop, and so do the rounding errors of everything else in the block.
- `fp8_attention`: exact attention of the dequantized (optionally rotated) inputs. The kernel
  also rounds the probabilities P to e4m3 for the P·V matmul; `p_rounding_bound` is the
  elementwise bound that adds to the output error.
- `exp2_polynomial`: ``2^x`` without the special-function unit, as the Gluon kernels can compute
  a share of the softmax's exponentials (``fma_exp2``; FlashAttention-4's software exponential,
  Zadouri et al., 2026, arXiv 2603.05451): round ``x`` to an integer ``n`` by adding
  ``1.5·2^23`` (the float adder does the rounding), a cubic in the remainder ``f`` in
  ``[-1/2, 1/2]`` for ``2^f``, and ``n`` added into the exponent bits. Relative error below
  `EXP2_POLY_REL_ERROR`.
"""
from __future__ import annotations

import numpy as np

from minillm.reference.ch01_naive_attention import attention, attention_mask, kv_head_for

E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXP = -6   # smallest normal: 2^-6
E4M3_MANTISSA_BITS = 3
#: Relative rounding error bound of a normal e4m3 number (round to nearest: half an ulp).
UNIT_ROUNDOFF = 2.0 ** -(E4M3_MANTISSA_BITS + 1)
#: Absolute rounding error bound of a subnormal e4m3 number (half of the spacing 2^-9).
SUBNORMAL_ABS_ERROR = 2.0 ** (E4M3_MIN_NORMAL_EXP - E4M3_MANTISSA_BITS - 1)


def round_e4m3(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to the nearest e4m3 value (ties to even), saturating at ±448."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    with np.errstate(divide="ignore"):
        exp = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    exp = np.maximum(exp, E4M3_MIN_NORMAL_EXP)           # below 2^-6: the subnormal spacing
    step = 2.0 ** (exp - E4M3_MANTISSA_BITS)              # the spacing of e4m3 numbers near a
    rounded = np.minimum(np.round(a / step) * step, E4M3_MAX)  # np.round: ties to even
    return np.sign(x) * rounded


#: ``2^f ≈ c0 + c1 f + c2 f² + c3 f³`` on ``[-1/2, 1/2]``: fp32 coefficients fitted for the
#: smallest largest relative error (Lawson's iteration of weighted least squares).
EXP2_POLY_COEFFS = (0.9999281167984009, 0.6932609677314758, 0.24261054396629333, 0.05517132207751274)
#: The cubic's largest relative error on ``[-1/2, 1/2]`` (7.5e-5 measured on a fine grid), with
#: room for fp32 rounding: far below bf16's 2^-9 and e4m3's 2^-4, the roundings P meets next.
EXP2_POLY_REL_ERROR = 1e-4
#: ``x + 1.5·2^23`` in fp32 lands where the spacing of floats is 1: the sum is ``x`` rounded to
#: the nearest integer, and its low mantissa bits hold that integer.
ROUND_MAGIC = 12582912.0
#: Inputs are clamped here first: ``2^x`` of anything lower (masked scores are ``-inf``) comes out
#: as ``2^-125`` or so, a normal number that no sum or e4m3 rounding downstream can see.
EXP2_POLY_MIN = -125.0


def exp2_polynomial(x: np.ndarray) -> np.ndarray:
    """``2^x`` for ``x <= 0`` in fp32 by the kernel's steps (`EXP2_POLY_COEFFS`): clamp to
    `EXP2_POLY_MIN`; ``t = x + ROUND_MAGIC`` (``n = t - ROUND_MAGIC`` is ``x`` rounded);
    ``f = x - n``; the cubic ``p(f) ≈ 2^f`` in [0.70, 1.42]; then ``n`` added to the exponent
    field of ``p`` as an integer (``t``'s bits shifted left by 23 are ``n``'s, modulo 2^32)."""
    c0, c1, c2, c3 = (np.float32(c) for c in EXP2_POLY_COEFFS)
    x = np.maximum(np.asarray(x, dtype=np.float32), np.float32(EXP2_POLY_MIN))
    t = x + np.float32(ROUND_MAGIC)
    f = x - (t - np.float32(ROUND_MAGIC))
    p = ((c3 * f + c2) * f + c1) * f + c0
    bits = p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))
    return bits.view(np.float32)


def quantize_blocks(x: np.ndarray, block_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Block quantization of ``x: [batch, heads, seq, head_dim]`` (values exact in fp32) in
    blocks of ``block_rows`` tokens (the last block may be short). Returns ``(x8, scales)``:
    ``x8`` the e4m3 values (float64 holding representable numbers, same shape as ``x``) and
    ``scales: [batch, heads, n_blocks]`` with ``x ≈ x8 · scale``; scale = block max / 448
    (1 for an all-zero block)."""
    # In fp32, as the kernel's quantizer computes: ``x / scale`` rounded to fp32 first can land
    # on the other side of an e4m3 rounding midpoint than the exact quotient (about once per
    # million elements), and the reference must round the same way.
    x = np.asarray(x, dtype=np.float32)
    seq = x.shape[2]
    n_blocks = -(-seq // block_rows)
    scales = np.ones(x.shape[:2] + (n_blocks,), dtype=np.float32)
    x8 = np.empty(x.shape)
    for i in range(n_blocks):
        rows = slice(i * block_rows, min(seq, (i + 1) * block_rows))
        amax = np.abs(x[:, :, rows]).max(axis=(-2, -1))
        scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
        scales[:, :, i] = scale
        x8[:, :, rows] = round_e4m3(x[:, :, rows] / scale[..., None, None])
    return x8, scales.astype(np.float64)


def dequantize_blocks(x8: np.ndarray, scales: np.ndarray, block_rows: int) -> np.ndarray:
    """``x8 · scale`` block by block: the values the FP8 kernel effectively multiplies."""
    idx = np.arange(x8.shape[2]) // block_rows
    return x8 * scales[:, :, idx][..., None]


def hadamard(n: int) -> np.ndarray:
    """The ``n x n`` Sylvester Hadamard matrix (entries ±1; ``n`` a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def random_hadamard(signs: np.ndarray) -> np.ndarray:
    """``diag(signs) · H / sqrt(n)``: orthogonal for any ±1 ``signs`` of length ``n``."""
    signs = np.asarray(signs, dtype=np.float64)
    return signs[:, None] * hadamard(len(signs)) / np.sqrt(len(signs))


def quantized_inputs(q: np.ndarray, k: np.ndarray, v: np.ndarray, block_m: int, block_n: int,
                     rotation: np.ndarray | None = None, v_block: int | None = None) -> tuple[np.ndarray, ...]:
    """The dequantized ``(q, k, v)`` the FP8 kernel effectively multiplies: Q in blocks of
    ``block_m`` rows, K in blocks of ``block_n``, V in blocks of ``v_block`` (default
    ``block_n``; the whole head for one scale per head), after multiplying Q and K by
    ``rotation`` (``[head_dim, head_dim]``, orthogonal) if given."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    if rotation is not None:
        q, k = q @ rotation, k @ rotation
    v_block = block_n if v_block is None else v_block
    return (dequantize_blocks(*quantize_blocks(q, block_m), block_m),
            dequantize_blocks(*quantize_blocks(k, block_n), block_n),
            dequantize_blocks(*quantize_blocks(v, v_block), v_block))


def fp8_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, block_m: int, block_n: int, causal: bool = False,
                  scale: float | None = None, rotation: np.ndarray | None = None,
                  v_block: int | None = None) -> np.ndarray:
    """Exact attention (``[batch, q_heads, q_len, head_dim]``) of the block-quantized inputs
    (`quantized_inputs`). ``scale`` defaults to ``1/sqrt(head_dim)``."""
    scale = 1.0 / np.sqrt(np.shape(q)[-1]) if scale is None else scale
    qd, kd, vd = quantized_inputs(q, k, v, block_m, block_n, rotation, v_block)
    return attention(qd, kd, vd, causal=causal, scale=scale)[0]


def online_fp8_softmax(s: np.ndarray, v: np.ndarray, block_n: int, rounded_sum: bool = True
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The FP8 kernels' softmax arithmetic in float64: ``(out [..., q, d], lse [..., q])`` of
    base-2 scores ``s: [..., q, k]`` (``-inf``: masked) and ``v: [..., k, d]``, over blocks of
    ``block_n`` keys with a running max, P rounded to e4m3 (`round_e4m3`) for P·V, and ℓ summed
    from P as rounded (``rounded_sum``, the row sums on the tensor cores) or as computed (the
    CUDA cores' sum); ``lse = m + log2 ℓ``. Rows that see no key get NaN."""
    s, v = np.asarray(s, dtype=np.float64), np.asarray(v, dtype=np.float64)
    m = np.full(s.shape[:-1], -np.inf)
    acc, ell = np.zeros(s.shape[:-1] + v.shape[-1:]), np.zeros(s.shape[:-1])
    for start in range(0, s.shape[-1], block_n):
        block = s[..., start:start + block_n]
        m_new = np.maximum(m, block.max(axis=-1))
        m_sub = np.where(np.isfinite(m_new), m_new, 0.0)  # (no -inf - -inf)
        alpha, p = np.exp2(m - m_sub), np.exp2(block - m_sub[..., None])
        p8 = round_e4m3(p)
        acc = acc * alpha[..., None] + p8 @ v[..., start:start + block_n, :]
        ell = ell * alpha + (p8 if rounded_sum else p).sum(axis=-1)
        m = m_new
    with np.errstate(divide="ignore", invalid="ignore"):
        return acc / ell[..., None], m + np.log2(ell)


def p_rounding_bound(q: np.ndarray, k: np.ndarray, v: np.ndarray, block_m: int, block_n: int,
                     causal: bool = False, scale: float | None = None,
                     rotation: np.ndarray | None = None, v_block: int | None = None,
                     unit_roundoff: float = UNIT_ROUNDOFF, rounded_sum: bool = False) -> np.ndarray:
    """Elementwise bound on ``|kernel − fp8_attention|`` from rounding P to e4m3 (``u``:
    ``unit_roundoff``, which a caller widens when p itself is approximate).

    The kernel rounds ``p = exp(s − m_run)`` (``m_run``: the running row max, ``p <= 1``) before
    the P·V matmul and sums the *unrounded* p into ℓ. A normal p moves by at most a relative
    `UNIT_ROUNDOFF`, a subnormal one by at most `SUBNORMAL_ABS_ERROR`; in units of the final
    max that absolute error only shrinks (``m_run <= m_final``). With ``p̂ = exp(s − m_final)``
    and ``ℓ = Σ p̂``, output row i is off by at most
    ``(u · Σ_j p̂_ij |v_j| + 2^-10 · Σ_j |v_j|) / ℓ_i`` (j over the visible keys), fp32
    accumulation aside.

    ``rounded_sum``: the kernel sums the *rounded* p into ℓ as well (its row sums come from the
    tensor cores, ``P · 1``). Then ``O' − O = Σ_j (p'_j − p_j)(v_j − O) / ℓ'``: with ``e_j``
    a bound on ``|p'_j − p_j|`` in units of the final max (``u · p̂_j`` for a normal p, at most
    ``min(p̂_j, 2^-10)`` for a subnormal one, since rounding to nearest never moves a value by
    more than itself), row i is off by at most ``(Σ_j e_ij |v_j| + |O_i| Σ_j e_ij) / (ℓ_i −
    Σ_j e_ij)``."""
    scale = 1.0 / np.sqrt(np.shape(q)[-1]) if scale is None else scale
    qd, kd, vd = quantized_inputs(q, k, v, block_m, block_n, rotation, v_block)
    q_heads, kv_heads = qd.shape[1], kd.shape[1]
    heads = kv_head_for(np.arange(q_heads), q_heads, kv_heads)
    kd, vd = kd[:, heads], vd[:, heads]
    s = scale * qd @ np.swapaxes(kd, -1, -2)
    visible = attention_mask(qd.shape[2], kd.shape[2], causal)
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.where(visible, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    ell = np.maximum(p.sum(axis=-1, keepdims=True), 1e-300)
    abs_v = np.abs(vd)
    if rounded_sum:
        err_p = np.maximum(unit_roundoff * p, np.minimum(p, SUBNORMAL_ABS_ERROR))
        slack = err_p.sum(axis=-1, keepdims=True)
        out = (p @ vd) / ell
        return (err_p @ abs_v + np.abs(out) * slack) / np.maximum(ell - slack, 1e-300)
    return (unit_roundoff * (p @ abs_v) + SUBNORMAL_ABS_ERROR * (visible.astype(np.float64) @ abs_v)) / ell


#: What Hopper's FP8 tensor cores keep of a running sum: about 14 bits (measured on an H800,
#: DeepSeek-AI 2024, the DeepSeek-V3 report, section 3.3.2), far fewer than fp32's 24; and
#: how many products one FP8 matrix instruction adds before it rounds into the accumulator
#: (the k of ``wgmma ... .e4m3``: 32).
FP8_ACCUMULATOR_BITS = 14
FP8_MMA_K = 32


def fp8_accumulation_bound(q: np.ndarray, k: np.ndarray, v: np.ndarray, block_m: int, block_n: int,
                           causal: bool = False, scale: float | None = None,
                           rotation: np.ndarray | None = None, v_block: int | None = None,
                           bits: int = FP8_ACCUMULATOR_BITS, mma_k: int = FP8_MMA_K,
                           rounded_sum: bool = False) -> np.ndarray:
    """Elementwise bound on what the GPU's reduced-precision FP8 accumulation adds to the error
    (zero in exact arithmetic, as under the interpreter).

    Each FP8 matrix instruction adds ``mma_k`` products into an accumulator that keeps about
    ``bits`` bits, so every such step can lose ``2^-(bits-1)`` of the running sum's magnitude.
    A score ``s_ij = scale · Σ_d q_d k_d`` (``head_dim / mma_k`` steps) is then off by at most
    ``δ_ij = ceil(head_dim / mma_k) · 2^-(bits-1) · scale · Σ_d |q_d k_d|``, which moves output
    row i by at most ``(exp(2 max_j δ_ij) − 1) · Σ_j p̂_ij |v_j| / ℓ_i``; the P·V sum over
    ``kv_len / mma_k`` steps adds ``ceil(kv_len / mma_k) · 2^-(bits-1) · Σ_j p̂_ij |v_j| / ℓ_i``
    (V's scale accumulates in place when there is one per head). ``rounded_sum``: ℓ is summed by
    the tensor cores too (``P · 1``), a sum of positive terms off by a relative ``ε = ceil(kv_len
    / mma_k) · 2^-(bits-1)`` at most, which moves the row by ``ε / (1 − ε) · |O_i|`` more."""
    scale = 1.0 / np.sqrt(np.shape(q)[-1]) if scale is None else scale
    qd, kd, vd = quantized_inputs(q, k, v, block_m, block_n, rotation, v_block)
    q_heads, kv_heads = qd.shape[1], kd.shape[1]
    heads = kv_head_for(np.arange(q_heads), q_heads, kv_heads)
    kd, vd = kd[:, heads], vd[:, heads]
    head_dim, kv_len = qd.shape[-1], kd.shape[2]
    ulp = 2.0 ** -(bits - 1)
    visible = attention_mask(qd.shape[2], kv_len, causal)
    s = np.where(visible, scale * qd @ np.swapaxes(kd, -1, -2), -np.inf)
    delta = -(-head_dim // mma_k) * ulp * scale * (np.abs(qd) @ np.swapaxes(np.abs(kd), -1, -2))
    delta = np.where(visible, delta, 0.0).max(axis=-1, keepdims=True)
    m = s.max(axis=-1, keepdims=True)
    p = np.where(visible, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    ell = np.maximum(p.sum(axis=-1, keepdims=True), 1e-300)
    weighted = (p @ np.abs(vd)) / ell
    sum_error = -(-kv_len // mma_k) * ulp
    bound = (np.expm1(2 * delta) + sum_error) * weighted
    if rounded_sum:
        bound = bound + sum_error / (1 - sum_error) * np.abs(p @ vd) / ell
    return bound

