"""Tests for minillm.costs: every closed form is checked against an independent count."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from minillm import costs as C
from minillm.reference.ch01_naive_attention import attention_mask

TINY = [
    C.ModelShape("tiny-mha", layers=2, hidden=8, heads=2, kv_heads=2, head_dim=4, intermediate=12, vocab=11),
    C.ModelShape("tiny-gqa", layers=3, hidden=12, heads=4, kv_heads=2, head_dim=3, intermediate=20, vocab=7,
                 qkv_bias=True),
    C.ModelShape("tiny-mqa", layers=1, hidden=6, heads=3, kv_heads=1, head_dim=2, intermediate=10, vocab=5,
                 gated_mlp=False, tied_embeddings=True),
]


# ----------------------------------------------------------------- brute-force counters
def brute_force_layer_flops(shape, q_len, kv_len, causal=True):
    """Count one layer's multiply-adds scalar by scalar, with explicit loops."""
    D, I, d = shape.hidden, shape.intermediate, shape.head_dim
    mlp = [(D, I), (D, I), (I, D)] if shape.gated_mlp else [(D, I), (I, D)]
    proj = [(D, shape.heads * d), (D, shape.kv_heads * d), (D, shape.kv_heads * d), (shape.heads * d, D)]
    linear = 0
    for _token in range(q_len):
        for k_in, n_out in proj + mlp:
            for _o, _i in itertools.product(range(n_out), range(k_in)):
                linear += 2
    attn = 0
    visible = attention_mask(q_len, kv_len, causal=causal)
    for _h in range(shape.heads):
        for i, j in itertools.product(range(q_len), range(kv_len)):
            if visible[i, j]:
                attn += 2 * d  # s_ij = q_i · k_j
                attn += 2 * d  # o_i += p_ij * v_j
    return linear, attn


