"""Chapter 12: multi-head latent attention (DeepSeek-V2) over a paged latent cache, as Triton kernels.

The derivation and the measurements are in the notebook ``chapters/12_mla.ipynb``; the NumPy
oracle is `minillm.reference.ch12_mla`. This module is the code, main path first.

MLA caches one row per token and layer: the KV latent ``c`` (``kv_lora_rank`` wide, 512 in
DeepSeek-V2/V3) followed by the rotary key ``k^R`` shared by every head (``qk_rope_head_dim``,
64). In the **absorbed** form each head's query is folded into that space (``[W_UKᵀ q^C ;
q^R]``, ``W = kv_lora_rank + qk_rope_head_dim`` wide), and attention runs over the rows
directly: the keys are the whole rows, the values their first ``kv_lora_rank`` columns. That
is MQA with a single, very wide "KV head", and the kernels treat it so (as FlashMLA does):

1. `write_latent_cache` (`_write_latent_kernel`, one program per new token): the raw output
   of ``kv_a_proj_with_mqa`` in, the cache row out, with the latent's RMSNorm and the rotary
   key's RoPE fused into the store (the rotary key is cached rotated, in the rotate-half
   layout; see `minillm.reference.ch12_mla`).
2. `mla_decode_attention` (`_mla_split_kernel`, grid ``(batch, head blocks, splits)``): one
   query per sequence. A program holds ``BLOCK_H`` heads of one sequence as the rows of its
   dots, so each latent row is read from memory once for all of them; it walks its split's
   tiles of ``BLOCK_N`` rows through the block table (Chapter 5's `tile_rows`), scores
   ``q_c·c + q_r·k^R`` (two dots: the latent part and the rotary part), and accumulates
   ``P·c`` with Chapter 3's online softmax. A long sequence is cut into splits
   (flash-decoding, Chapter 7) whose partials Chapter 7's merge (`reduce_splits`) combines.
3. `mla_prefill_attention`: the same kernel for steps with several new tokens per sequence
   (chunked prefill, prefix hits): every new token becomes its own one-query "sequence" that
   sees the first ``position + 1`` rows of its sequence's table. No host synchronisation, so
   a CUDA graph can capture it; the model runs a fresh prompt through decompression and
   FlashAttention-2 instead (`minillm.model.mla`).

Layouts: the pool is ``[num_blocks, block_size, 1, W]`` per layer (one "KV head"; a 3-D
``[num_blocks, block_size, W]`` view is accepted too), block tables int32 ``[batch,
max_blocks]`` padded with -1, slot mappings int64 with -1 for "do not write". Queries
``[batch, heads, W]`` in the cache's dtype; outputs ``[batch, heads, kv_lora_rank]`` (the
latent output: the caller applies ``W_UV``) and the lse ``[batch, heads]`` float32.
"""
from __future__ import annotations

import functools

import torch
from minillm.kernels.base import (
    tl, triton,
    LN2_C, LOG2E, block_d, dot_precision, head_dim_offsets, interpreting, launch, num_sms, online_softmax_update,
    power_of_2_at_least,
)
from minillm.kernels.ch05_paged_attention import blocks_per_tile, tile_rows  # Chapter 5's paged tiles
from minillm.kernels.ch07_flash_decoding import MAX_SPLITS, reduce_splits  # Chapter 7's merge of splits

__all__ = ["write_latent_cache", "mla_decode_attention", "mla_prefill_attention", "mla_num_splits",
           "mla_block_n", "MAX_BLOCK_H", "MIN_SPLIT_KEYS"]


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------
@triton.jit
def _split_range(seq_len, split, num_splits, BLOCK_N: tl.constexpr):
    """Key positions ``[lo, hi)`` of split ``split``: ``⌈tiles / S⌉`` whole tiles each, as in
    Chapter 7 (every split starts at a multiple of ``BLOCK_N``; a split past the end is empty)."""
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.maximum(tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len), lo)
    return lo, hi


