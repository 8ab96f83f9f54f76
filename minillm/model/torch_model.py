"""The Llama-family decoder in PyTorch: batched, device-agnostic, with a contiguous KV cache.

Module and parameter names mirror Hugging Face's (``model.layers.0.self_attn.q_proj``, ...)
so a checkpoint's state dict loads as is. With the contiguous cache, attention uses
``torch.nn.functional.scaled_dot_product_attention``; with the paged cache, on a GPU, the
book's Triton kernels (`minillm.model.paged`). The linear layers are `Linear`: on a GPU in
fp16/bf16 they go through Chapter 8's heuristic dataflow (GEMV, flat GEMM or cuBLAS by the
number of rows), elsewhere they are ``nn.Linear``.

Two caches: Chapter 2's contiguous `KVCache` (every sequence of the batch at the same
position), and Chapter 6's `minillm.model.paged.PagedKVCache`, run through `forward_paged` on
a flat `PagedBatch` of sequences of any lengths. The layers are the same; only
`Attention.forward` looks at which cache it was given.

Shapes: ``B`` batch, ``T`` new tokens in this call, ``S`` cached + new tokens,
``H`` query heads, ``Hkv`` KV heads, ``D`` head_dim; in the paged path, ``N`` new tokens of
all sequences together.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from minillm.model.config import ModelConfig
from minillm.model.paged import SDPA_GQA, PagedBatch, PagedKVCache, paged_attention, write_kv


@functools.cache
def _flat_gemm_linear():
    """Chapter 8's dispatcher `minillm.kernels.ch08_flat_gemm.linear` with the measured dispatch
    table of the GPU it runs on (`minillm.engine.gemm_table.table_for_device`), or ``None`` when
    it cannot be imported (no Triton). Imported on first use: a model on a CPU never needs Triton."""
    try:
        from minillm.kernels.ch08_flat_gemm import linear
    except ImportError:
        return None
    from minillm.engine.gemm_table import table_for_device

    def dispatch(x, weight, bias):
        return linear(x, weight, bias, table=table_for_device(x.device))
    return dispatch


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) whose forward on a CUDA tensor in
    fp16/bf16 is Chapter 8's `minillm.kernels.ch08_flat_gemm.linear`: decode steps have a handful
    of rows, for which a GEMV or a flat GEMM reads the weights faster than cuBLAS's tiles.
    The dispatcher picks per call from the GPU's measured table, so prefill batches still go
    to cuBLAS."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and self.weight.dtype == x.dtype:
            dispatch = _flat_gemm_linear()
            if dispatch is not None:
                return dispatch(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class KVCache:
    """Per layer, keys and values ``[B, Hkv, max_len, D]``; slot ``p`` holds position ``p``.

    Every sequence of the batch sits at the same position (no padding, no paging yet:
    Chapter 5 replaces this with paged blocks).
    """

    def __init__(self, config: ModelConfig, batch: int, max_len: int, device=None, dtype=None):
        shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
        if config.is_mla:  # Chapter 12: one latent row per token, no separate V (v is k)
            shape = (batch, 1, max_len, config.latent_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v = self.k if config.is_mla else [torch.zeros(shape, device=device, dtype=dtype)
                                               for _ in range(config.num_hidden_layers)]
        self.max_len = max_len


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and RoPE run in at least float32 (as HF does), float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., dim] -> [..., dim]``, normalised in float32 then cast back (as HF)."""
        h = x.to(_compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """``positions [T]`` -> ``cos, sin [T, D]`` for the rotate-half layout."""
    cdt = _compute_dtype(dtype)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=cdt) / head_dim)
    freqs = positions.to(cdt)[:, None] * inv_freq[None, :]                # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)                              # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, heads, T, D]``: rotate the pairs (i, i + D/2) by their position's angle.

    Any layout works whose ``cos, sin`` broadcast against ``x``, e.g. the paged path's
    ``x [N, heads, D]`` with ``cos, sin [N, 1, D]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.o_bias)

    def forward(self, x, cos, sin, start_pos: int | PagedBatch, cache: KVCache | PagedKVCache | None, layer: int):
        """``x [B, T, hidden]`` at positions ``start_pos .. start_pos+T-1`` -> ``[B, T, hidden]``.

        With a `PagedKVCache`, ``start_pos`` is the step's `PagedBatch` (every token's position
        and slot) and ``x`` is ``[N, hidden]``: see `forward_paged`.
        """
        if isinstance(cache, PagedKVCache):
            return self.forward_paged(x, cos, sin, start_pos, cache, layer)
        c, (B, T, _) = self.c, x.shape
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)   # [B, H, T, D]
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)   # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # write the new keys/values, then attend over everything so far
            end = start_pos + T
            if end > cache.max_len:
                raise ValueError(f"KV cache full: need {end} slots, have {cache.max_len}")
            cache.k[layer][:, :, start_pos:end] = k
            cache.v[layer][:, :, start_pos:end] = v
            k, v = cache.k[layer][:, :, :end], cache.v[layer][:, :, :end]                 # [B, Hkv, S, D]
        S = k.shape[2]
        # Causal mask, bottom-right aligned: query i sits at position S - T + i. SDPA's
        # is_causal is top-left aligned, so it is only right when T == S; one decoded token
        # (T == 1) sees the whole cache; anything else (a chunk after a prefix) needs a mask.
        mask, causal = None, False
        if T == S:
            causal = T > 1
        elif T > 1:
            q_pos = torch.arange(S - T, S, device=x.device)[:, None]
            mask = torch.arange(S, device=x.device)[None, :] <= q_pos                     # [T, S]
        if c.gqa_group > 1 and not SDPA_GQA:
            k, v = (t.repeat_interleave(c.gqa_group, dim=1) for t in (k, v))
        gqa = {"enable_gqa": True} if c.gqa_group > 1 and SDPA_GQA else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             scale=c.head_dim ** -0.5, **gqa)                # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def forward_paged(self, x, cos, sin, batch: PagedBatch, cache: PagedKVCache, layer: int):
        """``x [N, hidden]``, the new tokens of every sequence back to back, ``cos, sin [N, D]``
        -> ``[N, hidden]``. Writes the new K/V into their slots, then attends over the pages."""
        c, N = self.c, x.shape[0]
        q = self.q_proj(x).view(N, c.num_attention_heads, c.head_dim)                     # [N, H, D]
        k = self.k_proj(x).view(N, c.num_key_value_heads, c.head_dim)                     # [N, Hkv, D]
        v = self.v_proj(x).view(N, c.num_key_value_heads, c.head_dim)
        q, k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
        write_kv(cache, layer, k, v, batch.slot_mapping)  # first: a new token attends to itself
        out = paged_attention(q, cache, layer, batch, scale=c.head_dim ** -0.5, k=k, v=v)  # [N, H, D]
        return self.o_proj(out.reshape(N, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.is_mla:  # Chapter 12: multi-head latent attention (DeepSeek-V2/V3)
            from minillm.model.mla import MLAAttention
            self.self_attn = MLAAttention(c)
        else:
            self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, start_pos, cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start_pos, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's ``model.*``: embedding, the decoder layers, the final norm."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 decoder with a language-model head."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.lm_head.weight
        return KVCache(self.config, batch, max_len, device=p.device, dtype=p.dtype)

    def new_paged_cache(self, num_blocks: int, block_size: int, backend: str = "auto",
                        softmax_phi: float | None = None) -> PagedKVCache:
        """A zeroed paged pool on the model's device and dtype (see `PagedKVCache`)."""
        p = self.lm_head.weight
        return PagedKVCache(self.config, num_blocks, block_size, device=p.device, dtype=p.dtype, backend=backend,
                            softmax_phi=softmax_phi)

    def forward(self, input_ids: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None) -> torch.Tensor:
        """``input_ids [B, T]`` at positions ``start_pos ..`` -> logits ``[B, T, vocab]``.

        Without a cache, ``start_pos`` must be 0 (the whole sequence is given). With one, the
        call appends to it: prefill with ``start_pos=0``, then decode one token at a time
        (or a chunk) with ``start_pos`` = tokens already cached.
        """
        if cache is None and start_pos != 0:
            raise ValueError("start_pos > 0 needs a cache holding the earlier tokens")
        c = self.config
        x = self.model.embed_tokens(input_ids)                                  # [B, T, hidden]
        positions = torch.arange(start_pos, start_pos + input_ids.shape[1], device=input_ids.device)
        cos, sin = rope_cos_sin(positions, c.rope_dim, c.rope_theta, x.dtype)   # [T, D]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, start_pos, cache, i)
        return self.lm_head(self.model.norm(x))

    def forward_paged(self, batch: PagedBatch, cache: PagedKVCache, last_only: bool = False) -> torch.Tensor:
        """Run one step's flat batch of new tokens over a paged cache, writing their K/V.

        Returns logits ``[N, vocab]`` for every new token (``N = batch.num_tokens``), or, with
        ``last_only``, ``[batch, vocab]`` for each sequence's last new token: all that decoding
        needs, and it spares the ``lm_head`` matmul over prompt tokens.

        With ``self.fused_decode`` set (Chapter 10, `minillm.model.fused.enable_fused_decode`),
        the same step runs through the fused kernels instead.
        """
        fused = getattr(self, "fused_decode", None)
        if fused is not None:
            return fused(batch, cache, last_only)
        c = self.config
        x = self.model.embed_tokens(batch.input_ids)                               # [N, hidden]
        cos, sin = rope_cos_sin(batch.positions, c.rope_dim, c.rope_theta, x.dtype)  # [N, D]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, batch, cache, i)
        if last_only:
            x = x[batch.last_token_rows]                                           # [batch, hidden]
        return self.lm_head(self.model.norm(x))


@torch.inference_mode()
def generate(model: LlamaForCausalLM, input_ids: torch.Tensor, max_new_tokens: int, greedy: bool = True,
             temperature: float = 1.0, eos_token_id: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Prefill ``input_ids [B, T]``, then decode; returns ``[B, T + new]`` (prompt included).

    ``greedy`` takes the argmax, otherwise it samples from ``softmax(logits / temperature)``.
    Stops early once every sequence has produced ``eos_token_id``.
    """
    B, T = input_ids.shape
    cache = model.new_cache(B, T + max_new_tokens)
    out, pos, tokens = input_ids, 0, input_ids
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        logits = model(tokens, start_pos=pos, cache=cache)[:, -1].float()      # [B, vocab]
        pos += tokens.shape[1]
        if greedy:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        if eos_token_id is not None:
            nxt = torch.where(done, eos_token_id, nxt)
            done |= nxt == eos_token_id
        tokens = nxt[:, None]
        out = torch.cat([out, tokens], dim=1)
        if eos_token_id is not None and bool(done.all()):
            break
    return out
