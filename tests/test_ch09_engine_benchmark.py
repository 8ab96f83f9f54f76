"""Chapter 9: ``minillm bench`` (minillm/experiments/ch09_engine_benchmark.py) and the model runner's CUDA-graph
padding, on the CPU.

No timing is asserted: the tests check the workload generator, the metric arithmetic
(percentiles, TTFT/TPOT/ITL, KV waste), that a tiny end-to-end run produces exactly the
tokens asked for, and that a step padded to a graph's bucket (the static buffers, padding
slots -1, padding sequences of length 0, ``max_model_len`` splits, ``max_seqlen_q`` = the
bucket) computes what the unpadded eager step computes. That last check runs the Triton
kernels in the interpreter and "replays" a graph by re-running the forward pass on the static
buffers: a CUDA graph replays exactly the kernels of that pass.
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch

from minillm.engine import LLMEngine, SamplingParams
from minillm.experiments import ch09_engine_benchmark as bench
from minillm.engine import model_runner
from minillm.engine.engine import StepRecord
from minillm.engine.model_runner import CapturedGraph, ModelRunner, decode_buckets, step_shapes, token_buckets
from minillm.engine.request import RequestMetrics
from minillm.model import LlamaForCausalLM, ModelConfig, load_tokenizer
from minillm.model import paged as paged_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BUNDLED = bench.BUNDLED


# --- the workload ------------------------------------------------------------------------------

def test_workload_is_seeded_and_within_its_ranges():
    spec = bench.WorkloadSpec(50, (3, 9), (2, 5), seed=7)
    a, b = bench.make_workload(spec, 100), bench.make_workload(spec, 100)
    assert a == b
    assert len(a) == 50
    assert all(3 <= len(r.prompt_ids) <= 9 and 2 <= r.max_tokens <= 5 for r in a)
    assert all(0 <= t < 100 for r in a for t in r.prompt_ids)
    assert {len(r.prompt_ids) for r in a} == set(range(3, 10))  # both ends are reachable
    assert bench.make_workload(bench.WorkloadSpec(50, (3, 9), (2, 5), seed=8), 100) != a
    with pytest.raises(ValueError):
        bench.WorkloadSpec(4, (5, 3), (1, 1))


def test_poisson_arrivals():
    t = bench.poisson_arrivals(20000, rate=50.0, seed=1)
    assert t[0] == 0 and all(b >= a for a, b in zip(t, t[1:]))
    assert np.mean(np.diff(t)) == pytest.approx(1 / 50, rel=0.05)
    assert bench.poisson_arrivals(20000, 50.0, seed=1) == t
    assert bench.poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        bench.poisson_arrivals(3, 0)


# --- metrics -------------------------------------------------------------------------------------

def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.normal(size=n).tolist()
        for q in (0, 1, 50, 90, 99, 100):
            assert bench.percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert bench.percentile([], 50) is None
    assert bench.percentile([1, 2, 3, 4], 50) == 2.5


def test_latency_summary():
    # Request A: arrives at 0, tokens at 1.0, 1.5, 2.5; B: arrives at 1, one token at 1.25.
    a = RequestMetrics(arrival=0.0, first_token=1.0, token_times=[1.0, 1.5, 2.5], finished=2.5)
    b = RequestMetrics(arrival=1.0, first_token=1.25, token_times=[1.25], finished=1.25)
    s = bench.latency_summary([a, b])
    assert s.ttft_p50_ms == pytest.approx(625.0)               # TTFTs 1000 and 250 ms
    assert s.ttft_mean_ms == pytest.approx(625.0)
    assert s.ttft_p99_ms == pytest.approx(250 + 0.99 * 750)
    assert s.tpot_p50_ms == pytest.approx(750.0)               # A only: (2.5 - 1.0) / 2
    assert s.itl_p50_ms == pytest.approx(750.0)                # gaps 500 and 1000 ms
    assert s.itl_p99_ms == pytest.approx(500 + 0.99 * 500)
    assert s.e2e_p50_ms == pytest.approx((2500 + 250) / 2)
    empty = bench.latency_summary([])
    assert empty.ttft_p50_ms is None and empty.tpot_p99_ms is None


def test_kv_waste_from_step_records():
    def rec(blocks, tokens):
        return StepRecord(0.0, 1.0, {}, 0, 0, blocks, tokens)
    # 4 blocks of 16 holding 60 tokens: 4 of 64 slots empty; 2 blocks holding 16: half empty.
    mean, worst = bench.kv_waste([rec(4, 60), rec(2, 16), rec(0, 0)], block_size=16)
    assert worst == pytest.approx(0.5)
    assert mean == pytest.approx((4 / 64 + 0.5) / 2)
    assert bench.kv_waste([], 16) == (0.0, 0.0)


def test_count_parameters_matches_the_model():
    config = ModelConfig(model_type="llama", vocab_size=300, num_key_value_heads=2,
                         **{k: v for k, v in bench.PRESETS["llama-tiny"].items()
                            if k not in ("max_position_embeddings", "num_key_value_heads")})
    model = LlamaForCausalLM(config)
    assert bench.count_parameters(bench.PRESETS["llama-tiny"], 300) == sum(p.numel() for p in model.parameters())


# --- end to end on the CPU ---------------------------------------------------------------------------

def test_random_llama_loads_in_minillm_and_transformers(tmp_path):
    """The default model's builder: a folder both minillm and transformers load, with the same
    logits, and whose token ids the tokenizer decodes."""
    transformers = pytest.importorskip("transformers")
    path = bench.build_random_llama("llama-tiny", tmp_path / "m", dtype="float32", device="cpu")
    assert bench.build_random_llama("llama-tiny", tmp_path / "m") == path  # cached: not rebuilt
    from minillm.model import load_model

    ours, config = load_model(path, dtype="float32")
    tokenizer, _ = load_tokenizer(path)
    assert config.vocab_size == tokenizer.get_vocab_size()
    assert isinstance(tokenizer.decode(list(range(0, config.vocab_size, 97))), str)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).float().eval()
    ids = torch.randint(0, config.vocab_size, (1, 12))
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_offline_and_online_on_the_bundled_model():
    """A tiny run: exact output counts, sane metrics, no preemption with a roomy pool, and the
    forced-preemption case with a pool too small for everyone at once."""
    engine = bench.build_engine(BUNDLED, cuda_graphs="off", device="cpu", max_num_seqs=4, max_n=4,
                                max_num_batched_tokens=64, num_blocks=64, seed=0)
    workload = bench.make_workload(bench.WorkloadSpec(6, (4, 20), (2, 6), seed=3), 4096)
    r = bench.run_offline(engine, workload, mode="off", use_tqdm=False)
    assert r.output_tokens == sum(w.max_tokens for w in workload) and r.num_requests == 6
    assert r.output_tokens_per_s > 0 and r.total_tokens_per_s > r.output_tokens_per_s
    assert 0 <= r.kv_waste_mean <= r.kv_waste_max < 1
    assert r.preemptions == 0 and 0 < r.peak_kv_blocks <= 64 and r.eager_steps == r.steps
    assert engine.manager.num_used_blocks == 0 or not engine.has_unfinished_requests()

    on = bench.run_online(engine, workload, rate=200.0, seed=1, use_tqdm=False)
    lat = on.latency
    assert on.num_requests == 6
    assert 0 < lat.ttft_p50_ms <= lat.ttft_p99_ms and 0 < lat.itl_p50_ms <= lat.itl_p99_ms
    assert lat.e2e_p50_ms >= lat.ttft_p50_ms

    small = bench.build_engine(BUNDLED, cuda_graphs="off", device="cpu", max_num_seqs=4, max_n=4,
                               max_num_batched_tokens=64, num_blocks=6, enable_prefix_caching=False)
    tight = bench.make_workload(bench.WorkloadSpec(4, (20, 30), (10, 12), seed=4), 4096)
    r = bench.run_offline(small, tight, use_tqdm=False)
    assert r.preemptions > 0 and r.peak_kv_blocks <= 6


def test_bench_command_with_peer(tmp_path, capsys):
    pytest.importorskip("transformers")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "rows.json"
    args = parser.parse_args(["--model", str(BUNDLED), "--device", "cpu", "--num-requests", "5", "--prompt-len", "3",
                              "10", "--output-len", "2", "5", "--concurrency", "4", "--request-rate", "100",
                              "--no-progress", "--json", str(out)])
    assert bench.main(args) == 0
    table = capsys.readouterr().out
    assert "hf_static_batching" in table and "TTFT p50" in table
    rows = json.loads(out.read_text())
    kinds = [(r["kind"], r["system"]) for r in rows]
    assert kinds == [("offline", "hf_static_batching"), ("offline", "minillm"), ("online", "minillm")]
    hf, ours = rows[0], rows[1]
    assert hf["output_tokens"] == ours["output_tokens"]
    assert hf["generated_tokens"] >= hf["output_tokens"] and 0 < hf["useful_fraction"] <= 1
    assert rows[2]["ttft_p50_ms"] > 0 and rows[2]["request_rate"] == 100


def test_bench_rejects_a_folder_without_a_checkpoint(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.main(parser.parse_args(["--model", str(tmp_path)])) == 2


# --- the model runner's padding to graph buckets ---------------------------------------------------

def test_buckets():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert token_buckets(2048) == [64, 128, 256, 512, 1024, 2048]
    assert token_buckets(100) == [64, 100]
    # what capture records and an eager engine's warm-up runs: every decode bucket and every
    # token bucket, largest first (the warm-up from 16 tokens: an eager step is not padded)
    assert step_shapes(6, 100) == [("mixed", 100), ("mixed", 64), ("decode", 6), ("decode", 4), ("decode", 2),
                                   ("decode", 1)]
    assert step_shapes(4, 0) == [("decode", 4), ("decode", 2), ("decode", 1)]


def test_eager_warm_up_widths_meet_every_split_class():
    """An eager engine's warm-up runs block tables of widths 1 .. max_blocks, each at most
    twice the one before: the split count follows the width, so no power of two of it (the
    merge tile, a compiled variant of its own) is skipped between two widths the warm-up ran."""
    from minillm.engine.model_runner import warm_up_widths

    for max_blocks in (1, 2, 5, 64, 100, 2048):
        widths = warm_up_widths(max_blocks)
        assert widths[0] == 1 and widths[-1] == max_blocks and widths == sorted(set(widths))
        assert all(b <= 2 * a for a, b in zip(widths, widths[1:])), widths
    assert len(warm_up_widths(2048)) < 25   # a ladder, not every width


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("new_tokens", [1, 3])
def test_step_fields_are_16_byte_aligned_whatever_the_batch(batch, new_tokens):
    """`PagedBatch.from_manager` packs the step into two buffers (one copy each to the GPU);
    every field starts on a 16-byte boundary whatever the batch size and token count, so a
    Triton kernel sees one alignment and compiles one variant (an eager engine compiled new
    ones inside its steps when the offsets followed the batch)."""
    from minillm.model.paged import PagedBatch
    from minillm.paged import BlockManager

    manager = BlockManager(64, 4)
    rng = np.random.default_rng(batch)
    for s in range(batch):
        manager.allocate(s, rng.integers(0, 100, int(rng.integers(new_tokens, 9))).tolist())
    step = PagedBatch.from_manager(manager, list(range(batch)), new_tokens)
    for name in ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables"):
        assert getattr(step, name).data_ptr() % 16 == 0, name
    assert step.cu_seqlens_q.tolist() == [new_tokens * i for i in range(batch + 1)]
    assert step.input_ids.numel() == step.positions.numel() == step.slot_mapping.numel() == batch * new_tokens
    assert step.seq_lens.numel() == batch and step.block_tables.shape[0] == batch
    assert [t for k, t in step_shapes(2, 100, smallest_mixed=16) if k == "mixed"] == [100, 64, 32, 16]


class _ReplayByRerun:
    """Stands in for a CUDA graph on the CPU: replaying re-runs the forward pass on the static
    buffers (what the graph recorded) and writes the logits in place."""

    def __init__(self, runner: ModelRunner, batch):
        self.runner, self.batch = runner, batch
        self.logits = torch.empty(batch.batch_size, runner.model.config.vocab_size)

    def replay(self):
        self.logits.copy_(self.runner.model.forward_paged(self.batch, self.runner.cache, last_only=True))


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    config = ModelConfig(model_type="llama", vocab_size=4096, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=64)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name or "lm_head" in name:
                p.normal_(0, 0.5)
    return model


def test_padded_graph_steps_equal_eager(monkeypatch, device):
    """Greedy outputs of an engine whose every step runs padded to a bucket (decode graphs of
    1 and 2 sequences, a mixed graph of 16 tokens: chunked prefill, prefills beside decodes)
    through the Triton kernels equal those of the eager torch engine. On a CPU the kernels run
    in the interpreter and a replay re-runs the pass; on a GPU the graphs are real."""
    pytest.importorskip("minillm.kernels.ch07_flash_decoding")
    if device.type != "cuda":
        monkeypatch.setattr(ModelRunner, "can_capture", lambda self: self.cache.kernels is not None)

        def capture(self, batch, pool, sampling=None):
            fake = _ReplayByRerun(self, batch)
            return CapturedGraph(fake, batch, fake.logits), None

        monkeypatch.setattr(ModelRunner, "capture", capture)
    monkeypatch.setattr(model_runner, "token_buckets", lambda n, smallest=64: [n])
    replayed = []
    original_replay = ModelRunner.replay

    def replay_and_check(self, graph, batch, sampling=None):
        """The padding contract, as the graph saw it: the step's rows first, then padding
        tokens with slot -1 and padding sequences of length 0 (and no queries)."""
        logits = original_replay(self, graph, batch, sampling)
        batch = batch.to(graph.batch.seq_lens.device)   # the engine builds a graph step's batch on the host
        s, n, B = graph.batch, batch.num_tokens, batch.batch_size
        assert torch.equal(s.input_ids[:n], batch.input_ids) and torch.equal(s.positions[:n], batch.positions)
        assert torch.equal(s.slot_mapping[:n], batch.slot_mapping) and bool((s.slot_mapping[n:] == -1).all())
        assert torch.equal(s.seq_lens[:B], batch.seq_lens) and bool((s.seq_lens[B:] == 0).all())
        assert torch.equal(s.block_tables[:B, :batch.block_tables.shape[1]], batch.block_tables)
        assert torch.equal(s.cu_seqlens_q[:B + 1], batch.cu_seqlens_q) and bool((s.cu_seqlens_q[B + 1:] == n).all())
        assert s.max_seq_len == self.max_model_len and logits.shape[0] == B
        replayed.append((s.max_seqlen_q > 1, s.num_tokens))
        return logits

    monkeypatch.setattr(ModelRunner, "replay", replay_and_check)
    model, (tokenizer, _) = tiny_model().to(device), load_tokenizer(BUNDLED)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 4096, n).tolist() for n in (5, 20, 3)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 2, 3)]
    outputs = []
    for backend in ("torch", "triton"):
        engine = LLMEngine(model, tokenizer, bench.EngineConfig(
            device=device.type, max_num_seqs=2, max_n=2, max_num_batched_tokens=16, num_blocks=16, block_size=4,
            attention_backend=backend, overlap_decode="off"))   # an overlapped step takes its ids on the GPU
        if backend == "triton":  # the engine captured them (EngineConfig.cuda_graphs defaults to "all")
            assert len(engine.runner.graphs) == 3
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        outputs.append([done[i] for i in ids])
        if backend == "triton":
            assert engine.runner.num_eager == 0 and engine.runner.num_replays == len(replayed)
    assert outputs[1] == outputs[0]
    assert set(replayed) == {(True, 16), (False, 1), (False, 2)}  # every graph ran


def test_fresh_prefill_runs_flash_attention_varlen(device):
    """A step of fresh prompts only goes to FlashAttention-2 varlen (the interpreter on a CPU),
    with the torch backend's logits; a step after a cached prefix does not."""
    pytest.importorskip("minillm.kernels.ch04_flash_attention")
    from minillm.model.paged import PagedBatch
    from minillm.paged import BlockManager

    calls = []
    model, rng = tiny_model(1).to(device), np.random.default_rng(1)
    prompts = {"a": rng.integers(0, 4096, 7).tolist(), "b": rng.integers(0, 4096, 3).tolist()}
    logits = []
    for backend in ("torch", "triton"):
        manager, cache = BlockManager(12, 3), model.new_paged_cache(12, 3, backend=backend)
        if cache.kernels is not None:
            original = cache.kernels.flash_attention_varlen
            cache.kernels.flash_attention_varlen = lambda *a, **k: calls.append(1) or original(*a, **k)
        for s, p in prompts.items():
            manager.allocate(s, p)
        batch = PagedBatch.from_manager(manager, list(prompts), [7, 3], device=device)
        assert batch.fresh_prefill
        with torch.no_grad():
            logits.append(model.forward_paged(batch, cache))
        manager.append_slots(["a"], [[5, 6]])
        assert not PagedBatch.from_manager(manager, ["a"], [2]).fresh_prefill
    assert calls == [1] * model.config.num_hidden_layers
    assert float((logits[1] - logits[0]).abs().max() / logits[0].abs().max()) <= 1e-5
    assert paged_module.PagedBatch.from_manager(manager, ["b"], [3]).fresh_prefill


def test_ch09_rows_and_summary():
    """The Chapter 9 benchmark's rows and summary from made-up results (it runs on a GPU)."""
    from bench import ch09_engine
    from bench.common import Results

    results = Results("Test GPU", env={})
    base = {"model": "m", "parameters_m": 1.0}
    peer = bench.OfflineResult("hf_static_batching", "generate", 4, 2, 2.0, 40, 20, 10.0, 30.0, 2.0, 30, 2 / 3,
                               steps=15)
    ours = bench.OfflineResult("minillm", "cuda_graphs_all", 4, 2, 0.5, 40, 20, 40.0, 120.0, 8.0, 20, 1.0, steps=12,
                               kv_waste_mean=0.02, kv_waste_max=0.05, preemptions=0, peak_kv_blocks=9,
                               num_kv_blocks=100, decode_step_ms=1.5, eager_steps=0)
    ch09_engine.add_offline(results, base, "cuda_graphs_all", ours, peer)
    headline = results.rows[0]
    assert headline["metric"] == "output_tokens_per_s" and headline["ratio"] == pytest.approx(4.0)
    text = ch09_engine.summary(results)
    assert "cuda_graphs_all" in text and "4.00" in text and "2.00%" in text
