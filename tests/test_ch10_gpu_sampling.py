"""Chapter 10: sampling on the device (`minillm.decoding.gpu_sampling`, the exponential race of
`minillm.kernels.ch10_fused_decode`).

- the race kernel against its NumPy reference (`minillm.reference.ch10_sampling`) on the very
  uniforms the kernel draws (`race_uniforms`), odd vocabulary sizes, zero probabilities;
- the filters (temperature, min_p, top_k, top_p) against `next_token_probs`, and the sampler's
  frequencies against that distribution (fixed seeds, a bound of a few standard deviations of
  the count: deterministic, and far from the line);
- a row's token depends only on its seed, position and logits: not on the other rows, not on
  where it sits in the batch; greedy rows take the argmax;
- (the engine with ``fused_decode="on"`` on a CPU is in ``test_ch10_fused_engine.py``, with its
  tiny model.)

GPU (``make gpu``): the same kernel checks on CUDA, a large-sample frequency check, the
sampler captured in a CUDA graph giving the eager tokens (alone, and at the end of the model
runner's decode graphs), and the engine's default ("auto") path sampling on the device with
graphs and without: reproducible, within each request's filters, greedy where asked.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minillm.decoding.gpu_sampling import SamplingTensors, filtered_logits, sample
from minillm.decoding.sampling import SamplingParams
from minillm.kernels.base import interpreting
from minillm.reference.ch09_sampling import next_token_probs
from minillm.reference.ch10_sampling import exponential_race as race_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")

on_cpu = pytest.mark.skipif(not interpreting(), reason="Triton on CPU tensors needs the interpreter")
DEVICES = [pytest.param("cpu", marks=on_cpu), pytest.param("cuda", marks=pytest.mark.gpu)]

FILTERS = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=5),
    dict(temperature=0.9, top_p=0.8, min_p=0.05),
    dict(temperature=1.3, top_k=12, top_p=0.7),
]


def rows(params: list[SamplingParams], seeds, positions, device) -> SamplingTensors:
    return SamplingTensors.from_params(params, list(seeds), list(positions), device)


# --- the race kernel -------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1, 37, 1000, 5003])
def test_race_matches_the_reference_on_its_uniforms(device, vocab, seed):
    from minillm.kernels.ch10_fused_decode import exponential_race, race_uniforms

    g = torch.Generator().manual_seed(seed)
    B = 5
    probs = torch.rand(B, vocab, generator=g)
    probs[:, ::3] = 0                                  # tokens that may never win
    probs[1] = torch.rand(vocab, generator=g) ** 8     # a peaked row
    probs[2, 1:], probs[2, 0] = 0, 0.3                 # only token 0 left
    seeds = torch.randint(0, 2**62, (B,), generator=g)
    positions = torch.randint(0, 100_000, (B,), generator=g)
    probs, seeds, positions = probs.to(device), seeds.to(device), positions.to(device)
    u = race_uniforms(seeds, positions, vocab)
    assert u.shape == (B, vocab) and bool(((u > 0) & (u < 1)).all())
    got = exponential_race(probs, seeds, positions).cpu().numpy()
    want = race_reference(probs.cpu().numpy(), u.cpu().numpy())
    np.testing.assert_array_equal(got, want)
    assert got[2] == 0
    p = probs.cpu().numpy()
    assert np.all((p[np.arange(B), got] > 0) | ~(p > 0).any(1)), "a token of probability 0 won"
    # the same key and position: the same numbers; another position: others
    again = race_uniforms(seeds, positions + 1, vocab)
    torch.testing.assert_close(race_uniforms(seeds, positions, vocab), u, atol=0, rtol=0)
    if vocab > 1:
        assert not torch.equal(again, u)


@pytest.mark.parametrize("device", DEVICES)
def test_race_rejects_bad_rows(device):
    from minillm.kernels.ch10_fused_decode import exponential_race

    probs = torch.ones(3, 8, device=device)
    with pytest.raises(ValueError, match="seeds"):
        exponential_race(probs, torch.zeros(3, dtype=torch.int32, device=device), torch.zeros(3, dtype=torch.int64,
                                                                                              device=device))
    with pytest.raises(ValueError, match="positions"):
        exponential_race(probs, torch.zeros(3, dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.int64,
                                                                                              device=device))


def test_reference_race_follows_the_distribution():
    """The race itself (NumPy, independent uniforms): token i wins with probability p_i."""
    rng = np.random.default_rng(0)
    p = np.array([0.0, 0.5, 0.0, 0.2, 0.3])
    n = 40_000
    got = race_reference(np.broadcast_to(p, (n, 5)), rng.random((n, 5)))
    freq = np.bincount(got, minlength=5) / n
    assert freq[0] == freq[2] == 0
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1 / n)


# --- the sampler -----------------------------------------------------------------------------

@pytest.mark.parametrize("kw", FILTERS, ids=str)
def test_filters_match_next_token_probs(kw):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=g) * 2
    logits[2, 10:20] = logits[2, 5]                           # ties: top-k keeps them all, top-p by id
    params = SamplingParams(**kw)
    got = torch.softmax(filtered_logits(logits, rows([params] * 3, [0] * 3, [0] * 3, "cpu")), -1).double().numpy()
    for i in range(3):
        want = next_token_probs(logits[i].numpy(), [], [], params)
        np.testing.assert_allclose(got[i], want, atol=1e-6)
        assert np.array_equal(got[i] > 0, want > 0)


def frequency_check(device, kw, n: int, vocab: int = 40):
    """``n`` rows of the same logits, one key, positions 0..n-1: the frequencies of the drawn
    tokens against `next_token_probs` within 5 standard deviations (+1/n) per token, and no
    token of probability 0 ever drawn. Deterministic (fixed seeds)."""
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2)) * 1.5
    params = SamplingParams(**kw)
    want = next_token_probs(logits.numpy(), [], [], params)
    batch = logits[None].expand(n, vocab).contiguous().to(device)
    tokens = sample(batch, rows([params] * n, [12345] * n, range(n), device)).cpu().numpy()
    freq = np.bincount(tokens, minlength=vocab) / n
    assert freq[want == 0].sum() == 0, "a token the filters drop was drawn"
    bound = 5 * np.sqrt(want * (1 - want) / n) + 1 / n
    worst = np.max(np.abs(freq - want) / bound)
    assert worst <= 1, f"frequencies off by {worst:.2f} x the bound"


@on_cpu
@pytest.mark.parametrize("kw", [FILTERS[0], FILTERS[3]], ids=str)
def test_sampler_frequencies_on_cpu(kw):
    frequency_check("cpu", kw, n=1000)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", FILTERS, ids=str)
def test_sampler_frequencies_on_gpu(kw):
    frequency_check("cuda", kw, n=100_000, vocab=512)


@pytest.mark.parametrize("device", DEVICES)
def test_a_rows_token_depends_only_on_its_seed_position_and_logits(device):
    g = torch.Generator().manual_seed(3)
    vocab, B = 300, 6
    logits = torch.randn(B, vocab, generator=g) * 3
    params = [SamplingParams(temperature=0.9, top_k=50), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_p=0.9), SamplingParams(temperature=0.6, min_p=0.1),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=7, top_p=0.95)]
    seeds, positions = [11, 12, 13, 14, 15, 16], [5, 9, 100, 3, 7, 64]
    together = sample(logits.to(device), rows(params, seeds, positions, device)).cpu()
    alone = [int(sample(logits[i:i + 1].to(device), rows(params[i:i + 1], seeds[i:i + 1], positions[i:i + 1],
                                                           device))[0]) for i in range(B)]
    assert together.tolist() == alone
    order = [4, 0, 5, 2, 1, 3]                                   # another place in another batch
    shuffled = sample(logits[order].to(device), rows([params[i] for i in order], [seeds[i] for i in order],
                                                     [positions[i] for i in order], device)).cpu()
    assert shuffled.tolist() == [alone[i] for i in order]
    assert alone[1] == int(logits[1].argmax()), "a greedy row takes the argmax"
    # and another key or position draws anew (somewhere among the sampled rows)
    other = sample(logits.to(device), rows(params, [s + 100 for s in seeds], positions, device)).cpu()
    assert other[1] == together[1] and other.tolist() != together.tolist()


# --- GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_sampler_in_a_cuda_graph_gives_the_eager_tokens():
    g = torch.Generator().manual_seed(4)
    B, vocab = 8, 4099
    logits = (torch.randn(B, vocab, generator=g) * 2).to("cuda", torch.bfloat16)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in [(0.8, 40, 0.9, 0.0), (0, 0, 1.0, 0.0), (1.0, 0, 0.95, 0.05), (1.5, 3, 1.0, 0.0)] * 2]
    static_logits = torch.empty_like(logits)
    static = SamplingTensors.empty(B, "cuda")
    static_logits.copy_(logits)
    static.copy_(rows(params, range(B), [10] * B, "cuda"))
    sample(static_logits, static)                                  # compile before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = sample(static_logits, static)
    for step in range(4):                                          # new positions, new logits each replay
        step_logits = logits.roll(step, dims=1)
        sampling = rows(params, range(B), [10 + step] * B, "cuda")
        static_logits.copy_(step_logits)
        static.copy_(sampling)
        graph.replay()
        assert tokens.tolist() == sample(step_logits, sampling).tolist()


@pytest.mark.gpu
def test_gpu_runner_samples_inside_its_graphs_as_eagerly():
    """`ModelRunner.forward_and_sample` replaying the graphs captured with the sampler: the
    tokens are those of the sampler called eagerly on the logits the graph returned (the
    argmax for a step of greedy rows), for decode steps of several batch sizes (padding rows
    included)."""
    from minillm.engine import BUNDLED_MODEL
    from minillm.engine.model_runner import ModelRunner
    from minillm.model import load_model
    from minillm.model.fused import enable_fused_decode
    from minillm.model.paged import PagedBatch
    from minillm.paged import BlockManager

    model, _ = load_model(BUNDLED_MODEL, device="cuda", dtype=torch.bfloat16)
    cache = model.new_paged_cache(128, 16)
    assert enable_fused_decode(model, cache, "auto")
    runner = ModelRunner(model, cache)
    assert runner.capture_cuda_graphs(8, 256, 0, sample_tokens=True) > 0
    assert all(g.tokens is not None and g.argmax is not None for g in runner.graphs.values())
    manager = BlockManager(128, 16, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    for i in range(5):
        manager.allocate(i, rng.integers(0, 200, int(rng.integers(3, 40))).tolist())
    choices = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0),
               SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=0.7, min_p=0.1)]
    for step, ids in enumerate([[0], [0, 1, 2], [0, 1, 2, 3, 4], [1, 3], [0, 2, 4]]):
        manager.append_slots(ids, [int(t) for t in rng.integers(0, 200, len(ids))])
        batch = PagedBatch.from_manager(manager, ids, 1, device="cuda")
        sampling = rows([choices[(i + step) % 4] for i in ids], [100 + i for i in ids], [50 + step] * len(ids), "cuda")
        greedy = step == 4
        replays = runner.num_replays
        logits, tokens = runner.forward_and_sample(batch, None if greedy else sampling)
        assert runner.num_replays == replays + 1
        want = logits.argmax(-1) if greedy else sample(logits, sampling)
        assert tokens.shape == (len(ids),) and tokens.tolist() == want.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", ["all", "off"])
def test_gpu_engine_samples_on_device_by_default(cuda_graphs):
    """The default engine on CUDA samples inside the step: the same batch twice gives the same
    tokens; each sampled token is one its filters allow under the torch model's logits
    (teacher-forced, with a margin for bf16), each greedy token the torch model's choice."""
    from minillm.engine import BUNDLED_MODEL, EngineConfig, LLMEngine
    from minillm.model import load_model, load_tokenizer
    from minillm.testing import run_to_completion as run

    model, _ = load_model(BUNDLED_MODEL, device="cuda", dtype=torch.bfloat16)
    engine = LLMEngine(model, load_tokenizer(BUNDLED_MODEL)[0],
                       EngineConfig(num_blocks=256, max_num_seqs=8, max_n=8, cuda_graphs=cuda_graphs, seed=0))
    assert engine.fused_decode and engine.sample_on_device
    prompts = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed any further, hear me speak."]
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=16, ignore_eos=True, seed=5),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=30, max_tokens=16, ignore_eos=True, seed=6, n=2)]
    outs = run(engine, prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == \
        [[c.token_ids for c in o.outputs] for o in run(engine, prompts, params)]
    assert (engine.runner.num_replays > 0) == (cuda_graphs == "all")
    assert outs[2].outputs[0].token_ids != outs[2].outputs[1].token_ids
    model.fused_decode = None                      # the torch path as the oracle
    for out, p in zip(outs, params):
        for c in out.outputs:
            with torch.no_grad():
                logits = model(torch.tensor([out.prompt_token_ids + c.token_ids], device="cuda"))[0].float()
            logits = logits[len(out.prompt_token_ids) - 1:-1]
            chosen = logits.gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0]
            if p.greedy:
                assert bool((chosen >= logits.max(-1).values - 0.25).all()), "a greedy token is not the argmax"
            else:   # within the top k, give or take the tokens bf16 puts level with the k-th
                kth = logits.topk(p.top_k, dim=-1).values[:, -1]
                assert bool((chosen >= kth - 0.25).all()), "a sampled token lies outside its top-k"