def torch_layer(shape, x, k_cache_len):
    """A tiny decoder layer in torch (no norms/rope), used under FlopCounterMode.
    ``x``: [q_len, D] new tokens; attends (non-causally) to ``k_cache_len`` keys."""
    D, d, H, Hkv = shape.hidden, shape.head_dim, shape.heads, shape.kv_heads
    g = torch.Generator().manual_seed(0)
    W = {name: torch.randn(k, n, generator=g) for name, k, n in C.layer_gemms(shape)}
    cached = k_cache_len - x.shape[0]
    q = (x @ W["q"]).view(-1, H, d).transpose(0, 1)                        # [H, q_len, d]
    k = torch.cat([torch.randn(cached, Hkv * d, generator=g), x @ W["k"]])  # cache + new keys
    v = torch.cat([torch.randn(cached, Hkv * d, generator=g), x @ W["v"]])
    k = k.view(-1, Hkv, d).transpose(0, 1).repeat_interleave(H // Hkv, 0)  # [H, kv_len, d]
    v = v.view(-1, Hkv, d).transpose(0, 1).repeat_interleave(H // Hkv, 0)
    p = torch.softmax(q @ k.transpose(1, 2) / d**0.5, -1)
    o = (p @ v).transpose(0, 1).reshape(-1, H * d) @ W["o"]
    h = x + o
    if shape.gated_mlp:
        m = (torch.nn.functional.silu(h @ W["gate"]) * (h @ W["up"])) @ W["down"]
    else:
        m = torch.nn.functional.gelu(h @ W["up"]) @ W["down"]
    return h + m


# ----------------------------------------------------------------- model configs
@pytest.mark.parametrize("shape,expected", [
    (C.LLAMA2_7B, 6_738_415_616),
    (C.LLAMA2_70B, 68_976_648_192),
    (C.LLAMA3_8B, 8_030_261_248),
    (C.QWEN25_7B, 7_615_616_512),
])
def test_parameter_counts_match_published_checkpoints(shape, expected):
    assert shape.params() == expected


def test_mha_shape_has_12_d_squared_weights():
    for D in (64, 512, 4096):
        assert C.mha_shape(D, heads=8).linear_params_per_layer() == 12 * D * D


def test_gqa_shape_rejects_bad_heads():
    with pytest.raises(ValueError):
        C.ModelShape("bad", 1, 8, heads=3, kv_heads=2, head_dim=4, intermediate=8, vocab=4)


# ----------------------------------------------------------------- FLOP counts
@pytest.mark.parametrize("shape", TINY, ids=lambda s: s.name)
@pytest.mark.parametrize("q_len,kv_len,causal", [(5, 5, True), (5, 5, False), (1, 7, True), (3, 8, True),
                                                 (4, 6, False)])
def test_flops_match_brute_force(shape, q_len, kv_len, causal):
    lin, attn = brute_force_layer_flops(shape, q_len, kv_len, causal)
    assert C.linear_flops(shape, q_len) == lin
    assert C.attention_flops(shape, q_len, kv_len, causal) == attn


@pytest.mark.parametrize("shape", TINY, ids=lambda s: s.name)
@pytest.mark.parametrize("q_len,kv_len", [(6, 6), (1, 9), (2, 5)])
def test_flops_match_torch_flop_counter(shape, q_len, kv_len):
    """torch's own FLOP counter on a real (tiny) layer agrees with the closed forms.
    The torch layer computes the full (non-causal) score matrix, as naive attention does."""
    x = torch.randn(q_len, shape.hidden)
    with FlopCounterMode(display=False) as counter:
        torch_layer(shape, x, kv_len)
    expected = C.linear_flops(shape, q_len) + C.attention_flops(shape, q_len, kv_len, causal=False)
    assert counter.get_total_flops() == expected


def test_attention_pairs():
    assert C.attention_pairs(4, 4) == 10          # 1+2+3+4
    assert C.attention_pairs(1, 100) == 100       # decode sees the whole cache
    assert C.attention_pairs(4, 4, causal=False) == 16
    for q, kv in [(3, 7), (7, 7), (1, 1)]:
        assert C.attention_pairs(q, kv) == int(attention_mask(q, kv, causal=True).sum())
    with pytest.raises(ValueError):
        C.attention_pairs(5, 4)


def test_linear_flops_is_two_per_weight_per_token():
    for m in C.MODELS.values():
        assert C.linear_flops(m, 7) == 2 * 7 * m.linear_params_per_layer()


# ----------------------------------------------------------------- bytes and intensity
def test_gemm_bytes_and_intensity():
    assert C.gemm_bytes(2, 3, 4, dtype_bytes=2) == 2 * (8 + 12 + 6)
    # matrix-vector in fp16: ~1 FLOP/byte; square GEMM: n/3 FLOP/byte
    mv = C.gemm_flops(1, 4096, 4096) / C.gemm_bytes(1, 4096, 4096)
    assert 0.99 < mv < 1.0
    sq = C.gemm_flops(4096, 4096, 4096) / C.gemm_bytes(4096, 4096, 4096)
    assert sq == pytest.approx(4096 / 3)


@pytest.mark.parametrize("batch", [1, 4, 64, 256])
@pytest.mark.parametrize("context", [128, 4096, 32768])
def test_decode_attention_intensity_is_below_one_for_mha_fp16(batch, context):
    c = C.decode_costs(C.LLAMA2_7B, context, batch).attention
    assert c.intensity < 1.0
    assert c.intensity == pytest.approx(context / (context + 1))   # exact: L/(L+1), batch-free


def test_decode_attention_intensity_is_bounded_by_group_size():
    for m in (C.LLAMA3_8B, C.QWEN25_7B, C.LLAMA2_70B):
        i = C.decode_costs(m, 8192, batch=32).attention.intensity
        assert m.group_size * 0.99 < i < m.group_size
    # fp32 halves it
    assert C.attention_cost(C.LLAMA2_7B, 1, 4096, dtype_bytes=4).intensity < 0.5


def test_decode_gemm_intensity_grows_with_batch():
    ints = [C.decode_costs(C.LLAMA2_7B, 1024, b).linear.intensity for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert all(a < b for a, b in zip(ints, ints[1:]))
    assert 0.99 < ints[0] < 1.0          # batch 1 is matrix-vector: ~1 FLOP/byte in fp16
    assert ints[-1] == pytest.approx(256, rel=0.1)  # ≈ batch while batch << D


def test_prefill_is_compute_heavy():
    c = C.prefill_costs(C.LLAMA2_7B, 4096)
    assert c.linear.intensity > 1000
    assert c.attention.intensity == pytest.approx((4096 + 1) / 4)  # MHA causal: (L+1)/4


def test_opcost_arithmetic():
    a = C.OpCost(10, 5)
    assert (a + a).intensity == 2 and (3 * a).flops == 30 and (a * 3).bytes == 15


# ----------------------------------------------------------------- roofline
def test_roofline_and_ridge():
    peak, bw = 789e12, 4.27e12
    ridge = C.ridge_point(peak, bw)
    assert ridge == pytest.approx(184.8, rel=1e-3)
    assert C.attainable(ridge, peak, bw) == pytest.approx(peak)
    assert C.attainable(1.0, peak, bw) == pytest.approx(bw)
    assert C.attainable(10 * ridge, peak, bw) == peak
    xs = np.logspace(-1, 4, 50)
    ys = C.attainable(xs, peak, bw)
    assert np.all(np.diff(ys) >= 0) and ys.max() == peak
    assert C.roofline_time(2e12, 1e9, 1e12, 1e12) == pytest.approx(2.0)
    assert C.roofline_time(1e9, 3e12, 1e12, 1e12) == pytest.approx(3.0)


def test_decode_step_time_is_weight_read_time():
    """At batch 1 a decode step costs about (weight bytes)/(bandwidth)."""
    peak, bw = 789e12, 4.27e12
    t = C.step_time(C.LLAMA2_7B, C.decode_costs(C.LLAMA2_7B, 16, 1), peak, bw, lm_head_rows=1)
    weights_only = (C.LLAMA2_7B.weight_bytes() - 2 * C.LLAMA2_7B.vocab * C.LLAMA2_7B.hidden) / bw
    assert weights_only < t < 1.02 * C.LLAMA2_7B.weight_bytes() / bw


# ----------------------------------------------------------------- attention / linear ratio
@pytest.mark.parametrize("D", [64, 256, 1024])
@pytest.mark.parametrize("L", [1, 17, 300, 4096])
def test_mha_ratio_closed_form_matches_explicit_count(D, L):
    shape = C.mha_shape(D, heads=8)
    explicit = C.attention_flops(shape, L, L) / C.linear_flops(shape, L)
    assert C.mha_flop_ratio(L, D) == pytest.approx(explicit, rel=1e-12)
    assert C.attention_linear_flop_ratio(shape, L) == pytest.approx(explicit, rel=1e-12)
    # decode: the newest token at position L sees L keys
    explicit_dec = C.attention_flops(shape, 1, L) / C.linear_flops(shape, 1)
    assert C.attention_linear_flop_ratio(shape, L, "decode") == pytest.approx(explicit_dec)
    assert explicit_dec == pytest.approx(L / (6 * D))


def test_mha_ratio_on_brute_force_tiny_layer():
    shape = C.mha_shape(8, heads=2)
    for L in (1, 5, 12):
        lin, attn = brute_force_layer_flops(shape, L, L)
        assert attn / lin == pytest.approx((L + 1) / (12 * 8))


def test_quoted_rule_is_consistent_ratio_plus_w_o():
    """(L+D)/(12D) = (causal attention + the W_O projection) / (all GEMMs), in the L²/2 limit."""
    D, L = 4096, 8192
    shape = C.mha_shape(D)
    attn_cont = 4 * D * L * L / 2                        # L²/2 pairs: continuous causal count
    w_o = C.gemm_flops(L, D, D)
    assert (attn_cont + w_o) / C.linear_flops(shape, L) == pytest.approx(C.quoted_flop_ratio(L, D))
    assert C.quoted_flop_ratio(L, D) - C.mha_flop_ratio(L, D) == pytest.approx(1 / 12, abs=1e-4)


def test_crossover_at_twelve_d():
    for D in (1024, 4096, 8192):
        shape = C.mha_shape(D)
        L = C.crossover_context(shape)
        assert L == 12 * D - 1
        assert C.attention_flops(shape, int(L), int(L)) == C.linear_flops(shape, int(L))
        assert C.crossover_context(shape, "decode") == 6 * D
    # real models: attention catches up later when the MLP is wider than 8·D² worth of weights
    assert C.crossover_context(C.LLAMA2_7B) == pytest.approx(49407)
    assert C.crossover_context(C.QWEN25_7B) > C.crossover_context(C.LLAMA3_8B) > C.crossover_context(C.LLAMA2_7B)


# ----------------------------------------------------------------- memory budget
def test_kv_bytes_per_token():
    assert C.kv_bytes_per_token(C.LLAMA2_7B) == 524288          # 2·32·32·128·2 = 512 KiB
    assert C.kv_bytes_per_token(C.LLAMA3_8B) == 128 * 1024       # GQA 8 KV heads: 128 KiB
    assert C.kv_bytes_per_token(C.LLAMA2_70B) == 320 * 1024
    assert C.kv_bytes_per_token(C.QWEN25_7B) == 56 * 1024
    assert C.kv_bytes_per_token(C.LLAMA3_8B, dtype_bytes=1) == 64 * 1024


def test_memory_needed_and_max_batch():
    M, a, b, L = 10.0, 1.0, 0.5, 8
    assert C.memory_needed(M, a, b, batch=3, total_tokens=24) == 10 + 3 + 12
    bs = C.max_batch(100.0, M, a, b, L)
    assert bs == 18                                       # 90 / (1 + 4) = 18
    assert C.memory_needed(M, a, b, bs, bs * L) <= 100 < C.memory_needed(M, a, b, bs + 1, (bs + 1) * L)
    assert C.max_batch(5.0, M, a, b, L) == 0              # weights don't fit
    assert C.max_batch(100.0, M, a, b, L, unshared=0.5) == 30   # shared prefix: 90 / (1 + 2)


def test_max_batch_monotonic():
    GiB = 2**30
    m = C.LLAMA2_7B
    M, a, b = m.weight_bytes(), C.decode_temp_bytes_per_seq(m), C.kv_bytes_per_token(m)
    by_mem = [C.max_batch(g * GiB, M, a, b, 4096) for g in (16, 24, 40, 80, 141)]
    assert all(x <= y for x, y in zip(by_mem, by_mem[1:])) and by_mem[0] < by_mem[-1]
    by_ctx = [C.max_batch(80 * GiB, M, a, b, L) for L in (512, 1024, 4096, 16384)]
    assert all(x >= y for x, y in zip(by_ctx, by_ctx[1:])) and by_ctx[0] > by_ctx[-1]


def test_gqa_fits_about_four_times_the_batch():
    GiB = 2**30
    def bs(m):
        return C.max_batch(80 * GiB, m.weight_bytes(), C.decode_temp_bytes_per_seq(m),
                           C.kv_bytes_per_token(m), 4096)
    assert bs(C.LLAMA2_7B) == 33
    assert 3.5 < bs(C.LLAMA3_8B) / bs(C.LLAMA2_7B) < 4.0


def test_alpha_estimate_is_small_next_to_kv():
    for m in C.MODELS.values():
        alpha = C.decode_temp_bytes_per_seq(m)
        assert 0 < alpha < 2 * 2**20                       # under 2 MiB per sequence
        assert alpha < 0.05 * 1024 * C.kv_bytes_per_token(m)  # < 5 % of a 1k-token cache


# ----------------------------------------------------------------- shapes from configs, KV-cache table
def test_shape_from_config_matches_published_shapes():
    from minillm.model.config import ModelConfig

    hf = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
          "rope_theta": 500000.0, "tie_word_embeddings": False}
    for source in (hf, ModelConfig.from_dict(hf)):
        s = C.ModelShape.from_config(source, name="Llama-3-8B")
        assert s == C.LLAMA3_8B
    qwen = dict(hf, model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4)
    s = C.ModelShape.from_config(qwen)
    assert s.name == "qwen2" and s.qkv_bias and s.head_dim == 128
    assert s.params() == C.QWEN25_7B.params()
    tied = C.ModelShape.from_config(dict(hf, tie_word_embeddings=True))
    assert tied.params() == C.LLAMA3_8B.params() - 128256 * 4096


def test_kv_variants_of_llama3():
    mha, gqa, mqa = C.kv_variants(C.LLAMA3_8B)
    assert (mha.kv_heads, gqa.kv_heads, mqa.kv_heads) == (32, 8, 1)
    assert gqa is C.LLAMA3_8B and mha.name == "Llama-3-8B (MHA)" and mqa.name == "Llama-3-8B (MQA)"
    # K and V projections: 32 layers x 2 x 4096 x (kv_width difference)
    assert mha.params() == 8_030_261_248 + 32 * 2 * 4096 * (4096 - 1024) == 8_835_567_616
    assert mqa.params() == 8_030_261_248 - 32 * 2 * 4096 * (1024 - 128) == 7_795_380_224
    assert [C.kv_bytes_per_token(s) for s in (mha, gqa, mqa)] == [512 * 1024, 128 * 1024, 16 * 1024]
    assert len(C.kv_variants(C.LLAMA2_7B)) == 2  # already MHA: itself and its MQA variant


def test_kv_cache_table_hand_computed():
    GiB = 2**30
    table = {r["name"]: r for r in C.kv_cache_table()}
    assert list(table) == ["Llama-2-7B", "Llama-2-70B", "Llama-3-8B", "Qwen2.5-7B",
                           "Llama-3-8B (MHA)", "Llama-3-8B (MQA)"]
    l2 = table["Llama-2-7B"]
    assert l2["kv_bytes_per_token"] == 2 * 32 * 32 * 128 * 2 == 524288          # 512 KiB
    assert l2["kv_bytes_per_seq"] == 2 * GiB                                   # 4096 tokens
    assert l2["alpha_bytes"] == (3 * 4096 + 4096 + 2 * 4096 + 3 * 11008) * 2 + 2 * 32000 * 4 == 371200
    # (80 GiB - 2 x 6,738,415,616) / (2 GiB + 371,200) = 33.7
    assert l2["max_batch"] == 33 and l2["max_tokens"] == 33 * 4096
    l3 = table["Llama-3-8B"]
    assert l3["kv_bytes_per_token"] == 128 * 1024 and l3["kv_fraction_of_mha"] == 0.25
    assert l3["alpha_bytes"] == (3 * 4096 + 4096 + 2 * 1024 + 3 * 14336) * 2 + 2 * 128256 * 4 == 1148928
    assert l3["max_batch"] == (80 * GiB - 2 * 8_030_261_248) // (128 * 1024 * 4096 + 1148928) == 129
    assert table["Qwen2.5-7B"]["kv_bytes_per_token"] == 2 * 28 * 4 * 128 * 2 == 56 * 1024
    assert table["Llama-2-70B"]["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert table["Llama-2-70B"]["max_batch"] == 0                               # 138 GB of weights
    assert table["Llama-3-8B (MQA)"]["attention"] == "MQA" and table["Llama-3-8B (MHA)"]["attention"] == "MHA"
    assert table["Llama-3-8B"]["attention"] == "GQA (4 q/kv)"
    bs = [table[n]["max_batch"] for n in ("Llama-3-8B (MHA)", "Llama-3-8B", "Llama-3-8B (MQA)")]
    assert bs[0] < bs[1] < bs[2]
    # any shape, other memory, an fp8 cache
    tiny = C.ModelShape("tiny", layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=12, vocab=11)
    (row,) = C.kv_cache_table([tiny], mem_bytes=10_000, context=10, kv_dtype_bytes=1)
    assert row["kv_bytes_per_token"] == 2 * 2 * 1 * 4 * 1 == 16
    M = tiny.params() * 2
    assert row["max_batch"] == (10_000 - M) // (row["alpha_bytes"] + 16 * 10)


# ----------------------------------------------------------------- one token with and without the KV cache
TINY_MHA = TINY[0]  # layers 2, D 8, H 2, d 4, I 12, V 11: 544 GEMM weights per layer


def test_per_token_costs_hand_computed_tiny():
    s = TINY_MHA
    assert s.linear_params_per_layer() == 4 * 64 + 3 * 8 * 12 == 544
    head = 2 * 8 * 11                                                           # LM head, one row
    # cached, context 5: 1 row through the GEMMs, the new token sees 6 keys (4·H·d = 32 FLOPs a key)
    c = C.per_token_costs(s, 5)
    assert c.flops == 2 * (2 * 544 + 32 * 6) + head == 2736
    lin_bytes = 2 * (4 * (8 + 64 + 8) + 2 * (8 + 96 + 12) + (12 + 96 + 8))    # weights + 1-row activations
    attn_bytes = 2 * (2 * 8 + 2 * 6 * 8)                                        # Q, O; K, V of 6 tokens
    assert c.bytes == 2 * (lin_bytes + attn_bytes) + 2 * (8 + 88 + 11) == 3334
    # no cache, context 5: a 6-token prefill, 21 causal pairs per head
    u = C.per_token_costs(s, 5, cached=False)
    assert u.flops == 2 * (6 * 2 * 544 + 32 * 21) + head == 14576
    assert C.per_token_costs(s, 5, cached=False, logits="all").flops == 14576 + 5 * head
    assert C.per_token_costs(s, 5, logits="all") == c                          # one position anyway
    # context 0: both are the same one-token forward
    assert C.per_token_costs(s, 0) == C.per_token_costs(s, 0, cached=False)
    with pytest.raises(ValueError):
        C.per_token_costs(s, 3, logits="some")
    with pytest.raises(ValueError):
        C.per_token_costs(s, -1)


@pytest.mark.parametrize("shape", TINY, ids=lambda s: s.name)
def test_per_token_costs_match_brute_force(shape):
    for ctx in (0, 3, 6):
        lin, attn = brute_force_layer_flops(shape, 1, ctx + 1)
        head = 2 * shape.hidden * shape.vocab
        assert C.per_token_costs(shape, ctx).flops == shape.layers * (lin + attn) + head
        lin, attn = brute_force_layer_flops(shape, ctx + 1, ctx + 1)
        assert C.per_token_costs(shape, ctx, cached=False).flops == shape.layers * (lin + attn) + head


def test_per_token_costs_batch_scaling():
    s = C.LLAMA3_8B
    one, many = C.per_token_costs(s, 1000), C.per_token_costs(s, 1000, batch=16)
    assert many.flops == 16 * one.flops                     # every FLOP is per sequence
    assert many.bytes < 2 * one.bytes                       # the weights are read once for all 16
    u1, u16 = C.per_token_costs(s, 1000, cached=False), C.per_token_costs(s, 1000, batch=16, cached=False)
    assert u16.flops == 16 * u1.flops


def test_cached_decode_step_reads_weights_and_kv_once():
    """Llama-2-7B, batch 1, 4095 tokens before: bytes ≈ GEMM and head weights + 4096 tokens of K/V."""
    s, ctx = C.LLAMA2_7B, 4095
    c = C.per_token_costs(s, ctx)
    weights = 2 * (s.layers * s.linear_params_per_layer() + s.vocab * s.hidden)
    kv = C.kv_bytes_per_token(s) * (ctx + 1)
    assert kv == 2 * 2**30
    extra = c.bytes - weights - kv                          # 1-row activations: ~5.6 MB
    per_layer = 4 * (4096 + 4096) + 3 * (4096 + 11008) + 2 * 4096  # GEMM ins + outs, attention Q and O
    assert extra == 2 * (32 * per_layer + 4096 + 32000) == 5_593_600
    assert c.flops == 2 * (s.layers * s.linear_params_per_layer() + s.vocab * s.hidden) \
        + s.layers * 4 * 32 * 128 * 4096
    # without the cache, the same step does (context+1)x the GEMM FLOPs, plus causal attention
    u = C.per_token_costs(s, ctx, cached=False)
    assert u.flops == 4096 * 2 * s.layers * s.linear_params_per_layer() + 2 * s.vocab * s.hidden \
        + s.layers * 4 * 32 * 128 * 4096 * 4097 // 2
    assert 3000 < u.flops / c.flops < 4096


def test_per_token_growth_linear_with_cache_superlinear_without():
    s = TINY[1]
    cached = np.array([C.per_token_costs(s, c).flops for c in range(50)])
    assert np.all(np.diff(cached, 2) == 0) and np.all(np.diff(cached) == s.layers * 4 * s.q_width)
    uncached = np.array([C.per_token_costs(s, c, cached=False).flops for c in range(50)])
    # second difference = the attention's quadratic term: 4·H·d per new pair row, per layer
    assert np.all(np.diff(uncached, 2) == s.layers * 4 * s.q_width)


def test_per_token_time_is_roofline_of_the_step():
    peak, bw = 789e12, 4.27e12
    s = C.LLAMA2_7B
    t = C.per_token_time(s, 15, peak, bw)
    assert t == pytest.approx(C.step_time(s, C.decode_costs(s, 16), peak, bw, lm_head_rows=1))
    assert t == pytest.approx(C.per_token_costs(s, 15).bytes / bw, rel=1e-3)   # batch 1: memory-bound
    tu = C.per_token_time(s, 4095, peak, bw, cached=False)
    assert tu == pytest.approx(C.step_time(s, C.prefill_costs(s, 4096), peak, bw, lm_head_rows=1))
    assert tu > 20 * C.per_token_time(s, 4095, peak, bw)
    assert C.per_token_time(s, 99, peak, bw, cached=False, logits="all") > C.per_token_time(s, 99, peak, bw,
                                                                                            cached=False)


# ----------------------------------------------------------------- generating n tokens
def test_generation_costs_hand_computed_tiny():
    s, P, n = TINY_MHA, 3, 4
    steps = C.generation_step_costs(s, P, n)
    assert len(steps) == n
    # step 0 is the prompt's prefill in both cases; then decode at contexts 3, 4, 5
    assert steps[0] == C.per_token_costs(s, P - 1, cached=False)
    assert steps[1:] == [C.per_token_costs(s, c) for c in (3, 4, 5)]
    head = 176
    total = C.generation_costs(s, P, n)
    assert total.flops == (2 * (3 * 1088 + 32 * 6) + head) + sum(2 * (1088 + 32 * (c + 1)) + head for c in (3, 4, 5))
    unc = C.generation_costs(s, P, n, cached=False)
    # prefills of 3, 4, 5, 6 tokens: T·1088 GEMM FLOPs and T(T+1)/2 pairs per layer
    assert unc.flops == sum(2 * (T * 1088 + 32 * T * (T + 1) // 2) + head for T in (3, 4, 5, 6))
    assert C.generation_costs(s, P, 1) == C.generation_costs(s, P, 1, cached=False)
    assert C.generation_costs(s, P, 0) == C.OpCost(0, 0)
    with pytest.raises(ValueError):
        C.generation_step_costs(s, 0, 3)


def test_generation_total_is_linear_with_cache_quadratic_without():
    """Llama-2-7B from a 1-token prompt: n → 2n doubles the cached work (attention is < 1 % at
    these lengths) and quadruples the uncached GEMM work."""
    s = C.LLAMA2_7B
    for n in (256, 512):
        with_ = C.generation_costs(s, 1, 2 * n).flops / C.generation_costs(s, 1, n).flops
        without = C.generation_costs(s, 1, 2 * n, cached=False).flops / C.generation_costs(s, 1, n, cached=False).flops
        assert with_ == pytest.approx(2.0, rel=0.02)
        assert without == pytest.approx(4.0, rel=0.05)
    # without the cache, n tokens cost ≈ n²/2 tokens' worth of GEMMs
    n = 512
    gemm_per_token = 2 * s.layers * s.linear_params_per_layer()
    unc = C.generation_costs(s, 1, n, cached=False).flops
    assert unc > gemm_per_token * n * (n + 1) / 2
    assert C.generation_costs(s, 1, n).flops < 1.02 * (gemm_per_token + 2 * s.vocab * s.hidden) * n


# =========================================================================== kernels, by chapter
def test_total_and_per_array_bytes():
    t = {"a": {"read": 1, "write": 2}, "b": {"read": 10, "write": 0}}
    assert C.total_bytes(t) == 13
    assert C.per_array_bytes(t) == {"a": 3, "b": 10}


# --------------------------------------------------------------------------- Chapter 1
def test_nominal_attention_flops():
    assert C.nominal_attention_flops(2, 3, 5, 7, 11, causal=False) == 4 * 2 * 3 * 5 * 7 * 11
    assert C.nominal_attention_flops(2, 3, 5, 7, 11, causal=True) == 2 * 2 * 3 * 5 * 7 * 11
    assert C.nominal_attention_flops(1, 1, 8, 8, 8, causal=True, backward=True) == 2.5 * 2 * 8 ** 3
    assert C.nominal_attention_flops(1, 16, 4096, 4096, 128, False) == 4 * 16 * 4096 ** 2 * 128
    assert C.nominal_attention_flops(1, 16, 4096, 4096, 128, True) == 2 * 16 * 4096 ** 2 * 128


def test_attention_head_flops_counts_the_visible_pairs():
    # bottom-right aligned: `new` queries after `cached` keys see cached + i + 1 keys each
    for cached, new in ((0, 1), (0, 7), (5, 3), (100, 1)):
        pairs = sum(cached + i + 1 for i in range(new))
        assert C.attention_head_flops(new, cached + new, 16) == 4 * 16 * pairs
    assert C.attention_head_flops(3, 5, 8, causal=False) == 4 * 8 * 15
    s = TINY[1]
    assert C.attention_flops(s, 3, 5) == s.heads * C.attention_head_flops(3, 5, s.head_dim)


def test_naive_attention_traffic_is_the_eight_matrix_accesses():
    b, h, hk, n, d, e = 2, 8, 2, 1000, 64, 2
    t = C.naive_attention_traffic(b, h, hk, n, n, d, e)
    q = o = b * h * n * d * e
    kv = b * hk * n * d * e
    s, p = b * h * n * n * 4, b * h * n * n * e
    lse = b * h * n * 4
    assert t["scores"] == {"read": q + kv, "write": s}
    assert t["softmax"] == {"read": s, "write": p + lse}
    assert t["pv"] == {"read": p + kv, "write": o}
    # Q, K, S(w), S(r), P(w), P(r), V, O: the N² terms dominate once N >> d.
    assert C.total_bytes(t) == q + kv + s + s + p + p + kv + o + lse
    # the scores pass writes N² fp32 values per head
    t = C.naive_attention_traffic(1, 16, 16, 1024, 1024, 64, 2)
    assert t["scores"]["write"] == 16 * 1024 * 1024 * 4


# --------------------------------------------------------------------------- Chapter 2
def test_kv_cache_bytes():
    assert C.kv_cache_bytes(1000, 8, 128, 2) == 2 * 1000 * 8 * 128 * 2
    assert C.kv_cache_bytes(10, 2, 4, 4, layers=3) == 3 * C.kv_cache_bytes(10, 2, 4, 4)
    for s in (C.LLAMA2_7B, C.LLAMA3_8B, *TINY):
        assert C.kv_bytes_per_token(s, 2) == C.kv_cache_bytes(1, s.kv_heads, s.head_dim, 2, layers=s.layers)


def test_decode_attention_bytes():
    lens, hq, hk, d, e = [100, 0, 7], 8, 2, 64, 2
    kv = 2 * hk * 107 * d * e
    assert C.decode_attention_bytes(lens, hq, hk, d, e) == kv + 2 * 3 * hq * d * e + 3 * hq * 4


# --------------------------------------------------------------------------- Chapter 3
def test_online_softmax_traffic():
    r, n = 4096, 65536
    streamed = C.online_softmax_traffic(r, n, 2)
    assert streamed == {"read": 2 * r * n * 2, "write": r * n * 2 + 4 * r, "minimal": 2 * r * n * 2 + 4 * r}
    assert C.online_softmax_traffic(r, 100, 4, block_n=64)["read"] == 2 * r * 100 * 4
    assert C.online_softmax_traffic(r, 100, 4, block_n=128)["read"] == r * 100 * 4


def test_online_softmax_traffic_default_block_is_the_kernels():
    from minillm.kernels.ch03_online_softmax import MAX_ONE_TILE

    r = 4096
    fits = C.online_softmax_traffic(r, MAX_ONE_TILE, 4, out_bytes=2)
    assert fits["read"] == r * MAX_ONE_TILE * 4 and fits["write"] == r * MAX_ONE_TILE * 2 + 4 * r
    assert C.online_softmax_traffic(r, MAX_ONE_TILE + 1, 4)["read"] == 2 * r * (MAX_ONE_TILE + 1) * 4


def test_tiled_attention_traffic_is_the_reference_schedule(seed):
    """The kernel's traffic formula is the count of the NumPy reference run with the
    kernel's K/V block (the two follow one schedule); Q is read once per K/V block."""
    from minillm.reference.ch03_online_softmax import HBM, tiled_attention

    rng = np.random.default_rng(seed)
    batch, heads, q_len, kv_len, d = 1, 2, 70, 150, 16
    q = rng.standard_normal((batch, heads, q_len, d))
    k, v = rng.standard_normal((2, batch, 1, kv_len, d))
    hbm = HBM()
    tiled_attention(q, k, v, causal=True, block_q=64, block_kv=64, hbm=hbm)
    counted = hbm.bytes({"q": 2, "k": 2, "v": 2, "out": 2, "o": 4, "l": 4, "m": 4, "lse": 4})
    want = C.tiled_attention_traffic(batch, heads, q_len, kv_len, d, 2, block_n=64)
    assert want == C.fa1_traffic(batch, heads, q_len, kv_len, d, 2, 64)
    assert {n: rw for n, rw in want.items() if rw["read"] or rw["write"]} == counted
    assert want["q"]["read"] == 3 * batch * heads * q_len * d * 2          # ⌈150 / 64⌉ = 3 K/V blocks


def test_tiled_attention_traffic_default_block_is_the_kernels():
    from minillm.kernels.ch03_online_softmax import FA1_BLOCK_N

    assert C.tiled_attention_traffic(2, 4, 300, 500, 64, 2) == C.fa1_traffic(2, 4, 300, 500, 64, 2, FA1_BLOCK_N)


def test_fa1_traffic_against_naive():
    from minillm.reference.ch03_online_softmax import A100_SRAM_BYTES, fa1_block_sizes

    # Chapter 1's count (eight matrix accesses) is what traffic_comparison calls naive.
    for n, d in ((1000, 64), (4096, 128)):
        naive = C.total_bytes(C.naive_attention_traffic(1, 1, 1, n, n, d, 2))
        assert C.traffic_comparison(n, d)["naive_bytes"] == naive == 4 * n * d * 2 + n * n * (4 + 4 + 2 + 2) + 4 * n
    # The A100 example, N = 4096: FA1 moves 7x fewer bytes at d = 64, only 1.8x at d = 128.
    c64, c128 = C.traffic_comparison(4096, 64), C.traffic_comparison(4096, 128)
    assert (c64["block_q"], c64["block_kv"]) == (64, 384)
    assert 6.5 < c64["naive_over_fa1"] < 7.5 and 1.5 < c128["naive_over_fa1"] < 2.0
    assert C.traffic_comparison(4096, 64, sram_bytes=A100_SRAM_BYTES) == c64
    # One K/V block (Bc >= N) is the minimum: read Q, K, V once, write out and lse once.
    n, d = 300, 64
    assert C.total_bytes(C.fa1_traffic(1, 1, n, n, d, 2, block_kv=n)) == 4 * n * d * 2 + 4 * n
    # The quadratic part is Θ(N²d²/M): doubling the SRAM halves it.
    n = 1 << 15
    linear = C.total_bytes(C.fa1_traffic(1, 1, n, n, d, 2, block_kv=n))
    quad = [C.total_bytes(C.fa1_traffic(1, 1, n, n, d, 2, fa1_block_sizes(m, d)[1])) - linear
            for m in (A100_SRAM_BYTES, 2 * A100_SRAM_BYTES)]
    assert quad[0] / quad[1] == pytest.approx(2.0, rel=0.03)  # (Tc₁ - 1)/(Tc₂ - 1) = 85/42


# --------------------------------------------------------------------------- Chapter 4
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 40)])
def test_fa2_traffic_is_the_reference_count(causal, window, seed):
    """The closed form equals what `fa2_forward` moves through its counting HBM."""
    from minillm.reference.ch03_online_softmax import HBM
    from minillm.reference.ch04_flash_attention import fa2_forward

    rng = np.random.default_rng(seed)
    b, h, n, d, bm, bn = 1, 2, 100, 8, 32, 16
    q, k, v = (rng.standard_normal((b, h, n, d)) for _ in range(3))
    hbm = HBM()
    fa2_forward(q, k, v, causal=causal, window=window, block_m=bm, block_n=bn, hbm=hbm)
    counted = hbm.bytes({"q": 2, "k": 2, "v": 2, "o": 2, "lse": 4})
    want = C.fa2_traffic(b, h, n, n, d, bm, bn, causal, window)
    assert {name: rw for name, rw in want.items() if rw["read"] or rw["write"]} == counted
    full = C.fa2_traffic(b, h, n, n, d, bm, bn)
    assert full["k"]["read"] == b * h * -(-n // bm) * n * d * 2            # every Q block reads all of K
    if causal:
        assert want["k"]["read"] < full["k"]["read"]


# --------------------------------------------------------------------------- Chapters 5, 7, 9
def test_paged_decode_attention_bytes():
    lens, hq, hk, d, e = [100, 0, 7], 8, 2, 64, 2
    base = 2 * hk * 107 * d * e + 2 * 3 * hq * d * e + 3 * hq * 4
    assert C.paged_decode_attention_bytes(lens, hq, hk, d, e) == base == C.decode_attention_bytes(lens, hq, hk, d, e)
    assert C.paged_decode_attention_bytes(lens, hq, hk, d, e, block_size=16) == base + 4 * (7 + 0 + 1)


def test_flash_decode_attention_bytes():
    lens, hq, hk, d, e = [100, 0, 7], 8, 2, 64, 2
    base = C.paged_decode_attention_bytes(lens, hq, hk, d, e, 16)
    assert C.flash_decode_attention_bytes(lens, hq, hk, d, e, 16) == base  # one split: no workspace
    assert C.split_workspace_bytes(3, hq, 1, d) == 0
    assert C.split_workspace_bytes(3, hq, 5, d) == 2 * 3 * hq * 5 * (d + 1) * 4
    with_workspace = base + C.split_workspace_bytes(3, hq, 5, d)
    assert C.flash_decode_attention_bytes(lens, hq, hk, d, e, 16, num_splits=5) == with_workspace


def test_kv_block_bytes():
    # 2 (K and V) · layers · block_size · H_kv · d · dtype bytes
    assert C.kv_block_bytes(4, 2, 16, 8, 2) == 2 * 4 * 8 * 2 * 16 * 2
    s = C.LLAMA3_8B
    assert C.kv_block_bytes(s.layers, s.kv_heads, s.head_dim, 16, 2) == 16 * C.kv_bytes_per_token(s, 2)


def test_kernel_counts_do_not_import_triton():
    import subprocess
    import sys

    code = ("import sys, minillm.costs as C; C.fa2_traffic(1, 1, 8, 8, 4, 4, 4); C.nonmatmul_flops(8, 8, 4, 4, 4); "
            "C.traffic_comparison(64, 16); C.warp_partition_traffic(8, 8, 4, 2, 'q'); "
            "assert 'triton' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- Chapter 13
def test_tensor_parallel_bytes():
    s = C.LLAMA3_8B  # 32 layers, hidden 4096
    assert C.ring_allreduce_bytes(1000, 1) == 0 and C.ring_allreduce_bytes(1000, 2) == 1000
    assert C.ring_allreduce_bytes(1000, 4) == 1500                      # 2 (N-1)/N
    assert C.tp_allreduce_bytes_per_token(s, 1) == 0
    # 2 all-reduces per layer + the embedding's, each of hidden * 2 bytes, at 2 (N-1)/N = 1 for N = 2
    assert C.tp_allreduce_bytes_per_token(s, 2) == (2 * 32 + 1) * 4096 * 2
    assert C.tp_allreduce_bytes_per_token(s, 8, embedding=False) == 2 * 32 * 2 * 7 / 8 * 4096 * 2
    assert C.tp_logits_gather_bytes_per_token(s, 2) == s.vocab          # half the fp16 row: V/2 · 2 bytes
    assert C.tp_logits_gather_bytes_per_token(s, 1) == 0
