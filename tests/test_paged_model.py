"""Chapter 6: the model over a paged KV cache, and parallel sampling on it.

The oracle of the paged forward is the model itself without a cache: every sequence of a
paged batch, whatever its length, its block size and the step it is at, must get the logits
of a plain forward over that sequence alone. Tiny random models are built from a `ModelConfig`
(GQA: 4 query heads over 2 KV heads), on the CPU.

Parallel sampling is checked against sampling each completion alone, with the same generator,
on the contiguous-cache model of Chapter 2.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minillm.decoding import ParallelSampler, SamplingParams, parallel_sample, sample_token
from minillm.decoding.sampling import completion_generator
from minillm.model import LlamaForCausalLM, ModelConfig
from minillm.model import paged as paged_module
from minillm.model.paged import PagedBatch, PagedKVCache
from minillm.paged import BlockManager, OutOfBlocks

VOCAB = 97


# Tiny models: one torch thread for this module (see `one_torch_thread` in conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model(dtype=torch.float32, seed: int = 0, kv_heads: int = 2) -> LlamaForCausalLM:
    config = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # sharper logits than the default init, and non-trivial norms
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0, 0.5)
    return model


def random_tokens(n: int, rng: np.random.Generator) -> list[int]:
    return rng.integers(0, VOCAB, n).tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


@torch.no_grad()
def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """The oracle: ``[len(tokens), vocab]`` from a forward over the whole sequence, no cache."""
    return model(torch.tensor([tokens]))[0]


@torch.no_grad()
def run(model, manager, cache, seq_ids, counts, last_only=False) -> list[torch.Tensor]:
    """One paged step (on the model's device); each sequence's rows of the logits."""
    batch = PagedBatch.from_manager(manager, seq_ids, counts, device=model.lm_head.weight.device)
    logits = model.forward_paged(batch, cache, last_only=last_only)
    if last_only:
        return list(logits)
    cu = batch.cu_seqlens_q.tolist()
    return [logits[a:b] for a, b in zip(cu, cu[1:])]


# --- the paged forward == the plain forward -------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_paged_forward_equals_full_forward(block_size, dtype):
    """Prompts of different lengths prefilled in one batch, then decode steps, with a sequence
    joining midway (its prefill in the same batch as the others' decodes)."""
    model, rng = tiny_model(dtype), np.random.default_rng(block_size)
    manager = BlockManager(64, block_size, enable_prefix_caching=False)
    cache = model.new_paged_cache(64, block_size)
    seqs = {"a": random_tokens(7, rng), "b": random_tokens(1, rng), "c": random_tokens(20, rng)}
    for s, toks in seqs.items():
        manager.allocate(s, toks)
    got = run(model, manager, cache, list(seqs), [len(t) for t in seqs.values()])
    for s, rows in zip(seqs, got):
        assert rows.shape == (len(seqs[s]), VOCAB)
        assert rel_err(rows, full_logits(model, seqs[s])) <= TOL[dtype], s

    for step in range(4):
        if step == 2:  # a late arrival: its whole prompt runs next to the others' single tokens
            seqs["d"] = random_tokens(5, rng)
            manager.allocate("d", seqs["d"])
        old = [s for s in seqs if s != "d" or step > 2]
        new_tokens = random_tokens(len(old), rng)
        manager.append_slots(old, new_tokens)
        for s, t in zip(old, new_tokens):
            seqs[s].append(t)
        ids = list(seqs)
        counts = [1 if s in old else len(seqs[s]) for s in ids]
        for s, n, rows in zip(ids, counts, run(model, manager, cache, ids, counts)):
            assert rel_err(rows, full_logits(model, seqs[s])[-n:]) <= TOL[dtype], f"step {step}, {s}"


def test_last_only_returns_each_sequence_last_row():
    model, rng = tiny_model(), np.random.default_rng(0)
    manager, cache = BlockManager(16, 4), model.new_paged_cache(16, 4)
    prompts = [random_tokens(n, rng) for n in (6, 1, 9)]
    for i, p in enumerate(prompts):
        manager.allocate(i, p)
    last = run(model, manager, cache, [0, 1, 2], [6, 1, 9], last_only=True)
    for p, row in zip(prompts, last):
        assert rel_err(row, full_logits(model, p)[-1]) <= TOL[torch.float32]


def test_prefix_cache_hit_runs_only_the_new_tokens():
    """A prompt whose first blocks another sequence computed: only the rest runs, and it
    attends to the cached blocks (bottom-right causal alignment)."""
    model, rng = tiny_model(torch.float64), np.random.default_rng(1)
    manager, cache = BlockManager(16, 4, enable_prefix_caching=True), model.new_paged_cache(16, 4)
    system = random_tokens(9, rng)
    first, second = system + random_tokens(3, rng), system + random_tokens(5, rng)
    manager.allocate("first", first)
    run(model, manager, cache, ["first"], [len(first)])
    cached = manager.allocate("second", second)
    assert cached == 8  # two full blocks of the shared 9 tokens
    (rows,) = run(model, manager, cache, ["second"], [len(second) - cached])
    assert rel_err(rows, full_logits(model, second)[cached:]) <= TOL[torch.float64]


def test_copy_on_write_after_fork():
    """A fork shares the prompt's blocks; when both sequences append, the shared partial block
    is copied first. Skipping the copy must corrupt the fork (the test can fail)."""
    model, rng = tiny_model(torch.float64), np.random.default_rng(2)
    prompt = random_tokens(6, rng)                              # blocks of 4: one full, one partial
    for apply_copies in (True, False):
        manager, cache = BlockManager(8, 4, enable_prefix_caching=False), model.new_paged_cache(8, 4)
        manager.allocate("parent", prompt)
        run(model, manager, cache, ["parent"], [6])
        manager.fork("parent", "child")
        assert manager.block_table("child") == manager.block_table("parent")
        tokens = {"parent": 11, "child": 22}
        result = manager.append_slots(list(tokens), list(tokens.values()))
        assert len(result.copies) == 1
        src, dst = result.copies[0]
        if apply_copies:
            cache.copy_blocks(result.copies)
        logits = dict(zip(tokens, run(model, manager, cache, list(tokens), [1, 1])))
        parent_table, child_table = manager.block_table("parent"), manager.block_table("child")
        assert parent_table[0] == child_table[0] and parent_table[1] != child_table[1]
        ok = [rel_err(logits[s], full_logits(model, prompt + [t])[-1]) <= TOL[torch.float64] for s, t in tokens.items()]
        if apply_copies:
            assert all(ok)
            # the copy holds the prompt's positions 4, 5 in every layer, K and V
            for layer in range(2):
                for pool in (cache.k[layer], cache.v[layer]):
                    torch.testing.assert_close(pool[dst, :2], pool[src, :2], rtol=0, atol=0)
        else:
            assert not all(ok), "without the copy-on-write copy, one sequence lost positions 4-5"


def test_copy_blocks_is_one_copy_over_all_layers():
    model = tiny_model()
    cache = model.new_paged_cache(6, 2)
    cache.pool.copy_(torch.randn(cache.pool.shape))
    before = cache.pool.clone()
    cache.copy_blocks([(1, 3), (4, 0)])
    after = before.clone()
    after[:, :, 3], after[:, :, 0] = before[:, :, 1], before[:, :, 4]
    assert torch.equal(cache.pool, after)
    assert cache.k[1].data_ptr() == cache.pool[0, 1].data_ptr()  # the per-layer pools are views
    with pytest.raises(ValueError, match="distinct"):
        cache.copy_blocks([(1, 2), (2, 3)])


def test_paged_batch_from_manager():
    manager = BlockManager(10, 3, enable_prefix_caching=False)
    manager.allocate("x", [5, 6, 7, 8])                         # blocks [0, 1]
    manager.allocate("y", [9, 9])                               # block [2]
    manager.append_slots(["x", "y"], [1, 2])                    # x: position 4 in block 1; y: 2 in block 2
    batch = PagedBatch.from_manager(manager, ["y", "x"], [3, 1])
    assert batch.input_ids.tolist() == [9, 9, 2, 1]
    assert batch.positions.tolist() == [0, 1, 2, 4]
    assert batch.slot_mapping.tolist() == [6, 7, 8, 4]
    assert batch.cu_seqlens_q.tolist() == [0, 3, 4] and batch.cu_seqlens_q.dtype == torch.int32
    assert batch.seq_lens.tolist() == [3, 5] and batch.seq_lens.dtype == torch.int32
    assert batch.block_tables.tolist() == [[2, -1], [0, 1]] and batch.block_tables.dtype == torch.int32
    assert batch.slot_mapping.dtype == torch.int64
    assert (batch.max_seqlen_q, batch.batch_size, batch.num_tokens) == (3, 2, 4)
    assert batch.last_token_rows.tolist() == [2, 3]
    with pytest.raises(ValueError, match="last 6"):
        PagedBatch.from_manager(manager, ["x"], 6)


def test_gqa_fallback_without_enable_gqa(monkeypatch):
    """torch < 2.5 has no SDPA ``enable_gqa``: repeating the KV heads must agree."""
    model, rng = tiny_model(torch.float64, kv_heads=1), np.random.default_rng(3)
    prompt = random_tokens(7, rng)
    outs = []
    for native in (True, False):
        monkeypatch.setattr(paged_module, "SDPA_GQA", native)
        manager, cache = BlockManager(8, 2), model.new_paged_cache(8, 2)
        manager.allocate(0, prompt)
        outs.append(run(model, manager, cache, [0], [7])[0])
    assert rel_err(outs[1], outs[0]) <= 1e-13
    assert rel_err(outs[0], full_logits(model, prompt)) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_backend_matches_torch(dtype, device):
    """The Chapter 5 kernels (in Triton's interpreter on a CPU) behind the same forward: a
    mixed prefill batch, then a decode step."""
    pytest.importorskip("minillm.kernels.ch05_paged_attention")
    model, rng = tiny_model(dtype).to(device), np.random.default_rng(4)
    prompts = {"a": random_tokens(7, rng), "b": random_tokens(3, rng)}
    steps = []
    for backend in ("torch", "triton"):
        manager, cache = BlockManager(12, 3), model.new_paged_cache(12, 3, backend=backend)
        assert (cache.kernels is not None) == (backend == "triton")
        for s, p in prompts.items():
            manager.allocate(s, p)
        prefill = torch.cat(run(model, manager, cache, list(prompts), [7, 3]))
        manager.append_slots(list(prompts), [1, 2])
        decode = torch.stack(run(model, manager, cache, list(prompts), [1, 1], last_only=True))
        steps.append((prefill, decode))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(steps[1], steps[0]):
        assert rel_err(got, want) <= tol


@pytest.mark.parametrize("phi", [0.0, 200.0], ids=["phi-fits", "phi-far-fallback"])
def test_decode_with_async_softmax_matches_torch(phi, device):
    """Decode steps through Chapter 7's asynchronized softmax (`softmax_phi`) give the torch
    backend's logits, whether φ fits the scores or is so far off that every split falls back."""
    pytest.importorskip("minillm.kernels.ch07_flash_decoding")
    model, rng = tiny_model(torch.float32).to(device), np.random.default_rng(5)
    prompts = {"a": random_tokens(9, rng), "b": random_tokens(4, rng)}
    logits = []
    for backend, softmax_phi in (("torch", None), ("triton", phi)):
        manager = BlockManager(12, 3)
        cache = model.new_paged_cache(12, 3, backend=backend, softmax_phi=softmax_phi)
        for s, p in prompts.items():
            manager.allocate(s, p)
        run(model, manager, cache, list(prompts), [9, 4])
        manager.append_slots(list(prompts), [1, 2])
        logits.append(torch.stack(run(model, manager, cache, list(prompts), [1, 1], last_only=True)))
    assert rel_err(logits[1], logits[0]) <= 1e-5


def test_backend_auto_is_torch_on_cpu():
    cache = PagedKVCache(tiny_model().config, 4, 2)
    assert cache.kernels is None
    with pytest.raises(ValueError, match="backend"):
        PagedKVCache(tiny_model().config, 4, 2, backend="cuda")


# --- sampling one token ---------------------------------------------------------------------

def support(logits: torch.Tensor, params: SamplingParams, draws: int = 300) -> set[int]:
    gen = torch.Generator().manual_seed(0)
    return {sample_token(logits, params, gen) for _ in range(draws)}


def test_sample_token_filters():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert support(logits, SamplingParams()) == {0, 1, 2, 3}
    assert support(logits, SamplingParams(temperature=0)) == {0}
    assert support(logits, SamplingParams(top_k=2)) == {0, 1}
    assert support(logits, SamplingParams(top_p=0.8)) == {0, 1}          # 0.5 + 0.3 reaches 0.8
    assert support(logits, SamplingParams(top_p=0.81)) == {0, 1, 2}
    assert support(logits, SamplingParams(top_p=0.01)) == {0}            # the best token always stays
    assert support(logits, SamplingParams(top_k=3, top_p=0.6)) == {0, 1}
    # a low temperature sharpens: the second token becomes (almost) never drawn
    assert support(logits, SamplingParams(temperature=0.05), draws=200) == {0}
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


# --- parallel sampling ----------------------------------------------------------------------

PARAMS = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, max_tokens=12, seed=5)


@torch.no_grad()
def sample_alone(model, prompt: list[int], params: SamplingParams, index: int) -> list[int]:
    """Completion ``index`` on its own, with Chapter 2's contiguous cache."""
    gen = completion_generator(params, index)
    cache = model.new_cache(batch=1, max_len=len(prompt) + params.max_tokens)
    tokens, out, pos = torch.tensor([prompt]), [], 0
    while True:
        logits = model(tokens, start_pos=pos, cache=cache)[0, -1].float()
        pos += tokens.shape[1]
        out.append(sample_token(logits, params, gen))
        if out[-1] in params.stop_token_ids or len(out) == params.max_tokens:
            return out
        tokens = torch.tensor([[out[-1]]])


def test_parallel_sampling_equals_sampling_each_alone():
    model, rng = tiny_model(torch.float64), np.random.default_rng(5)
    prompt = random_tokens(10, rng)
    free_run = parallel_sample(model, prompt, 4, PARAMS, block_size=4)
    # a stop token that sample 1 produces midway: samples end at different steps, for different reasons
    params = SamplingParams(**{**PARAMS.__dict__, "stop_token_ids": (free_run.completions[1].token_ids[4],)})
    out = parallel_sample(model, prompt, 4, params, block_size=4)
    reasons = [c.finish_reason for c in out.completions]
    assert "stop" in reasons and "length" in reasons
    for i, c in enumerate(out.completions):
        assert c.token_ids == sample_alone(model, prompt, params, i), f"sample {i}"
    assert len({tuple(c.token_ids) for c in out.completions}) > 1   # the generators differ


def test_parallel_sampling_is_reproducible():
    model, prompt = tiny_model(), list(range(10, 17))
    runs = [parallel_sample(model, prompt, 3, PARAMS, block_size=3) for _ in range(2)]
    assert [c.token_ids for c in runs[0].completions] == [c.token_ids for c in runs[1].completions]
    other_seed = parallel_sample(model, prompt, 3, SamplingParams(**{**PARAMS.__dict__, "seed": 6}), block_size=3)
    assert [c.token_ids for c in other_seed.completions] != [c.token_ids for c in runs[0].completions]
    greedy = parallel_sample(model, prompt, 3, SamplingParams(temperature=0, max_tokens=5))
    assert greedy.completions[0].token_ids == greedy.completions[1].token_ids == greedy.completions[2].token_ids


def test_parallel_sampling_shares_the_prompt_blocks():
    model, n, bs = tiny_model(), 4, 4
    prompt = list(range(9))                                     # two full blocks + one partial
    manager, cache = BlockManager(32, bs, enable_prefix_caching=False), model.new_paged_cache(32, bs)
    sampler = ParallelSampler(model, prompt, n, SamplingParams(max_tokens=8, seed=1), manager=manager, cache=cache)
    table = manager.block_table(sampler.seq_ids[0])
    assert all(manager.block_table(s) == table for s in sampler.seq_ids)
    assert [manager.ref_count(b) for b in table] == [n, n, n] and manager.num_used_blocks == 3

    sampler.step()  # everyone appends into the shared partial block: n - 1 copies, the last writes in place
    assert [manager.ref_count(b) for b in table[:2]] == [n, n]
    assert len({manager.block_table(s)[2] for s in sampler.seq_ids}) == n
    assert manager.num_used_blocks == 2 + n
    while not sampler.done:
        sampler.step()
    out = sampler.result()
    assert len(manager) == 0 and manager.num_used_blocks == 0
    assert out.trace.copies == n - 1
    # prefill: 3 blocks; then n samples hold 2 shared + n own blocks, against n * 3 (and 4 later) alone
    assert out.trace.shared[:2].tolist() == [3, 2 + n] and out.trace.unshared[:2].tolist() == [3, 3 * n]
    assert np.all(out.trace.shared <= out.trace.unshared) and out.trace.saving > 0.3
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.completions)


def test_parallel_sampling_frees_everything_on_error():
    model = tiny_model()
    manager, cache = BlockManager(4, 4, enable_prefix_caching=False), model.new_paged_cache(4, 4)
    with pytest.raises(OutOfBlocks):  # 3 samples of 12 tokens need more than 4 blocks
        parallel_sample(model, list(range(6)), 3, SamplingParams(max_tokens=6), manager=manager, cache=cache)
    assert len(manager) == 0 and manager.num_used_blocks == 0
