"""Chapter 2: the KV cache, as two Triton kernels.

The notebook ``chapters/02_kv_cache.ipynb`` tells the chapter's story with its measurements;
this docstring summarises what the code does.

During generation, every new token needs the keys and values of all the tokens before it.
Recomputing them each step costs a whole prefill per token; the KV cache stores them once
and each decode step then only

1. **writes** the new token's K and V rows into the cache (`write_kv`), and
2. **reads** the whole cache once to attend from the new token's query (`decode_attention`).

Layout (the one of `minillm.model.torch_model.KVCache`): per layer, ``k_cache, v_cache:
[batch, kv_heads, max_len, head_dim]``, slot ``p`` of a sequence holding its token at position
``p``. Each sequence of the batch has its own length (``seq_lens``), so sequences of different
lengths share one batch; the slots past a sequence's length are never read.

Decode attention is *memory bound*: for each sequence it reads ``2·kv_heads·L·head_dim``
cache elements and does only ``4·q_heads·L·head_dim`` FLOPs with them, i.e. ``group``
FLOPs per byte in bf16 (``group = q_heads // kv_heads``, 4 for Llama-3-8B), where an H100
needs some 300 FLOPs per byte to keep its tensor cores busy. So the kernel is judged by the
bandwidth it reaches (`minillm.costs.decode_attention_bytes` / time), and its design goal is to read every
K/V element exactly once: under GQA one program serves all the query heads that share a KV
head, instead of one program per query head re-reading it.

Shapes are documented per function; any strides are accepted (no copies are made).
"""
from __future__ import annotations

import torch
from minillm.kernels.base import (  # Triton as this machine runs it, and the shared helpers
    tl, triton,
    LN2_C, LOG2E, block_d, dot_precision, online_softmax_update, power_of_2_at_least, scale_and_window,
)