# ----------------------------------------------------------------------------------------
# 1. The cache write: RMSNorm of the latent, RoPE of the rotary key, one store
# ----------------------------------------------------------------------------------------
@triton.jit
def _write_latent_kernel(
    KV, NormW, Cos, Sin, Slots, Cache,
    stride_kt, stride_kd, stride_ct, stride_cd, stride_st, stride_sd, stride_sl,
    stride_cb, stride_co, stride_cw,
    block_size, num_blocks, eps,
    KV_LORA: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr, INTERLEAVE: tl.constexpr,
):
    """Program ``t``: token ``t``'s row ``KV[t] = [c_raw ; k_raw]`` (``kv_a_proj_with_mqa``'s
    output) to ``Cache[slot // bs, slot % bs] = [RMSNorm(c_raw)·NormW ; RoPE(k_raw)]``.

    RoPE pairs ``(k_2i, k_2i+1)`` (``INTERLEAVE``, DeepSeek's checkpoints) or ``(k_i,
    k_i+R/2)``; either way the rotated pair ``i`` is stored at ``i`` and ``i + R/2`` (the
    rotate-half layout), with the angles of ``Cos[t, i]``/``Sin[t, i]`` (the model's tables,
    ``[tokens, R]``, whose first half holds one angle per pair). Slot -1 writes nothing."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t * stride_sl)
    blk = slot // block_size
    if (slot >= 0) & (blk < num_blocks):
        row = Cache + blk * stride_cb + (slot % block_size) * stride_co
        src = KV + t * stride_kt
        # The latent, normalised in fp32 (as HF's RMSNorm), cast back, times the weight.
        offs_c = tl.arange(0, BLOCK_C)
        c_ok = offs_c < KV_LORA
        c = tl.load(src + offs_c * stride_kd, mask=c_ok, other=0.0)
        if NORM:
            cf = c.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(cf * cf, 0) / KV_LORA + eps)
            c = (cf * inv).to(c.dtype) * tl.load(NormW + offs_c, mask=c_ok, other=0.0)
        tl.store(row + offs_c * stride_cw, c.to(Cache.dtype.element_ty), mask=c_ok)
        # The rotary key: pair i is (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
        offs_i = tl.arange(0, BLOCK_HALF)
        i_ok = offs_i < ROPE_DIM // 2
        if INTERLEAVE:
            i1, i2 = 2 * offs_i, 2 * offs_i + 1
        else:
            i1, i2 = offs_i, offs_i + ROPE_DIM // 2
        x1 = tl.load(src + (KV_LORA + i1) * stride_kd, mask=i_ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + (KV_LORA + i2) * stride_kd, mask=i_ok, other=0.0).to(tl.float32)
        cos = tl.load(Cos + t * stride_ct + offs_i * stride_cd, mask=i_ok, other=0.0).to(tl.float32)
        sin = tl.load(Sin + t * stride_st + offs_i * stride_sd, mask=i_ok, other=0.0).to(tl.float32)
        tl.store(row + (KV_LORA + offs_i) * stride_cw, (x1 * cos - x2 * sin).to(Cache.dtype.element_ty), mask=i_ok)
        tl.store(row + (KV_LORA + ROPE_DIM // 2 + offs_i) * stride_cw, (x2 * cos + x1 * sin).to(Cache.dtype.element_ty),
                 mask=i_ok)


def _pool3(cache: torch.Tensor) -> torch.Tensor:
    """The pool as ``[num_blocks, block_size, W]`` (a view of a ``[..., 1, W]`` pool)."""
    if cache.dim() == 4:
        if cache.shape[2] != 1:
            raise ValueError(f"the latent pool has one 'KV head': [num_blocks, block_size, 1, W], got "
                             f"{tuple(cache.shape)}")
        return cache[:, :, 0]
    if cache.dim() != 3:
        raise ValueError(f"the latent pool must be [num_blocks, block_size, (1,) W], got {tuple(cache.shape)}")
    return cache


def write_latent_cache(cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor, kv_lora_rank: int,
                       cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor | None = None,
                       eps: float = 1e-6, interleave: bool = True) -> None:
    """Store new tokens' latent rows into the pool, in place.

    - ``cache: [num_blocks, block_size, (1,) W]`` with ``W = kv_lora_rank + R``;
    - ``kv: [tokens, W]``: ``kv_a_proj_with_mqa``'s output (the latent before its norm, the
      rotary key before RoPE); ``slot_mapping: [tokens]`` int64, -1 = skip;
    - ``cos, sin: [tokens, R]``: the rotate-half tables of the tokens' positions (the first
      ``R/2`` columns are read); ``norm_weight: [kv_lora_rank]`` (``kv_a_layernorm``; None:
      the latent is stored as given); ``interleave``: RoPE on interleaved pairs.
    """
    pool = _pool3(cache)
    num_blocks, block_size, width = pool.shape
    rope = width - kv_lora_rank
    if kv.dim() != 2 or kv.shape[1] != width or rope < 2 or rope % 2:
        raise ValueError(f"kv {tuple(kv.shape)} must be [tokens, {width}] with an even rotary part "
                         f"({width} - kv_lora_rank {kv_lora_rank})")
    n = kv.shape[0]
    if tuple(slot_mapping.shape) != (n,) or cos.shape[0] != n or sin.shape != cos.shape or cos.shape[1] < rope // 2:
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)}, cos {tuple(cos.shape)}, sin "
                         f"{tuple(sin.shape)} must have {n} rows (cos/sin at least {rope // 2} columns)")
    if n == 0:
        return
    weight = norm_weight if norm_weight is not None else kv  # a placeholder pointer when not normalising
    launch(_write_latent_kernel, (n,), kv, weight, cos, sin, slot_mapping, pool,
           *kv.stride(), *cos.stride(), *sin.stride(), slot_mapping.stride(0), *pool.stride(),
           block_size, num_blocks, float(eps),
           KV_LORA=kv_lora_rank, ROPE_DIM=rope, BLOCK_C=power_of_2_at_least(kv_lora_rank),
           BLOCK_HALF=max(1, power_of_2_at_least(rope // 2)), NORM=norm_weight is not None,
           INTERLEAVE=bool(interleave), num_warps=4)


# ----------------------------------------------------------------------------------------
# 2. Decode: the heads of one sequence against its latent rows
# ----------------------------------------------------------------------------------------
@triton.jit
def _mla_split_kernel(
    Q, Cache, BlockTables, SeqLens, O, LSE,
    stride_qb, stride_qh, stride_qd,
    stride_cb, stride_co, stride_cw,
    stride_tb, stride_tn, stride_sl,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    num_heads, block_size, num_blocks, max_blocks, qk_scale,
    KV_LORA: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program ``(b, hb, s)``: heads ``hb·BLOCK_H …`` of sequence ``b`` over split ``s`` of its
    first ``seq_lens[b]`` rows. Writes each head's latent output normalised over the split to
    ``O[b, h, s, :]`` and the split's lse (natural log) to ``LSE[b, h, s]``; with one split
    these are the final output and lse (the launcher passes a split stride of 0)."""
    b, hb, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    num_splits = tl.num_programs(2)

    # The heads are the rows of every dot; padding rows load zeros and are never stored.
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < num_heads
    heads = tl.minimum(offs_h, num_heads - 1).to(tl.int64)
    offs_c, c_ok = head_dim_offsets(KV_LORA, BLOCK_C)       # the latent's columns
    offs_r, r_ok = head_dim_offsets(ROPE_DIM, BLOCK_R)      # the rotary key's, after it
    q_row = Q + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_row + offs_c[None, :] * stride_qd, mask=h_ok[:, None] & c_ok, other=0.0)
    q_r = tl.load(q_row + (KV_LORA + offs_r[None, :]) * stride_qd, mask=h_ok[:, None] & r_ok, other=0.0)

    seq_len = tl.minimum(tl.maximum(tl.load(SeqLens + b * stride_sl), 0), max_blocks * block_size)
    lo, hi = _split_range(seq_len, split, num_splits, BLOCK_N)
    table = BlockTables + b * stride_tb
    c_cols = Cache + offs_c[None, :] * stride_cw
    r_cols = Cache + (KV_LORA + offs_r[None, :]) * stride_cw
    offs_n0 = tl.arange(0, BLOCK_N)

    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_C), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        rows, _, row_ok = tile_rows(table, stride_tn, start, offs_n0, hi, block_size, num_blocks,
                                    stride_cb, stride_co, stride_cb, stride_co, BLOCKS_PER_TILE, True, BLOCK_N)
        kv = tl.load(c_cols + rows[:, None], mask=row_ok[:, None] & c_ok, other=0.0)   # [BLOCK_N, BLOCK_C]
        k_r = tl.load(r_cols + rows[:, None], mask=row_ok[:, None] & r_ok, other=0.0)  # [BLOCK_N, BLOCK_R]
        # The score of every head against every row: the latent part plus the rotary part.
        s = tl.dot(q_c, tl.trans(kv), input_precision=DOT_PRECISION)
        s = tl.dot(q_r, tl.trans(k_r), s, input_precision=DOT_PRECISION)             # [BLOCK_H, BLOCK_N]
        s = tl.where((start + offs_n0 < hi)[None, :], s * qk_scale, float("-inf"))
        p, alpha, l, m = online_softmax_update(m, l, s, qk_scale, True)
        # The values are the latent rows just loaded: no second read.
        acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None], input_precision=DOT_PRECISION)

    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    lse = (m + tl.math.log2(l)) * LN2_C
    tl.store(O + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_c[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=h_ok[:, None] & (tl.arange(0, BLOCK_C) < KV_LORA)[None, :])
    tl.store(LSE + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=h_ok)


#: The most heads one program holds: ``[BLOCK_H, kv_lora_rank]`` fp32 accumulators, 64 KB at
#: 32 x 512 (64 registers a thread at 8 warps). DeepSeek-V3's 128 heads take 4 head blocks,
#: each reading the rows (the three other reads mostly hit L2).
MAX_BLOCK_H = 32
#: A split reads at least this many rows: its partial (``(kv_lora_rank + 1)`` fp32 per head,
#: written and read back) must stay small against the rows it reads (1152 bytes each in bf16).
MIN_SPLIT_KEYS = 256
#: ``BLOCK_N`` under the interpreter: small, so that the CPU tests walk several tiles.
INTERPRET_BLOCK_N = 16
#: Warps and pipeline stages on a GPU.
MLA_WARPS, MLA_STAGES = 8, 2


def mla_block_n(kv_lora_rank: int, dtype: torch.dtype) -> int:
    """Rows per tile: 32 KB of latent per tile on a GPU (32 rows of 512 in bf16, 16 in fp32;
    two pipeline stages of it fit in shared memory next to the query), 16 under the interpreter."""
    if interpreting():
        return INTERPRET_BLOCK_N
    return min(128, max(16, 32768 // (block_d(kv_lora_rank) * dtype.itemsize)))


def mla_num_splits(batch: int, head_blocks: int, max_seq_len: int, sms: int) -> int:
    """Splits per sequence: enough programs for one wave of two per SM (Chapter 7's rule),
    but no split shorter than `MIN_SPLIT_KEYS` rows and at most `MAX_SPLITS`."""
    fits = 2 * sms // max(1, batch * head_blocks)
    return max(1, min(fits, -(-max(0, max_seq_len) // MIN_SPLIT_KEYS), MAX_SPLITS))


def _check(q, pool, block_tables, seq_lens, kv_lora_rank):
    if q.dim() != 3 or q.shape[2] != pool.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} must be [batch, heads, {pool.shape[2]}] (the latent rows' width)")
    if not 0 < kv_lora_rank < pool.shape[2]:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} must be in (0, {pool.shape[2]})")
    if q.dtype != pool.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q and the pool must share one dtype among fp16/bf16/fp32; got {q.dtype}, {pool.dtype}")
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype not in (torch.int32,
                                                                                                 torch.int64):
        raise ValueError(f"block_tables must be int32 [batch={batch}, max_blocks], got {tuple(block_tables.shape)} "
                         f"{block_tables.dtype}")
    if tuple(seq_lens.shape) != (batch,) or seq_lens.dtype.is_floating_point:
        raise ValueError(f"seq_lens must be an integer tensor [{batch}], got {tuple(seq_lens.shape)}")


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         kv_lora_rank: int, scale: float, *, max_seq_len: int | None = None,
                         num_splits: int | None = None, out: torch.Tensor | None = None,
                         lse: torch.Tensor | None = None, block_n: int | None = None, block_h: int | None = None,
                         workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                         config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of one query per sequence over its paged latent rows.

    - ``q: [batch, heads, W]``: the absorbed queries ``[W_UKᵀ q^C ; q^R]`` (``W = kv_lora_rank
      + qk_rope_head_dim``), in the pool's dtype (fp16, bf16 or fp32);
    - ``cache: [num_blocks, block_size, (1,) W]``; ``block_tables: [batch, max_blocks]`` int32,
      -1 past each length; ``seq_lens: [batch]``, clamped to ``[0, max_blocks · block_size]``;
    - ``scale``: the softmax scale, ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (that of
      the decompressed heads; there is no default, the query's width is not the head's);
    - ``max_seq_len``: a Python bound on the lengths, to pick ``num_splits`` without reading
      them from the device (default ``max_blocks · block_size``); ``num_splits``: force it.

    Returns ``(out, lse)``: the latent outputs ``[batch, heads, kv_lora_rank]`` in q's dtype
    (``Σ_j p_j c_j``; apply ``W_UV`` per head for the values) and ``lse [batch, heads]``
    float32 (natural log; length 0: zeros and ``-inf``). Knobs for tests and measurements:
    ``block_n``, ``block_h`` (heads per program), ``workspace`` (``(o_part [batch, heads,
    S, kv_lora_rank], lse_part [batch, heads, S])`` fp32, kept after the call), ``config``
    (``num_warps``, ``num_stages``).
    """
    pool = _pool3(cache)
    _check(q, pool, block_tables, seq_lens, kv_lora_rank)
    num_blocks, block_size, width = pool.shape
    batch, heads = q.shape[:2]
    if out is None:
        out = torch.empty((batch, heads, kv_lora_rank), device=q.device, dtype=q.dtype)
    if lse is None:
        lse = torch.empty((batch, heads), device=q.device, dtype=torch.float32)
    if batch * heads == 0:
        return out, lse
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    rope = width - kv_lora_rank
    block_n = block_n or mla_block_n(kv_lora_rank, q.dtype)
    block_h = block_h or min(MAX_BLOCK_H, max(16, power_of_2_at_least(heads)))
    head_blocks = triton.cdiv(heads, block_h)
    if num_splits is None:
        bound = block_tables.shape[1] * block_size if max_seq_len is None else int(max_seq_len)
        num_splits = mla_num_splits(batch, head_blocks, bound, num_sms(q.device))
    if int(num_splits) != num_splits or num_splits < 1:
        raise ValueError(f"num_splits must be an integer >= 1, got {num_splits}")
    if num_splits == 1:  # stage 1 writes the final result: a split axis of stride 0
        o_part, lse_part = out[:, :, None], lse[:, :, None]
    elif workspace is not None:
        o_part, lse_part = workspace
        if tuple(o_part.shape) != (batch, heads, num_splits, kv_lora_rank) or tuple(lse_part.shape) != (
                batch, heads, num_splits):
            raise ValueError(f"workspace {tuple(o_part.shape)}, {tuple(lse_part.shape)} does not match "
                             f"[{batch}, {heads}, {num_splits}, {kv_lora_rank}]")
    else:
        o_part = torch.empty((batch, heads, num_splits, kv_lora_rank), device=q.device, dtype=torch.float32)
        lse_part = torch.empty((batch, heads, num_splits), device=q.device, dtype=torch.float32)
    o_strides = (*o_part.stride()[:2], 0 if num_splits == 1 else o_part.stride(2), o_part.stride(3))
    l_strides = (*lse_part.stride()[:2], 0 if num_splits == 1 else lse_part.stride(2))
    meta = _meta(kv_lora_rank, rope, q.dtype, block_size, block_n, block_h,
                 tuple(sorted(config.items())) if config else ())
    launch(_mla_split_kernel, (batch, head_blocks, int(num_splits)),
           q, pool, block_tables, seq_lens, o_part, lse_part,
           *q.stride(), *pool.stride(), *block_tables.stride(), seq_lens.stride(0), *o_strides, *l_strides,
           heads, block_size, num_blocks, block_tables.shape[1], scale * LOG2E, **meta)
    if num_splits > 1:
        reduce_splits(o_part, lse_part, out, lse)  # Chapter 7's stage 2
    return out, lse


@functools.lru_cache(maxsize=256)
def _meta(kv_lora_rank, rope, dtype, block_size, block_n, block_h, config) -> dict:
    """The kernel's compile-time parameters and launch options for one kind of call (cached)."""
    return dict(KV_LORA=kv_lora_rank, ROPE_DIM=rope, BLOCK_C=block_d(kv_lora_rank), BLOCK_R=block_d(rope),
                BLOCK_H=block_h, BLOCK_N=block_n, BLOCKS_PER_TILE=blocks_per_tile(block_size, block_n, None),
                DOT_PRECISION=dot_precision(dtype),
                **{"num_warps": MLA_WARPS, "num_stages": MLA_STAGES, **dict(config)})


# ----------------------------------------------------------------------------------------
# 3. Several new tokens per sequence: each token a one-query sequence
# ----------------------------------------------------------------------------------------
def mla_prefill_attention(q: torch.Tensor, cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, kv_lora_rank: int, scale: float,
                          *, max_seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of the new tokens of every sequence, causally, over its paged
    latent rows: ``q: [tokens, heads, W]`` (sequence ``b``'s rows are ``cu_seqlens_q[b] :
    cu_seqlens_q[b + 1]``), ``seq_lens: [batch]`` including the new tokens (bottom-right
    aligned: new token ``i`` of ``n`` sees the first ``seq_len − n + i + 1`` rows).

    Each token runs as a sequence of its own through `mla_decode_attention`, with its
    sequence's block table and its visible length: computed on the device, so no host
    synchronisation. Returns ``(out [tokens, heads, kv_lora_rank], lse [tokens, heads])``."""
    n, batch = q.shape[0], seq_lens.shape[0]
    if n == 0 or batch == 0:
        return (q.new_zeros((n, q.shape[1], kv_lora_rank)),
                torch.full((n, q.shape[1]), float("-inf"), device=q.device))
    t = torch.arange(n, device=q.device, dtype=torch.int64)
    cu = cu_seqlens_q.to(torch.int64)
    seq = torch.searchsorted(cu[1:], t, right=True).clamp_(max=batch - 1)       # each token's sequence
    lens = seq_lens.to(torch.int64)[seq] - (cu[seq + 1] - 1 - t)                # rows it sees
    return mla_decode_attention(q, cache, block_tables[seq], lens.to(torch.int32), kv_lora_rank, scale,
                                max_seq_len=max_seq_len)
