"""Chapter 2: the KV cache. Decoding with a cache must give the logits of recomputing.

The oracle is always the no-cache forward over the whole sequence so far: the NumPy
reference (``reference.forward``, float64) or the torch model called without a cache. Tiny
random models are built directly from a `ModelConfig` (no checkpoint, no transformers), and
the NumPy parameters are the torch model's own state dict, so both sides share weights.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minillm import costs
from minillm.model import LlamaForCausalLM, ModelConfig
from minillm.model import reference
from minillm.reference import KVCache, RingKVCache, attention

VOCAB = 97
HEADS = 8
KV_HEADS = {"mha": 8, "gqa2": 4, "gqa4": 2, "mqa": 1}   # query heads per KV head: 1, 2, 4, 8


def tiny_model(kv_heads: int, seed: int = 0, layers: int = 2, dtype=torch.float64, tied: bool = False):
    """``(torch model, NumPy params, config)``: a random 2-layer Llama with 8 query heads."""
    config = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                         head_dim=8, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # norm weights start at 1; randomise them so a skipped one would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    params = {k: v.detach().to(torch.float64).numpy() for k, v in model.state_dict().items()}
    return model, params, config


def token_ids(n: int, seed: int, batch: int | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, n if batch is None else (batch, n))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def chunks(schedule):
    """``[5, 3, 1, 1]`` -> ``[(0, 5), (5, 8), (8, 9), (9, 10)]``: the (start, end) of each call."""
    ends = np.cumsum(schedule)
    return list(zip([0, *ends[:-1].tolist()], ends.tolist()))


# Prefill then single tokens; a prefix, a chunk, then single tokens; one token at a time
# from an empty cache (where q_len == kv_len == 1).
SCHEDULES = {"prefill+decode": [6] + [1] * 7, "chunked": [4, 5, 1, 1, 1, 1], "all-decode": [1] * 9}


# --- (a) NumPy reference: cached forward == full recomputation ------------------------------

@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("kv", list(KV_HEADS))
def test_reference_decode_equals_recompute(kv, schedule, seed):
    _, params, config = tiny_model(KV_HEADS[kv])
    steps = chunks(SCHEDULES[schedule])
    ids = token_ids(steps[-1][1], seed)
    cache = KVCache.for_model(config, len(ids))
    for start, end in steps:
        assert cache.seq_len == start
        got = reference.forward_cached(params, config, ids[start:end], cache)
        want = reference.forward(params, config, ids[:end])[start:end]
        assert got.shape == (end - start, VOCAB)
        assert rel_err(got, want) <= 1e-10, f"step {start}:{end}, seed {seed}"
    assert all(n == len(ids) for n in cache.lengths)


def test_reference_cache_holds_the_recomputed_keys(seed):
    """After decoding, layer 0's cache holds exactly rope(k_proj(norm(embedding)))."""
    _, params, config = tiny_model(KV_HEADS["gqa2"])
    ids = token_ids(7, seed)
    cache = KVCache.for_model(config, 10)
    for start, end in chunks([3, 1, 1, 1, 1]):
        reference.forward_cached(params, config, ids[start:end], cache)
    h = reference.rms_norm(params["model.embed_tokens.weight"][ids], params["model.layers.0.input_layernorm.weight"],
                           config.rms_norm_eps)
    k = reference.linear(params, "model.layers.0.self_attn.k_proj", h).reshape(7, config.num_key_value_heads, 8)
    k = reference.rope(k.transpose(1, 0, 2), np.arange(7.0), config.rope_theta)
    np.testing.assert_allclose(cache.keys(0), k, rtol=1e-12, atol=1e-14)
    assert cache.keys(0).shape == cache.values(1).shape == (config.num_key_value_heads, 7, 8)
    assert np.all(cache.k[:, :, 7:] == 0), "slots past seq_len must be untouched"


