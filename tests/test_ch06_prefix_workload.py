"""Chapter 6's measurement module: the shared-system-prompt workload with prefix caching on
and off, and the decoders' block usage with and without sharing.

The oracle of the workload is the model itself: with or without caching, one request per step
or all in one batch, every request's last-token logits must be those of a plain forward over
its prompt alone, and the cache must serve exactly the tokens the workload's analytic
`PrefixWorkload.expected_cached_tokens` predicts. Tiny random models, on the CPU.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minillm.experiments.ch06_prefix_workload import (
    PrefixWorkload, compare_prefix_caching, decoder_sharing, run_prefix_workload, shakespeare_workload,
)
from minillm.model import LlamaForCausalLM, ModelConfig
from minillm.paged import blocks_for

VOCAB = 97


# Tiny models: one torch thread for this module (see `one_torch_thread` in conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    config = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         eos_token_ids=[0])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper logits than the default init
        for name, p in model.named_parameters():
            if "embed" in name or "lm_head" in name:
                p.normal_(0, 0.5)
    return model


@torch.no_grad()
def plain_logits(model, prompts) -> torch.Tensor:
    """The last-token logits of each prompt, run alone without any cache."""
    return torch.cat([model(torch.tensor([p]))[:, -1] for p in prompts]).float()


def test_random_workload_is_deterministic_and_shares_only_the_system_prompt():
    a = PrefixWorkload.random(20, 6, 5, VOCAB, seed=3)
    assert a == PrefixWorkload.random(20, 6, 5, VOCAB, seed=3) != PrefixWorkload.random(20, 6, 5, VOCAB, seed=4)
    assert a.num_requests == 6 and a.prompt_tokens == 6 * 25
    assert all(p[:20] == list(a.system) for p in a.prompts)
    assert len({s[0] for s in a.suffixes}) == 6                    # distinct first suffix tokens
    assert min(min(p) for p in a.prompts) >= 1


@pytest.mark.parametrize("system_len, suffix_len, block_size", [(20, 5, 4), (16, 3, 4), (7, 9, 8), (3, 4, 8)])
def test_expected_hit_rate_formula(system_len, suffix_len, block_size):
    """For random suffixes, every request but the first hits the system prompt's full blocks."""
    R = 5
    w = PrefixWorkload.random(system_len, R, suffix_len, VOCAB, seed=1)
    per_request = min(system_len // block_size, (system_len + suffix_len - 1) // block_size) * block_size
    assert w.expected_cached_tokens(block_size) == [0] + [per_request] * (R - 1)
    assert w.expected_hit_rate(block_size) == pytest.approx((R - 1) * per_request / (R * (system_len + suffix_len)))


@pytest.mark.parametrize("one_step", [False, True], ids=["sequential", "one-step"])
def test_caching_computes_fewer_tokens_and_gives_the_same_logits(model, one_step):
    w = PrefixWorkload.random(21, 5, 6, VOCAB, seed=2)
    bs = 4
    off = run_prefix_workload(model, w, block_size=bs, prefix_caching=False, one_step=one_step)
    on = run_prefix_workload(model, w, block_size=bs, prefix_caching=True, one_step=one_step)
    want = plain_logits(model, w.prompts)
    torch.testing.assert_close(off.logits, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(on.logits, want, rtol=1e-5, atol=1e-5)

    assert off.cached_tokens == 0 and off.computed_tokens == w.prompt_tokens and off.hit_rate == 0
    assert [r.cached_tokens for r in on.requests] == w.expected_cached_tokens(bs) == [0, 20, 20, 20, 20]
    assert on.hit_rate == pytest.approx(w.expected_hit_rate(bs)) == pytest.approx(80 / 135)
    assert on.computed_tokens == w.prompt_tokens - 80
    assert all(r.computed_tokens == r.prompt_tokens - r.cached_tokens for r in on.requests)
    # memory: the system prompt's 5 full blocks stored once instead of five times
    assert off.blocks_held == 5 * blocks_for(27, bs) == 35
    assert on.blocks_held == off.blocks_held - 4 * 5
    if one_step:
        assert math.isnan(on.requests[0].seconds) and on.prefill_seconds > 0
    else:
        assert all(r.seconds > 0 for r in on.requests)
        assert on.prefill_seconds == pytest.approx(sum(r.seconds for r in on.requests))
        assert [r.blocks_held for r in on.requests] == [7, 9, 11, 13, 15]  # each later request adds 2 own blocks


def test_same_step_requests_do_not_duplicate_blocks(model):
    """All requests allocated before one forward pass: the later ones hit the first one's
    blocks (registered at allocation), so the batch holds exactly what arrival order holds."""
    w = PrefixWorkload.random(32, 4, 5, VOCAB, seed=5)
    seq = run_prefix_workload(model, w, block_size=8, prefix_caching=True)
    one = run_prefix_workload(model, w, block_size=8, prefix_caching=True, one_step=True)
    assert [r.cached_tokens for r in one.requests] == [r.cached_tokens for r in seq.requests] == [0, 32, 32, 32]
    assert one.blocks_held == seq.blocks_held == 4 + 4 * 1
    torch.testing.assert_close(one.logits, seq.logits, rtol=1e-5, atol=1e-5)


def test_a_fully_cached_prompt_still_computes_one_token(model):
    """The same prompt twice, of a whole number of blocks: the second hits every block but
    the last, whose last token must run to produce the logits."""
    prompt = tuple(range(1, 17))
    w = PrefixWorkload((), (prompt, prompt, prompt[:13]))
    run = run_prefix_workload(model, w, block_size=4, prefix_caching=True)
    assert [r.cached_tokens for r in run.requests] == w.expected_cached_tokens(4) == [0, 12, 12]
    assert [r.computed_tokens for r in run.requests] == [16, 4, 1]
    torch.testing.assert_close(run.logits, plain_logits(model, w.prompts), rtol=1e-5, atol=1e-5)


def test_decoding_after_the_prefill_is_unchanged_by_caching(model):
    w = PrefixWorkload.random(10, 3, 3, VOCAB, seed=7)
    off = run_prefix_workload(model, w, block_size=4, prefix_caching=False, decode_tokens=6)
    on = run_prefix_workload(model, w, block_size=4, prefix_caching=True, decode_tokens=6)
    assert on.output_ids == off.output_ids and all(len(o) == 6 for o in on.output_ids)
    # greedy decoding of each prompt alone, without a cache
    for prompt, got in zip(w.prompts, on.output_ids):
        ids = list(prompt)
        for _ in range(6):
            with torch.no_grad():
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        assert got == ids[len(prompt):]
    assert on.peak_blocks >= on.blocks_held and off.peak_blocks == 3 * blocks_for(13 + 5, 4)


def test_compare_keeps_the_fastest_run_and_reports_savings(model):
    w = PrefixWorkload.random(24, 4, 4, VOCAB, seed=8)
    cmp = compare_prefix_caching(model, w, block_size=8, repeats=2)
    assert cmp.hit_rate == pytest.approx(w.expected_hit_rate(8)) == pytest.approx(72 / 112)
    assert cmp.tokens_saved == pytest.approx(72 / 112)
    assert cmp.memory_saved == pytest.approx(1 - (4 + 3 * 1) / (4 * 4))
    assert cmp.off.prefill_seconds == pytest.approx(sum(r.seconds for r in cmp.off.requests))
    assert -1 < cmp.time_saved < 1
    one = compare_prefix_caching(model, w, block_size=8, repeats=2, one_step=True)
    assert one.on.prefill_seconds > 0 and one.hit_rate == cmp.hit_rate


def test_shakespeare_workload():
    tokenizers = pytest.importorskip("tokenizers")
    from minillm.cli import BUNDLED_MODEL

    tok = tokenizers.Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    w = shakespeare_workload(tok, system_len=64, num_requests=5, suffix_len=12, seed=1)
    assert len(w.system) == 64 and w.num_requests == 5 and all(len(s) == 12 for s in w.suffixes)
    assert w == shakespeare_workload(tok, system_len=64, num_requests=5, suffix_len=12, seed=1)
    assert all(tok.decode(list(s))[0] not in " \n" for s in w.suffixes)          # each starts a line
    assert w.expected_cached_tokens(16) == [0] + [64] * 4


def test_decoder_sharing_on_a_tiny_model(model):
    prompt = np.random.default_rng(0).integers(1, VOCAB, 19).tolist()
    ds = decoder_sharing(model, prompt, n=4, beam_width=4, max_new_tokens=10, block_size=4, eos_token_ids=())
    assert len(ds.sampling.completions) == 4 and all(len(c.token_ids) == 10 for c in ds.sampling.completions)
    assert len(ds.beams.hypotheses) == 4
    rows = {r["decoder"]: r for r in ds.rows()}
    assert set(rows) == {"parallel sampling, n = 4", "beam search, k = 4"}
    for name, trace in ds.traces().items():
        assert np.all(trace.shared <= trace.unshared)
        assert rows[name]["peak_unshared"] == 4 * blocks_for(19 + 9, 4)  # the last token is never fed back
        assert rows[name]["saving"] > 0 and trace.copies > 0
        assert rows[name]["peak_shared_bytes"] == rows[name]["peak_shared"] * ds.block_bytes
    # parallel samples share the prompt's 4 full blocks and copy its partial one
    samples = ds.sampling.trace
    assert samples.shared[1] == blocks_for(20, 4) + 3 and samples.copies == 3
    assert ds.block_bytes == 2 * 2 * 4 * 2 * 16 * 4                 # K,V x layers x block x kv_heads x dim x fp32
