"""Chapter 12: multi-head latent attention (DeepSeek-V2/V3), the attention module of the model.

`MLAAttention` replaces `minillm.model.torch_model.Attention` in every layer of a
``deepseek_v2``/``deepseek_v3`` checkpoint (`ModelConfig.is_mla`); the rest of the decoder
(norms, the dense SwiGLU MLP, embeddings, head) is the Llama one. Parameter names are Hugging
Face's: ``q_proj`` (or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` with query compression),
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``. The NumPy reference is
`minillm.reference.ch12_mla`, the derivation the notebook ``chapters/12_mla.ipynb``.

What is cached, per token and layer, is one **latent row** ``[c_kv ; k_rope]`` of
``kv_lora_rank + qk_rope_head_dim`` numbers (`ModelConfig.latent_dim`): the contiguous
`KVCache` holds it as one "KV head" in ``k`` (``v`` is the same tensors), the paged pool as
one plane ``[1, layers, num_blocks, block_size, 1, latent_dim]``.

Two ways to attend over it:

- **naive** (`attend_naive`): decompress every cached row into per-head keys and values with
  ``kv_b_proj`` and run ordinary attention (SDPA). The contiguous path, the torch paged path
  and fresh prompts on the kernels (decompression + Chapter 4's FlashAttention-2) use it;
- **absorbed** (`absorb_query`, `latent_values`): fold ``W_UK`` into the query, attend over
  the latent rows directly, apply ``W_UV`` to the latent output. Decode steps (and chunks
  after a cached prefix) on the kernels use it, through `minillm.kernels.ch12_mla`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minillm.model.config import ModelConfig
from minillm.model.paged import PagedBatch, PagedKVCache, _causal_attention, gather_sequence
from minillm.model.torch_model import KVCache, Linear, RMSNorm, apply_rope

__all__ = ["MLAAttention", "mla_attention_shapes", "rope_mla"]

#: HF's DeepSeek code builds the latent norms without an ``eps`` argument: its default.
LATENT_NORM_EPS = 1e-6


def mla_attention_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of one layer's ``self_attn`` (names relative to it) and their shapes."""
    H, qk, h = c.num_attention_heads, c.head_dim, c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    if c.q_lora_rank is None:
        shapes["q_proj.weight"] = (H * qk, h)
    else:
        shapes["q_a_proj.weight"] = (c.q_lora_rank, h)
        shapes["q_a_layernorm.weight"] = (c.q_lora_rank,)
        shapes["q_b_proj.weight"] = (H * qk, c.q_lora_rank)
        if c.qkv_bias:
            shapes["q_a_proj.bias"] = (c.q_lora_rank,)
    shapes["kv_a_proj_with_mqa.weight"] = (c.latent_dim, h)
    if c.qkv_bias:
        shapes["kv_a_proj_with_mqa.bias"] = (c.latent_dim,)
    shapes["kv_a_layernorm.weight"] = (c.kv_lora_rank,)
    shapes["kv_b_proj.weight"] = (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    shapes["o_proj.weight"] = (h, H * c.v_head_dim)
    if c.o_bias:
        shapes["o_proj.bias"] = (h,)
    return shapes


def rope_mla(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE of the rotary part ``x [..., R]`` (``cos, sin`` broadcast against it). DeepSeek's
    checkpoints rotate interleaved pairs: de-interleave first (``[x_0, x_2, …, x_1, x_3, …]``),
    then rotate in the rotate-half layout, as HF's DeepSeek-V3 code does; queries and keys are
    permuted alike, so every score equals that of the interleaved rotation."""
    if interleave:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    return apply_rope(x, cos, sin)


class MLAAttention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        H, qk = c.num_attention_heads, c.head_dim
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, H * qk, bias=False)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.qkv_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(c.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.latent_dim, bias=c.qkv_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = Linear(H * c.v_head_dim, c.hidden_size, bias=c.o_bias)
        self.scale = qk ** -0.5  # the decompressed head's width, in both forms

    # == the pieces ================================================================================
    def queries(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., hidden]`` -> ``q_nope [..., H, nope]`` and ``q_rope [..., H, R]`` (rotated;
        ``cos, sin`` broadcast against ``[..., H, R]``)."""
        c = self.c
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(*x.shape[:-1], c.num_attention_heads, c.head_dim)
        return q[..., :c.qk_nope_head_dim], rope_mla(q[..., c.qk_nope_head_dim:], cos, sin, c.rope_interleave)

    def latents(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """``x [..., hidden]`` -> the cache rows ``[..., latent_dim]``: ``[RMSNorm(c) ; RoPE(k_R)]``
        (``cos, sin`` broadcast against ``[..., R]``)."""
        c = self.c
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[..., :c.kv_lora_rank])
        return torch.cat([c_kv, rope_mla(kv[..., c.kv_lora_rank:], cos, sin, c.rope_interleave)], dim=-1)

    def decompress(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows ``[..., S, latent_dim]`` -> keys ``[..., S, H, qk]`` (``[W_UK c ; k_R]``,
        the rotary key broadcast to every head) and values ``[..., S, H, v]`` (``W_UV c``)."""
        c = self.c
        kv = self.kv_b_proj(rows[..., :c.kv_lora_rank])
        kv = kv.view(*rows.shape[:-1], c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv[..., :c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
        k_rope = rows[..., None, c.kv_lora_rank:].expand(*k_nope.shape[:-1], c.qk_rope_head_dim)
        return torch.cat([k_nope, k_rope], dim=-1), v

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [H, nope, r]`` and ``W_UV [H, v, r]``: views of ``kv_b_proj.weight``."""
        c = self.c
        w = self.kv_b_proj.weight.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def absorb_query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """``[N, H, nope]``, ``[N, H, R]`` -> the absorbed query ``[N, H, latent_dim]``:
        ``[W_UKᵀ q_nope ; q_rope]`` per head."""
        w_uk, _ = self._w_uk_uv()
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
        return torch.cat([q_lat, q_rope], dim=-1)

    def latent_values(self, o_latent: torch.Tensor) -> torch.Tensor:
        """``W_UV`` per head: the latent output ``[N, H, r]`` -> ``[N, H, v]``."""
        _, w_uv = self._w_uk_uv()
        return torch.einsum("nhr,hvr->nhv", o_latent, w_uv)

    def attend_absorbed(self, q_abs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Absorbed attention in torch: ``q_abs [T, H, W]`` (the last ``T`` positions) over the
        rows ``[S, W]``, causal -> latent outputs ``[T, H, r]``."""
        r = self.c.kv_lora_rank
        k = rows[:, None, :].expand(-1, q_abs.shape[1], -1)
        return _causal_attention(q_abs, k, k[..., :r], self.scale)

    def attend_naive(self, q_nope, q_rope, rows: torch.Tensor) -> torch.Tensor:
        """Decompressed attention: ``q_* [T, H, *]`` (the last ``T`` positions) over the rows
        ``[S, W]``, causal -> ``[T, H, v]``."""
        k, v = self.decompress(rows)
        return _causal_attention(torch.cat([q_nope, q_rope], dim=-1), k, v, self.scale)

    # == forward ===================================================================================
    def forward(self, x, cos, sin, start_pos: int | PagedBatch, cache: KVCache | PagedKVCache | None, layer: int):
        """``x [B, T, hidden]`` at positions ``start_pos ..`` -> ``[B, T, hidden]`` (the interface
        of `minillm.model.torch_model.Attention`; ``cos, sin [T, R]``)."""
        if isinstance(cache, PagedKVCache):
            return self.forward_paged(x, cos, sin, start_pos, cache, layer)
        c, (B, T, _) = self.c, x.shape
        q_nope, q_rope = self.queries(x, cos[:, None], sin[:, None])                  # [B, T, H, *]
        rows = self.latents(x, cos, sin)                                              # [B, T, W]
        if cache is not None:
            end = start_pos + T
            if end > cache.max_len:
                raise ValueError(f"KV cache full: need {end} slots, have {cache.max_len}")
            cache.k[layer][:, 0, start_pos:end] = rows
            rows = cache.k[layer][:, 0, :end]                                         # [B, S, W]
        k, v = self.decompress(rows)                                                  # [B, S, H, *]
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)                       # [B, H, T, qk]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        S = k.shape[2]
        mask, causal = None, False
        if T == S:
            causal = T > 1
        elif T > 1:
            mask = torch.arange(S, device=x.device)[None, :] <= torch.arange(S - T, S, device=x.device)[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def forward_paged(self, x, cos, sin, batch: PagedBatch, cache: PagedKVCache, layer: int):
        """``x [N, hidden]`` (every sequence's new tokens back to back) -> ``[N, hidden]``. Writes
        the new latent rows into their slots, then attends over each sequence's rows."""
        c, N, H = self.c, x.shape[0], self.c.num_attention_heads
        pool = cache.k[layer]                                                        # [blocks, bs, 1, W]
        q_nope, q_rope = self.queries(x, cos[:, None], sin[:, None])                  # [N, H, *]
        if cache.kernels is None:  # torch: write, then decompress each sequence's rows
            rows = self.latents(x, cos, sin)
            keep = batch.slot_mapping >= 0
            pool.view(-1, c.latent_dim)[batch.slot_mapping[keep]] = rows[keep].to(pool.dtype)
            out = torch.empty(N, H, c.v_head_dim, device=x.device, dtype=x.dtype)
            cu, lens = batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist()
            for b, (start, end, seq_len) in enumerate(zip(cu, cu[1:], lens)):
                seq_rows = gather_sequence(pool, batch.block_tables[b], seq_len)[:, 0]     # [S, W]
                out[start:end] = self.attend_naive(q_nope[start:end], q_rope[start:end], seq_rows)
            return self.o_proj(out.reshape(N, -1))

        from minillm.kernels import ch12_mla
        kv = self.kv_a_proj_with_mqa(x)
        ch12_mla.write_latent_cache(pool, kv, batch.slot_mapping, c.kv_lora_rank, cos, sin,
                                    self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, c.rope_interleave)
        if batch.fresh_prefill and batch.max_seqlen_q > 1:
            out = self._fresh_prefill(q_nope, q_rope, pool, batch)
        else:  # decode, or chunks after a cached prefix: absorbed, over the latent rows
            q_abs = self.absorb_query(q_nope, q_rope).to(pool.dtype)
            if batch.max_seqlen_q == 1:
                o_lat, _ = ch12_mla.mla_decode_attention(q_abs, pool, batch.block_tables, batch.seq_lens,
                                                         c.kv_lora_rank, self.scale, max_seq_len=batch.max_seq_len)
            else:
                o_lat, _ = ch12_mla.mla_prefill_attention(q_abs, pool, batch.cu_seqlens_q, batch.block_tables,
                                                          batch.seq_lens, c.kv_lora_rank, self.scale,
                                                          max_seq_len=batch.max_seq_len)
            out = self.latent_values(o_lat.to(x.dtype))
        return self.o_proj(out.reshape(N, -1))

    def _fresh_prefill(self, q_nope, q_rope, pool, batch: PagedBatch) -> torch.Tensor:
        """Prompts with nothing cached: decompress the new rows (read back from their slots) and
        run Chapter 4's FlashAttention-2 (varlen, causal). Its kernel takes one head dim for
        Q, K and V: the narrower of ``qk`` and ``v`` is padded with zeros (which changes no
        score and no output column), and the output cut back to ``v_head_dim``."""
        from minillm.kernels.ch04_flash_attention import flash_attention_varlen

        c = self.c
        rows = pool.view(-1, c.latent_dim)[batch.slot_mapping]                       # [N, W]
        k, v = self.decompress(rows.to(q_nope.dtype))
        q = torch.cat([q_nope, q_rope], dim=-1)
        width = max(c.head_dim, c.v_head_dim)
        q, k = (F.pad(t, (0, width - c.head_dim)) for t in (q, k))
        v = F.pad(v, (0, width - c.v_head_dim))
        cu = batch.cu_seqlens_q
        out = flash_attention_varlen(q.to(pool.dtype), k.to(pool.dtype), v.to(pool.dtype), cu, cu,
                                     batch.max_seqlen_q, batch.max_seqlen_q, causal=True, scale=self.scale)
        return out[..., :c.v_head_dim].to(q_nope.dtype)