def test_reference_cache_full_raises():
    _, params, config = tiny_model(KV_HEADS["mqa"], layers=1)
    cache = KVCache.for_model(config, 4)
    reference.forward_cached(params, config, [1, 2, 3], cache)
    with pytest.raises(ValueError, match="cache full"):
        reference.forward_cached(params, config, [4, 5], cache)


@pytest.mark.parametrize("window", [None, 3])
def test_greedy_generate_matches_recompute(window, seed):
    _, params, config = tiny_model(KV_HEADS["gqa4"], tied=True)
    prompt = token_ids(5, seed).tolist()
    seq = list(prompt)
    for _ in range(8):  # the slow way: a full forward over everything for every new token
        seq.append(int(np.argmax(reference.forward(params, config, seq, window=window)[-1])))
    assert reference.greedy_generate(params, config, prompt, 8, window=window) == seq[5:]


# --- (b) the torch model: cached forward == no-cache forward --------------------------------

@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("kv", list(KV_HEADS))
def test_torch_decode_equals_recompute(kv, schedule, seed):
    model, _, _ = tiny_model(KV_HEADS[kv])
    steps = chunks(SCHEDULES[schedule])
    ids = torch.from_numpy(token_ids(steps[-1][1], seed, batch=3))
    cache = model.new_cache(batch=3, max_len=steps[-1][1] + 2)  # a little spare capacity
    with torch.no_grad():
        full = model(ids)                                          # [3, seq, vocab], no cache
        for start, end in steps:
            got = model(ids[:, start:end], start_pos=start, cache=cache)
            assert rel_err(got, full[:, start:end]) <= 1e-12, f"step {start}:{end}, seed {seed}"


def test_torch_float32_decode_equals_recompute(seed):
    model, _, _ = tiny_model(KV_HEADS["gqa4"], dtype=torch.float32)
    ids = torch.from_numpy(token_ids(12, seed, batch=2))
    cache = model.new_cache(batch=2, max_len=12)
    with torch.no_grad():
        full = model(ids)
        for start, end in chunks([5, 3, 1, 1, 1, 1]):
            # float32: the two paths sum in different orders, so only rounding-level agreement
            assert rel_err(model(ids[:, start:end], start_pos=start, cache=cache), full[:, start:end]) <= 1e-5


@pytest.mark.parametrize("kv", ["gqa2", "mqa"])
def test_torch_cache_matches_reference_cache(kv, seed):
    """The torch model's cached decode and the NumPy one agree: same weights, same steps."""
    model, params, config = tiny_model(KV_HEADS[kv])
    ids = token_ids(10, seed)
    np_cache, torch_cache = KVCache.for_model(config, 10), model.new_cache(batch=1, max_len=10)
    with torch.no_grad():
        for start, end in chunks([4, 3, 1, 1, 1]):
            want = reference.forward_cached(params, config, ids[start:end], np_cache)
            got = model(torch.from_numpy(ids[None, start:end]), start_pos=start, cache=torch_cache)[0]
            assert rel_err(got, want) <= 1e-12
    for layer in range(config.num_hidden_layers):
        np.testing.assert_allclose(torch_cache.k[layer][0].numpy(), np_cache.keys(layer), rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(torch_cache.v[layer][0].numpy(), np_cache.values(layer), rtol=1e-12, atol=1e-13)


# --- (c) the ring buffer: sliding-window attention over W slots ----------------------------

@pytest.mark.parametrize("window", [1, 3, 8, 40])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (3, 1)])
def test_ring_attention_equals_windowed_reference(window, q_heads, kv_heads, seed):
    rng = np.random.default_rng(seed)
    L, D = 25, 8
    q = rng.standard_normal((1, q_heads, L, D))
    k, v = rng.standard_normal((2, 1, kv_heads, L, D))
    want, _ = attention(q, k, v, causal=True, window=window)                   # [1, q_heads, L, D]
    ring = RingKVCache(1, kv_heads, D, window)
    # chunks shorter and longer than the window, then single tokens
    for start, end in chunks([5, 10, 2, 1, 1, 1, 1, 1, 1, 1, 1]):
        k_vis, v_vis = ring.append(0, k[0, :, start:end], v[0, :, start:end])
        # what the chunk attends over: a contiguous run of positions ending at end - 1
        first = max(0, start - window + 1)
        np.testing.assert_array_equal(k_vis, k[0, :, first:end])
        out, _ = attention(q[:, :, start:end], k_vis[None], v_vis[None], causal=True, window=window)
        np.testing.assert_allclose(out, want[:, :, start:end], atol=1e-12, err_msg=f"{start}:{end} seed {seed}")
        # what stays cached: the last min(end, W) positions, each in slot pos % W
        np.testing.assert_array_equal(ring.keys(0), k[0, :, max(0, end - window):end])
        np.testing.assert_array_equal(ring.values(0), v[0, :, max(0, end - window):end])
        pos = ring.positions(0)
        held = pos[pos >= 0]
        assert sorted(held) == list(range(max(0, end - window), end))
        assert all(pos[p % window] == p for p in held)


