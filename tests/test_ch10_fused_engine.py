"""Chapter 10: the fused decode path (`minillm.model.fused`) computes what the torch layers do.

CPU: tiny random Llama and Qwen2 models in float32, the fused kernels in Triton's interpreter
(forced with ``fused_decode="on"``): teacher-forced logits of prefill and decode steps within
fp32 tolerance, the engine's greedy tokens identical, and its sampling on the device (the
tokens of a request the same alone and batched, with n > 1, penalties, logprobs and beam
search). GPU (``make gpu``): the bundled model
in bf16 and fp16, eager and under CUDA graphs: teacher-forced logits within a half-precision
tolerance, and every token the fused engine chose greedy for the torch model.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from minillm.kernels.base import interpreting
from minillm.engine import BUNDLED_MODEL, EngineConfig, LLMEngine, SamplingParams
from minillm.engine.model_runner import ModelRunner
from minillm.model import LlamaForCausalLM, load_model, load_tokenizer
from minillm.model.fused import FusedDecode, enable_fused_decode, supports_fused_decode
from minillm.model.paged import PagedBatch
from minillm.paged import BlockManager
from minillm.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 256
TOKENIZER = load_tokenizer(BUNDLED_MODEL)[0]


def tiny_model(family: str = "llama", seed: int = 0) -> LlamaForCausalLM:
    return tiny_llama(seed, vocab_size=VOCAB, family=family, intermediate_size=96, qkv_bias=family == "qwen2",
                      rope_theta=1e6)


def teacher_forced_logits(model, fused: bool, prompts, steps: int, graphs: bool = False,
                          fold: bool | None = None) -> list[torch.Tensor]:
    """Prefill ``prompts`` in one step, then ``steps`` decode steps feeding fixed tokens; the
    logits ``[seqs, vocab]`` of every step (through a `ModelRunner`, with CUDA graphs if asked;
    ``fold`` sets `FusedDecode.fold_into_gemv`)."""
    device = model.lm_head.weight.device
    cache = model.new_paged_cache(64, 4)
    enable_fused_decode(model, cache, "on" if fused else "off")
    if fused and fold is not None:
        model.fused_decode.fold_into_gemv = fold
    manager = BlockManager(64, 4, enable_prefix_caching=False)
    runner = ModelRunner(model, cache)
    if graphs:
        assert runner.capture_cuda_graphs(8, 128, 0) > 0
    ids = list(range(len(prompts)))
    for i, p in zip(ids, prompts):
        manager.allocate(i, p)
    out = [runner.forward(PagedBatch.from_manager(manager, ids, [len(p) for p in prompts], device=device)).clone()]
    for step in range(steps):
        manager.append_slots(ids, [(7 * step + 3 * i) % VOCAB for i in ids])
        out.append(runner.forward(PagedBatch.from_manager(manager, ids, 1, device=device)).clone())
    if graphs:
        assert runner.num_replays == steps
    return out


# The CPU tests run the fused kernels in Triton's interpreter; on a GPU machine Triton compiles
# for CUDA and cannot take CPU tensors, and the GPU tests below cover the same ground.
on_cpu = pytest.mark.skipif(not interpreting(), reason="the fused kernels on CPU tensors need Triton's interpreter")


@on_cpu
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_teacher_forced_logits_match_on_cpu(family):
    model = tiny_model(family)
    prompts = [[1, 2, 3, 4, 5], [9, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108]]
    want = teacher_forced_logits(model, False, prompts, steps=3)
    got = teacher_forced_logits(model, True, prompts, steps=3)
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=2e-4, msg=lambda m: f"step {step}: {m}")


@on_cpu
def test_norms_and_swiglu_folded_into_the_gemvs_match_on_cpu():
    """`FusedDecode.fold_into_gemv`: every projection through Chapter 10's prologue GEMVs
    (`add_rmsnorm_gemv`, `decode_gemv`, `silu_mul_gemv`), prefill rows included."""
    model = tiny_model("qwen2")
    prompts = [[1, 2, 3, 4, 5], [9, 8]]
    want = teacher_forced_logits(model, False, prompts, steps=2)
    got = teacher_forced_logits(model, True, prompts, steps=2, fold=True)
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=2e-4, msg=lambda m: f"step {step}: {m}")


def _replay_compared(model, seqs: int, fold: bool | None) -> None:
    """Decode steps of ``seqs`` sequences with layers 2 and up replayed from layer 1's recorded
    launches, and the same steps through every layer's wrappers: the logits must be the same
    numbers (the same kernels on the same data)."""
    device = model.lm_head.weight.device
    cache = model.new_paged_cache(256, 4, backend="triton")
    enable_fused_decode(model, cache, "on")
    fused = model.fused_decode
    fused.fold_into_gemv = fold
    manager = BlockManager(256, 4, enable_prefix_caching=False)
    rng = np.random.default_rng(seqs)
    ids = list(range(seqs))
    for i in ids:
        manager.allocate(i, rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist())
    layers = model.config.num_hidden_layers
    with torch.inference_mode():
        for step in range(3):
            manager.append_slots(ids, rng.integers(0, VOCAB, seqs).tolist())
            batch = PagedBatch.from_manager(manager, ids, 1, device=device)
            fused.replay_layers = True
            replayed = model.forward_paged(batch, cache).clone()
            assert (fused.replayed_layers, fused.refusal) == (layers - 2, None)
            fused.replay_layers = False
            plain = model.forward_paged(batch, cache)
            assert fused.replayed_layers == 0
            torch.testing.assert_close(replayed, plain, atol=0, rtol=0, msg=lambda m: f"step {step}: {m}")


@on_cpu
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("fold", [None, True], ids=["dispatch", "folded"])
def test_replayed_layers_equal_every_layer_through_its_wrappers_on_cpu(family, fold):
    """`FusedDecode.replay_layers` (`minillm.kernels.base.recording`): a 4-layer model, so
    that two layers are replays; random weights per layer, so that a replay reading layer 1's
    weights, cache or inputs instead of its own would change the logits."""
    model = tiny_llama(1, vocab_size=VOCAB, family=family, layers=4, intermediate_size=96,
                       qkv_bias=family == "qwen2")
    _replay_compared(model, 3, fold)


@pytest.mark.gpu
@pytest.mark.parametrize("seqs", [3, 40])  # GEMVs with their neighbours folded in (PDL on Hopper); flat GEMMs
def test_gpu_replayed_layers_equal_every_layer_through_its_wrappers(seqs):
    model = tiny_llama(1, vocab_size=VOCAB, layers=5, intermediate_size=96).to("cuda", torch.bfloat16)
    _replay_compared(model, seqs, None)


def test_merged_weights_are_views_and_the_torch_path_is_unchanged():
    model = tiny_model("qwen2")
    x = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        before = model(x)
    fused = FusedDecode(model)
    attn = model.model.layers[0].self_attn
    w = fused.weights[0]
    assert attn.k_proj.weight.data_ptr() == w.qkv.data_ptr() + attn.q_proj.weight.numel() * w.qkv.element_size()
    assert w.qkv_bias is not None and w.gate_up.shape == (2 * 96, 64)
    assert FusedDecode(model).weights[0].qkv is w.qkv, "merging twice must reuse the merged tensor"
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, atol=0, rtol=0)


@on_cpu
def test_engine_fused_greedy_tokens_equal_unfused_on_cpu():
    model = tiny_model()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in (3, 11, 6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(fused):
        engine = LLMEngine(model, TOKENIZER, EngineConfig(num_blocks=128, block_size=4, max_num_seqs=4, max_n=4,
                                                          seed=0, fused_decode=fused))
        assert engine.fused_decode == (fused == "on")
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return [done[i].outputs[0].token_ids for i in ids]

    assert run("on") == run("off")


def test_auto_is_off_on_cpu_and_mla_or_foreign_models_are_refused():
    model = tiny_model()
    cache = model.new_paged_cache(8, 4)
    assert not enable_fused_decode(model, cache, "auto") and model.fused_decode is None
    assert enable_fused_decode(model, cache, "on") and model.fused_decode is not None
    assert not enable_fused_decode(model, cache, "off") and model.fused_decode is None
    assert not supports_fused_decode(object())
    with pytest.raises(ValueError):
        enable_fused_decode(object(), cache, "on")
    with pytest.raises(ValueError):
        EngineConfig(fused_decode="yes")


def test_device_draw_follows_the_distribution():
    from minillm.decoding.sampling import draw_on_device

    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25])
    gen = torch.Generator().manual_seed(0)
    counts = np.bincount([draw_on_device(probs, gen) for _ in range(4000)], minlength=5)
    assert counts[0] == counts[2] == 0
    np.testing.assert_allclose(counts / 4000, probs.numpy(), atol=0.03)


# --- sampling on the device (Chapter 10, `minillm.decoding.gpu_sampling`) -----------------

def tiny_engine(model, fused: str):
    return LLMEngine(model, TOKENIZER, EngineConfig(num_blocks=128, block_size=4, max_num_seqs=4, max_n=4, seed=0,
                                                    fused_decode=fused))


@on_cpu
def test_engine_samples_on_device_on_cpu():
    from minillm.testing import run_to_completion as run

    model = tiny_model()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in (3, 11, 6, 5)]
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, max_tokens=5, ignore_eos=True, seed=3),
              SamplingParams(temperature=1.0, top_p=0.9, n=2, max_tokens=4, ignore_eos=True, seed=4,
                             frequency_penalty=0.5, logprobs=2),
              SamplingParams(temperature=0.9, n=3, max_tokens=4, ignore_eos=True, seed=8)]
    engine = tiny_engine(model, "on")
    assert engine.sample_on_device
    together = [[c.token_ids for c in o.outputs] for o in run(engine, prompts, params)]
    alone = [[c.token_ids for c in run(engine, [p], [q])[0].outputs] for p, q in zip(prompts, params)]
    assert together == alone, "a request's tokens must not depend on the batch"
    unfused = tiny_engine(model, "off")
    assert not unfused.sample_on_device
    assert together[0] == [[c.token_ids for c in o.outputs] for o in run(unfused, prompts[:1], params[:1])][0]
    assert [len(c) for c in together[2]] == [4, 4] and [len(c) for c in together[3]] == [4, 4, 4]
    assert len(set(map(tuple, together[3]))) > 1, "the n samples draw with their own keys"
    singles = run(engine, [prompts[3]] * 3, [SamplingParams(**{**params[3].__dict__, "n": 1, "seed": 8 + i})
                                             for i in range(3)])
    assert [o.outputs[0].token_ids for o in singles] == together[3], "sample i of seed s is seed s + i's sample"
    # processed rows are drawn from their processed logits: a +100 bias leaves nothing else to draw
    biased = SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True, seed=1, logit_bias={77: 100.0})
    assert run(engine, prompts[:2], [biased, params[1]])[0].outputs[0].token_ids == [77] * 3
    # logprobs are of the tokens drawn; beam search runs as before
    out = run(engine, prompts[2:3], params[2:3])[0].outputs[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids and all(len(lp.top) == 2 for lp in out.logprobs)
    beams = SamplingParams(num_beams=2, n=2, max_tokens=3, ignore_eos=True, temperature=0)
    assert [c.token_ids for c in run(engine, prompts[:1], beams)[0].outputs] == \
        [c.token_ids for c in run(unfused, prompts[:1], beams)[0].outputs]


# --- GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_fused_teacher_forced_logits_within_tolerance(dtype, graphs):
    model, _ = load_model(BUNDLED_MODEL, device="cuda", dtype=dtype)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in (5, 17, 40, 2, 9)]
    want = teacher_forced_logits(model, False, prompts, steps=6, graphs=graphs)
    got = teacher_forced_logits(model, True, prompts, steps=6, graphs=graphs)
    tol = 0.1 if dtype == torch.bfloat16 else 0.03
    for step, (g, w) in enumerate(zip(got, want)):
        g, w = g.float(), w.float()
        err = (g - w).abs().max().item()
        assert err <= tol * max(1.0, w.abs().max().item()), f"step {step}: max |fused - unfused| = {err:.3g}"
        assert (g.argmax(-1) == w.argmax(-1)).float().mean().item() >= 0.8, f"step {step}: greedy choices differ"


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", ["all", "off"])
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])   # fp16: the teacher-forced test above
def test_gpu_fused_engine_decodes_greedily_and_samples_on_device(dtype, cuda_graphs):
    """The fused engine is the default on CUDA; every greedy token must be a greedy choice of the
    torch model within a logit tolerance (teacher forcing); a sampled request runs too (its
    logits stay on the GPU)."""
    model, _ = load_model(BUNDLED_MODEL, device="cuda", dtype=dtype)
    engine = LLMEngine(model, TOKENIZER, EngineConfig(num_blocks=256, max_num_seqs=16, cuda_graphs=cuda_graphs))
    assert engine.fused_decode and model.fused_decode is not None
    prompts = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed any further, hear me speak."]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts * 3]
    sampled = engine.add_request(prompts[0], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16,
                                                            ignore_eos=True, seed=5))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert (engine.runner.num_replays > 0) == (cuda_graphs == "all")
    assert len(done[sampled].outputs[0].token_ids) == 16
    model.fused_decode = None          # the torch path as the oracle
    for rid in ids:
        out = done[rid]
        got = out.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([out.prompt_token_ids + got], device="cuda"))[0].float()
        rows = logits[len(out.prompt_token_ids) - 1:-1]
        chosen = rows.gather(1, torch.tensor(got, device="cuda")[:, None])[:, 0]
        assert bool((chosen >= rows.max(-1).values - 0.25).all()), "a token the fused engine chose is not greedy"


@pytest.mark.gpu
def test_gpu_eager_engine_tunes_everything_before_the_first_request():
    """Without graphs the engine runs every step shape once at start-up (`ModelRunner.warm_up`):
    the GEMV, flat-GEMM and prompt-attention tiles are tuned then and every kernel variant
    compiled, and requests
    whose batch shrinks one at a time through every size, over block tables of many widths
    (prompts of 2 to 400 tokens), tune and compile nothing more, fused or not."""
    from minillm.kernels import ch08_flat_gemm, ch10_fused_decode
    from minillm.testing import compiled_kernel_variants

    ch10_fused_decode.PROLOGUE_CONFIGS.clear()
    model, _ = load_model(BUNDLED_MODEL, device="cuda", dtype=torch.bfloat16)
    for fused in ("on", "off"):
        engine = LLMEngine(model, TOKENIZER, EngineConfig(num_blocks=512, max_num_seqs=16, cuda_graphs="off",
                                                          fused_decode=fused))
        assert engine.fused_decode == (fused == "on")
        assert fused == "off" or ch10_fused_decode.PROLOGUE_CONFIGS, "the warm-up tuned the decode GEMVs"
        tuned = (set(ch10_fused_decode.PROLOGUE_CONFIGS), set(ch08_flat_gemm.TUNING_TIMES))
        compiled = compiled_kernel_variants()
        rng = np.random.default_rng(3)
        for i in range(16):
            prompt = rng.integers(0, VOCAB, int(rng.integers(2, 400 if i % 4 == 0 else 90))).tolist()
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=i + 1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.runner.num_replays == 0 and engine.runner.num_eager >= 16
        assert (set(ch10_fused_decode.PROLOGUE_CONFIGS), set(ch08_flat_gemm.TUNING_TIMES)) == tuned
        grew = {k: (n, compiled.get(k, 0)) for k, n in compiled_kernel_variants().items() if n != compiled.get(k, 0)}
        assert not grew, f"compiled or tuned during the requests (after, before): {grew}"
        model.fused_decode = None



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_staged_batches_fill_the_graph_buffers_as_field_copies(device):
    """`ModelRunner._stage` (a host batch through the pinned mirrors, two copies) leaves what a
    graph reads exactly as `ModelRunner._copy_fields` (a device batch, field by field): each
    step's rows, padding tokens with slot -1, padding sequences of length 0 (and, in a mixed
    step, no queries), the block tables, over steps of every kind in turn (so the two mirrors
    hold stale rows of other steps), input ids taken on the device included."""
    from types import SimpleNamespace

    from minillm.engine.model_runner import CapturedGraph

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device(device)
    cache = SimpleNamespace(pool=torch.empty(1, device=dev), block_size=4, kernels=None)
    runners = [ModelRunner(None, cache) for _ in range(2)]
    for r in runners:
        r._static_buffers(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32, sample_tokens=False)
    manager = BlockManager(64, 4, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    for i in range(8):
        manager.allocate(i, rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist())
    for step in range(24):
        B = int(rng.integers(1, 9))
        seqs = rng.choice(8, B, replace=False).tolist()
        decode = step % 3 != 2
        counts = [1] * B if decode else [int(rng.integers(1, 1 + min(4, manager.num_tokens(s)))) for s in seqs]
        host = PagedBatch.from_manager(manager, seqs, counts, max_blocks=16)
        if step % 4 == 1:   # a step launched ahead: its input ids on the device
            host = dataclasses.replace(host, input_ids=host.input_ids.to(dev))
        bucket = next(b for b in ((1, 2, 4, 8) if decode else (16, 32)) if b >= host.num_tokens)
        kind = "decode" if decode else "mixed"
        graphs = [CapturedGraph(None, r._static_batch(kind, bucket), None) for r in runners]
        runners[0]._stage(graphs[0], host)
        runners[1]._copy_fields(graphs[1], host.to(dev))
        a, b = graphs[0].batch, graphs[1].batch
        n = host.num_tokens
        assert torch.equal(a.input_ids[:n], b.input_ids[:n]) and torch.equal(a.positions[:n], b.positions[:n])
        assert torch.equal(a.slot_mapping, b.slot_mapping) and torch.equal(a.seq_lens, b.seq_lens)
        assert torch.equal(a.block_tables[:B, :16], b.block_tables[:B, :16])
        assert torch.equal(a.cu_seqlens_q, b.cu_seqlens_q)
        assert bool((a.slot_mapping[n:] == -1).all()) and bool((a.seq_lens[B:] == 0).all())
        for s in seqs:   # the sequences grow between steps: the tables and lengths change
            manager.append_slots([s], [int(rng.integers(0, VOCAB))])