# ----------------------------------------------------------------------------------------
# Writing new tokens into the cache
# ----------------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(
    K_new, V_new, K_cache, V_cache, Slots,
    stride_knb, stride_knh, stride_knt, stride_knd,
    stride_vnb, stride_vnh, stride_vnt, stride_vnd,
    stride_kcb, stride_kch, stride_kcn, stride_kcd,
    stride_vcb, stride_vch, stride_vcn, stride_vcd,
    stride_sb, stride_st,
    n_tokens, kv_heads, head_dim, max_len,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``(b·n_tokens + t, j)`` copies heads ``j·BLOCK_H …`` of token ``t`` of sequence ``b``.

    Why one program per *token* (and a block of heads) rather than per (token, head): the
    slot is read once and the whole ``[heads, head_dim]`` tile of K and of V moves in one
    go, so each program has a few KB of loads in flight at once (a program per head would
    move only ``head_dim`` elements, too little to be worth a program). The head axis is
    split into blocks only so that the tile stays small enough for registers when
    ``kv_heads · head_dim`` is large (MHA with big heads).
    """
    pid_bt, pid_h = tl.program_id(0), tl.program_id(1)
    # int64: the cache of a long-context batch is past 2^31 elements (64 seqs x 8 heads x 32k x 128).
    b = (pid_bt // n_tokens).to(tl.int64)
    t = (pid_bt % n_tokens).to(tl.int64)

    slot = tl.load(Slots + b * stride_sb + t * stride_st).to(tl.int64)
    # A negative slot is padding (e.g. a shorter prompt in a batch of prefills): write
    # nothing. Slots past the end are skipped too, so a bad slot can never write outside
    # the cache (checking on the host would need a GPU->CPU sync on every decode step).
    # Such a token simply has zero heads to copy, which folds the test into the mask.
    heads_to_copy = tl.where((slot >= 0) & (slot < max_len), kv_heads, 0)

    offs_h = (pid_h * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < heads_to_copy) & (offs_d[None, :] < head_dim)

    k = tl.load(K_new + b * stride_knb + t * stride_knt + offs_h[:, None] * stride_knh + offs_d[None, :] * stride_knd,
                mask=mask)
    v = tl.load(V_new + b * stride_vnb + t * stride_vnt + offs_h[:, None] * stride_vnh + offs_d[None, :] * stride_vnd,
                mask=mask)
    tl.store(K_cache + b * stride_kcb + slot * stride_kcn + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
             k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(V_cache + b * stride_vcb + slot * stride_vcn + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
             v.to(V_cache.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store new K/V rows into the cache, in place: ``cache[b, :, slots[b, t]] = new[b, :, t]``.

    - ``k_cache, v_cache: [batch, kv_heads, max_len, head_dim]``, written in place;
    - ``k_new, v_new: [batch, kv_heads, T, head_dim]``, the rows of ``T`` new tokens per
      sequence (``T = 1`` when decoding, the prompt length in prefill); cast to the cache's
      dtype on the way;
    - ``slots: [batch, T]``, any integer dtype: the cache slot of each new token. Each
      sequence may be at its own position, and slots need not be contiguous or sorted. A
      negative slot means "padding: write nothing", and so does a slot ``>= max_len``
      (never out of bounds; not reported, as checking would cost a device sync). If two
      tokens of one sequence name the same slot, which one lands is unspecified.
    """
    batch, kv_heads, max_len, head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if k_new.shape != v_new.shape:
        raise ValueError(f"k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)} differ")
    n_tokens = k_new.shape[2]
    if k_new.dim() != 4 or (k_new.shape[0], k_new.shape[1], k_new.shape[3]) != (batch, kv_heads, head_dim):
        raise ValueError(f"k_new {tuple(k_new.shape)} does not match the cache {tuple(k_cache.shape)} "
                         "(expected [batch, kv_heads, T, head_dim])")
    if tuple(slots.shape) != (batch, n_tokens):
        raise ValueError(f"slots {tuple(slots.shape)} must be [batch, T] = {(batch, n_tokens)}")
    if slots.dtype.is_floating_point or slots.dtype == torch.bool:
        raise TypeError(f"slots must be an integer tensor, got {slots.dtype}")
    if batch * n_tokens == 0:
        return
    BLOCK_D = power_of_2_at_least(head_dim)
    # At most ~4k elements per tensor per program (16 KB of fp32 registers over 4 warps).
    BLOCK_H = min(power_of_2_at_least(kv_heads), max(1, 4096 // BLOCK_D))
    grid = (batch * n_tokens, triton.cdiv(kv_heads, BLOCK_H))
    _write_kv_kernel[grid](
        k_new, v_new, k_cache, v_cache, slots,
        *k_new.stride(), *v_new.stride(), *k_cache.stride(), *v_cache.stride(), *slots.stride(),
        n_tokens, kv_heads, head_dim, max_len,
        BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, num_warps=4,
    )


# ----------------------------------------------------------------------------------------
# Attention of one new token over the cache
# ----------------------------------------------------------------------------------------
@triton.jit
def _decode_attention_kernel(
    Q, K, V, SeqLens, O, LSE,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_sl,
    stride_ob, stride_oh, stride_od,
    stride_lb, stride_lh,
    group_size, head_dim, max_len, qk_scale,
    DOT_PRECISION: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``(b, kv_h)``: the ``group_size`` query heads of sequence ``b`` that read KV
    head ``kv_h``, over the first ``seq_lens[b]`` slots of the cache.

    The group's queries form the rows of one ``[GROUP_PAD, BLOCK_D]`` block, so each K/V tile
    is loaded from HBM once and used by every query head of the group (``tl.dot`` needs at
    least 16 rows: the group is padded with zero rows that are never stored).
    """
    b, kv_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # int64: huge caches

    offs_g = tl.arange(0, GROUP_PAD)
    in_g = offs_g < group_size
    heads = kv_h * group_size + offs_g  # the query heads of this group (consecutive, as in Llama)
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < head_dim

    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=in_g[:, None] & in_d[None, :], other=0.0)
    # Clamp the length into [0, max_len]: a bad length must not read outside the cache.
    seq_len = tl.minimum(tl.maximum(tl.load(SeqLens + b * stride_sl), 0), max_len)

    k_base = K + b * stride_kb + kv_h * stride_kh + offs_d[None, :] * stride_kd
    v_base = V + b * stride_vb + kv_h * stride_vh + offs_d[None, :] * stride_vd

    # Online softmax (Chapter 3 derives it; `online_softmax_update` does it): the cache is
    # read once, tile by tile, keeping per query row the running max `m`, the running sum `l`
    # of 2^(x - m), and `acc`, the sum of 2^(x - m)·v *not yet divided by l*. The scores `x`
    # are in log2 units (qk_scale = scale · log2 e: base-2 exponentials are the GPU's cheap
    # ones). When a tile raises the max, everything accumulated so far is rescaled by
    # alpha = 2^(m_old - m_new). Dividing by l happens once, at the end.
    m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, BLOCK_D), dtype=tl.float32)

    for start in range(0, seq_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_n = offs_n < seq_len
        rows = offs_n.to(tl.int64)[:, None]  # int64: slot x row stride can pass 2^31 in strided layouts
        k = tl.load(k_base + rows * stride_kn, mask=in_n[:, None] & in_d[None, :], other=0.0)
        # fp32 inputs: exact fp32 products ("ieee"); fp16/bf16: tensor cores, fp32 accumulation.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = tl.where(in_n[None, :], s * qk_scale, float("-inf"))  # [GROUP_PAD, BLOCK_N], fp32, log2 units
        p, alpha, l, m = online_softmax_update(m, l, s, qk_scale, True)

        v = tl.load(v_base + rows * stride_vn, mask=in_n[:, None] & in_d[None, :], other=0.0)
        # P is rounded to the cache dtype for the tensor-core dot, as in FlashAttention (a no-op in fp32).
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    # seq_len = 0: the loop never ran, l = 0 and m = -inf -> output 0 and lse = -inf,
    # which is what the reference gives for a row with no visible key.
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    lse = (m + tl.math.log2(l)) * LN2_C  # back to natural log
    tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=in_g[:, None] & in_d[None, :])
    tl.store(LSE + b * stride_lb + heads * stride_lh, lse, mask=in_g)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float | None = None, out: torch.Tensor | None = None,
                     lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new query token per sequence over its cached keys and values.

    - ``q: [batch, q_heads, head_dim]``, the query of each sequence's newest token;
    - ``k_cache, v_cache: [batch, kv_heads, max_len, head_dim]`` with
      ``q_heads % kv_heads == 0`` (MHA, GQA, MQA); query head ``h`` reads KV head
      ``h // (q_heads // kv_heads)``;
    - ``seq_lens: [batch]`` integers (int32): sequence ``b`` attends to slots
      ``0 … seq_lens[b] - 1`` (the new token's own K/V must already be written there).
      Length 0 gives a zero output and ``lse = -inf``; lengths are clamped to ``[0, max_len]``;
    - ``scale`` defaults to ``1/sqrt(head_dim)`` and must be positive.

    Returns ``(out, lse)``: ``out: [batch, q_heads, head_dim]`` in q's dtype and
    ``lse: [batch, q_heads]`` float32, the natural-log log-sum-exp of each score row (as
    `minillm.reference.ch01_naive_attention` returns). ``out``/``lse`` may be given preallocated.

    One program per (sequence, KV head): ``batch · kv_heads`` programs. At small batch that
    is fewer programs than the GPU has SMs, and each walks the whole sequence alone; the
    benchmark shows what that costs at long contexts, and splitting the sequence across
    programs (flash-decoding) is the remedy.
    """
    batch, q_heads, head_dim = q.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be "
                         "[batch, kv_heads, max_len, head_dim] and equal")
    _, kv_heads, max_len, _ = k_cache.shape
    if k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} must be a multiple of kv_heads={kv_heads} (MHA/GQA/MQA)")
    if tuple(seq_lens.shape) != (batch,) or seq_lens.dtype.is_floating_point:
        raise ValueError(f"seq_lens must be an integer tensor [batch] = [{batch}], got "
                         f"{tuple(seq_lens.shape)} {seq_lens.dtype}")
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim={head_dim}: 1..256 supported (one query block lives in registers)")
    scale, _ = scale_and_window(head_dim, scale, None)
    if out is None:
        out = torch.empty(batch, q_heads, head_dim, device=q.device, dtype=q.dtype)
    if lse is None:
        lse = torch.empty(batch, q_heads, device=q.device, dtype=torch.float32)
    if batch * q_heads == 0:
        return out, lse

    group = q_heads // kv_heads
    BLOCK_D = block_d(head_dim)  # tl.dot needs every dim >= 16
    GROUP_PAD = max(16, power_of_2_at_least(group))
    # Tiles of 32 KB (128 x 128 in bf16): with num_stages=3 the loads of the next tiles are
    # in flight (in shared memory) while one is used, and a single program needs that much
    # outstanding to pull a fair share of HBM bandwidth. Measured on an H200 (bf16, head_dim
    # 128): BLOCK_N = 128 with 8 warps ran 1.4x faster than BLOCK_N = 64 at batch 1 and 8;
    # at batch 32 every BLOCK_N from 32 to 128 reached the same bandwidth.
    BLOCK_N = min(128, max(16, 32768 // (BLOCK_D * k_cache.element_size())))
    _decode_attention_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, seq_lens, out, lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), seq_lens.stride(0),
        *out.stride(), *lse.stride(),
        group, head_dim, max_len, scale * LOG2E,
        DOT_PRECISION=dot_precision(q.dtype), GROUP_PAD=GROUP_PAD, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        num_warps=8, num_stages=3,
    )
    return out, lse