def test_ring_positions_wrap():
    ring = RingKVCache(1, 1, 2, window=4)
    assert ring.positions().tolist() == [-1, -1, -1, -1]
    ring.append(0, np.zeros((1, 3, 2)), np.zeros((1, 3, 2)))
    assert ring.positions().tolist() == [0, 1, 2, -1]
    ring.append(0, np.zeros((1, 3, 2)), np.zeros((1, 3, 2)))
    assert ring.positions().tolist() == [4, 5, 2, 3]         # positions 4, 5 overwrote 0, 1
    assert RingKVCache.slot(np.arange(9), 4).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0]


@pytest.mark.parametrize("window", [1, 4, 7, 100])
@pytest.mark.parametrize("kv", ["gqa2", "mqa"])
def test_ring_model_equals_windowed_forward(kv, window, seed):
    _, params, config = tiny_model(KV_HEADS[kv])
    steps = chunks([6, 9, 1, 1, 1, 1, 1, 1])
    ids = token_ids(steps[-1][1], seed)
    ring = RingKVCache.for_model(config, window)
    for start, end in steps:
        got = reference.forward_cached(params, config, ids[start:end], ring)
        want = reference.forward(params, config, ids[:end], window=window)[start:end]
        assert rel_err(got, want) <= 1e-10, f"window {window}, step {start}:{end}, seed {seed}"
    # The window really changes the answer when it is shorter than the sequence (the test
    # above would be vacuous otherwise), and is a no-op when it is not.
    full = reference.forward(params, config, ids)
    windowed = reference.forward(params, config, ids, window=window)
    assert (rel_err(windowed, full) > 1e-3) if window < len(ids) else (rel_err(windowed, full) <= 1e-14)


# --- (d) memory ----------------------------------------------------------------------------

def test_cache_memory():
    """The contiguous cache costs ``kv_bytes_per_token · capacity``; the ring only ``· W``,
    however many tokens go through it."""
    _, params, config = tiny_model(KV_HEADS["gqa4"])
    shape = costs.ModelShape("tiny", layers=config.num_hidden_layers, hidden=config.hidden_size,
                             heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                             head_dim=config.head_dim, intermediate=config.intermediate_size, vocab=VOCAB)
    per_token = costs.kv_bytes_per_token(shape, dtype_bytes=8)             # float64 caches
    assert KVCache.for_model(config, 30).nbytes == 30 * per_token
    W = 5
    ring = RingKVCache.for_model(config, W)
    ids = token_ids(40, 0)
    reference.forward_cached(params, config, ids[:12], ring)                # a prefill longer than W
    for t in range(12, 40):
        reference.forward_cached(params, config, ids[t:t + 1], ring)
        assert ring.k.shape[2] == ring.v.shape[2] == ring.slots == W
        assert ring.nbytes == W * per_token
        assert ring.keys(0).shape[1] == W
    assert ring.seq_len == 40 and sorted(ring.positions(1)) == list(range(35, 40))
