"""The Llama-family decoder in NumPy (float64): one sequence, written to be read.

``forward`` recomputes everything from the whole sequence; ``forward_cached`` processes only
new tokens and keeps keys and values in a `minillm.reference.ch02_kv_cache` cache (Chapter 2).

``params`` maps Hugging Face tensor names (``model.layers.0.self_attn.q_proj.weight``, ...)
to float64 arrays; ``minillm.model.loader.load_reference_params`` builds it from a checkpoint.
Linear weights are stored ``[out_features, in_features]``, so a projection is ``x @ W.T``.
"""
from __future__ import annotations

import numpy as np

from minillm.model.config import ModelConfig
from minillm.reference.ch01_naive_attention import attention
from minillm.reference.ch02_kv_cache import KVCache, RingKVCache


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x²) + eps) * weight`` over the last axis. ``x: [seq, hidden]``."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotary embedding, HF "rotate-half" layout. ``x: [heads, seq, head_dim]``.

    Dimension ``i`` of the first half is paired with dimension ``i + head_dim/2`` and the
    pair is rotated by the angle ``position · theta^(-2i/head_dim)``.
    """
    half = x.shape[-1] // 2
    inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2 / x.shape[-1])  # [half]
    angle = positions[:, None] * inv_freq[None, :]                               # [seq, half]
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def linear(params: dict, name: str, x: np.ndarray) -> np.ndarray:
    """``x @ W.T + b`` with the bias only if the checkpoint has one."""
    y = x @ params[name + ".weight"].T
    bias = params.get(name + ".bias")
    return y if bias is None else y + bias


def decoder_layer(params: dict, config: ModelConfig, i: int, x: np.ndarray, positions: np.ndarray,
                  cache=None, window: int | None = None) -> np.ndarray:
    """Layer ``i`` on the hidden states ``x: [T, hidden]`` of the tokens at ``positions: [T]``.

    Without a cache the ``T`` tokens are the whole sequence. With one (a
    `minillm.reference.ch02_kv_cache.KVCache` or `RingKVCache`), they come after the
    ``cache.seq_len`` cached ones: their keys and values are appended to the cache, and
    attention runs over what the cache hands back (earlier positions, then the new ones).
    Either way the keys end with the newest token, so the same bottom-right aligned causal
    (and ``window``) mask is right.
    """
    c, T = config, len(x)
    p = f"model.layers.{i}."
    # Attention block: x += o_proj(attention(rope(q), rope(k), v))
    h = rms_norm(x, params[p + "input_layernorm.weight"], c.rms_norm_eps)
    q = linear(params, p + "self_attn.q_proj", h).reshape(T, c.num_attention_heads, c.head_dim)
    k = linear(params, p + "self_attn.k_proj", h).reshape(T, c.num_key_value_heads, c.head_dim)
    v = linear(params, p + "self_attn.v_proj", h).reshape(T, c.num_key_value_heads, c.head_dim)
    q, k, v = (t.transpose(1, 0, 2) for t in (q, k, v))                           # [heads, T, head_dim]
    q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
    if cache is not None:
        k, v = cache.append(i, k, v)                                               # [kv_heads, S, head_dim]
    out, _ = attention(q[None], k[None], v[None], causal=True, scale=c.head_dim ** -0.5, window=window)
    out = out[0].transpose(1, 0, 2).reshape(T, c.num_attention_heads * c.head_dim)
    x = x + linear(params, p + "self_attn.o_proj", out)
    # MLP block (SwiGLU): x += down(silu(gate(h)) * up(h))
    h = rms_norm(x, params[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
    gated = silu(linear(params, p + "mlp.gate_proj", h)) * linear(params, p + "mlp.up_proj", h)
    return x + linear(params, p + "mlp.down_proj", gated)


def _run(params: dict, config: ModelConfig, token_ids, start_pos: int, cache, window: int | None) -> np.ndarray:
    """Embed, all layers, final norm, LM head: logits ``[T, vocab]`` for the ``T`` given tokens."""
    c = config
    ids = np.asarray(token_ids)
    positions = np.arange(start_pos, start_pos + len(ids), dtype=np.float64)
    x = params["model.embed_tokens.weight"][ids]                                  # [T, hidden]
    for i in range(c.num_hidden_layers):
        x = decoder_layer(params, c, i, x, positions, cache, window)
    x = rms_norm(x, params["model.norm.weight"], c.rms_norm_eps)
    lm_head = params["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"]
    return x @ lm_head.T                                                           # [T, vocab]


def forward(params: dict, config: ModelConfig, token_ids, window: int | None = None) -> np.ndarray:
    """Logits ``[seq, vocab]`` (float64) for one sequence of token ids ``[seq]``, no cache.

    ``window=W`` gives sliding-window attention (each token sees the last ``W`` positions,
    itself included), the oracle for `RingKVCache`.
    """
    return _run(params, config, token_ids, 0, None, window)


def forward_cached(params: dict, config: ModelConfig, token_ids, cache) -> np.ndarray:
    """Logits ``[T, vocab]`` for ``T`` new tokens that follow the ``cache.seq_len`` cached ones.

    The tokens get positions ``cache.seq_len ..`` and their keys and values join the cache.
    Prefill is the first call (an empty cache, the whole prompt); decoding is one call per
    token; a chunk of several tokens after a prefix works too. The logits equal the
    matching rows of ``forward`` over the whole sequence so far (with
    ``window=cache.window``: a `RingKVCache` gives sliding-window attention).
    """
    return _run(params, config, token_ids, cache.seq_len, cache, cache.window)


def greedy_generate(params: dict, config: ModelConfig, prompt_ids, max_new_tokens: int,
                    window: int | None = None) -> list[int]:
    """Prefill ``prompt_ids``, then decode ``max_new_tokens`` argmax tokens, one call each.

    Returns the new token ids. The cache holds the prompt and every generated token but the
    last (whose keys nobody needs); with ``window`` it is a ring of ``window`` slots.
    """
    prompt = list(np.asarray(prompt_ids))
    cache = (RingKVCache.for_model(config, window) if window is not None
             else KVCache.for_model(config, len(prompt) + max_new_tokens))
    new, tokens = [], prompt
    for _ in range(max_new_tokens):
        nxt = int(np.argmax(forward_cached(params, config, tokens, cache)[-1]))
        new.append(nxt)
        tokens = [nxt]
    return new
