"""The Llama-family decoder in NumPy (float64): one sequence, no cache, written to be read.

``params`` maps Hugging Face tensor names (``model.layers.0.self_attn.q_proj.weight``, ...)
to float64 arrays; ``minillm.model.loader.load_reference_params`` builds it from a checkpoint.
Linear weights are stored ``[out_features, in_features]``, so a projection is ``x @ W.T``.
"""
from __future__ import annotations

import numpy as np

from minillm.model.config import ModelConfig
from minillm.reference.attention import attention


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


def forward(params: dict, config: ModelConfig, token_ids) -> np.ndarray:
    """Logits ``[seq, vocab]`` (float64) for one sequence of token ids ``[seq]``."""
    c = config
    ids = np.asarray(token_ids)
    seq = len(ids)
    positions = np.arange(seq, dtype=np.float64)
    x = params["model.embed_tokens.weight"][ids]                                  # [seq, hidden]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        # Attention block: x += o_proj(attention(rope(q), rope(k), v))
        h = rms_norm(x, params[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = linear(params, p + "self_attn.q_proj", h).reshape(seq, c.num_attention_heads, c.head_dim)
        k = linear(params, p + "self_attn.k_proj", h).reshape(seq, c.num_key_value_heads, c.head_dim)
        v = linear(params, p + "self_attn.v_proj", h).reshape(seq, c.num_key_value_heads, c.head_dim)
        q, k, v = (t.transpose(1, 0, 2) for t in (q, k, v))                       # [heads, seq, head_dim]
        q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        out, _ = attention(q[None], k[None], v[None], causal=True, scale=c.head_dim ** -0.5)
        out = out[0].transpose(1, 0, 2).reshape(seq, c.num_attention_heads * c.head_dim)
        x = x + linear(params, p + "self_attn.o_proj", out)
        # MLP block (SwiGLU): x += down(silu(gate(h)) * up(h))
        h = rms_norm(x, params[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gated = silu(linear(params, p + "mlp.gate_proj", h)) * linear(params, p + "mlp.up_proj", h)
        x = x + linear(params, p + "mlp.down_proj", gated)
    x = rms_norm(x, params["model.norm.weight"], c.rms_norm_eps)
    lm_head = params["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"]
    return x @ lm_head.T                                                           # [seq, vocab]
