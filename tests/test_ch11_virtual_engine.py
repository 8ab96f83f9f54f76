"""Chapter 11 in the engine: ``EngineConfig(kv_cache="virtual")`` gives the paged engine's
outputs (`minillm.vmm.manager`).

CPU: the virtual mode runs over the simulated allocator (`SimulatedVirtualCache`, poisoned:
every unmapped page reads NaN, so a read the GPU would fault on changes the tokens). Tiny
random Llama models in float32: greedy and seeded sampled tokens equal to the paged engine's
on a mixed workload (prompts of many lengths, chunked prefill, ``n > 1``, beam search,
preemption in a small pool), with the torch backend and with the Triton kernels in the
interpreter; the manager's invariants under random operations (hypothesis); clear errors for
configurations that cannot run. GPU: teacher-forced bf16 tokens equal across the two modes,
CUDA graphs on and off, and no memory left mapped after the cache closes.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engine import BUNDLED_MODEL, EngineConfig, InvalidRequest, LLMEngine, SamplingParams
from minillm.kernels.base import interpreting
from minillm.model import LlamaForCausalLM, load_tokenizer
from minillm.paged import OutOfBlocks
from minillm.testing import run_to_completion as run, tiny_llama
from minillm.vmm import manager as vm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 256
TOKENIZER = load_tokenizer(BUNDLED_MODEL)[0]


def tiny_model(seed: int = 0, kv_heads: int = 2, head_dim: int = 16, layers: int = 2) -> LlamaForCausalLM:
    return tiny_llama(seed, vocab_size=VOCAB, kv_heads=kv_heads, head_dim=head_dim, layers=layers,
                      max_position_embeddings=256)


def make_engine(model, kv_cache: str, **config) -> LLMEngine:
    config = {"num_blocks": 256, "block_size": 4, "max_num_seqs": 16, "max_n": 4, "seed": 0, "kv_cache": kv_cache,
              **config}
    return LLMEngine(model, TOKENIZER, EngineConfig(**config))


def poison(engine: LLMEngine) -> LLMEngine:
    """Swap a virtual engine's simulated cache for a poisoned one of the same shape (before any
    request): unmapped pages read NaN."""
    c = engine.config
    engine.manager, engine.cache = vm.build_kv_cache(engine.model, c, engine.manager.num_blocks, poison=True)
    engine.scheduler.manager = engine.manager
    engine.runner.cache = engine.cache
    return engine


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def workload(rng, n: int = 10):
    prompts = [rng.integers(0, VOCAB, int(rng.integers(3, 40))).tolist() for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=int(rng.integers(5, 30))) for _ in prompts]
    params[3] = SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=7)
    params[5] = SamplingParams(temperature=1.0, top_p=0.9, n=3, max_tokens=12, seed=3)
    params[7] = SamplingParams(num_beams=3, n=2, max_tokens=10)
    return prompts, params


VARIANTS = {
    "batched": {},
    "tiny-pool": {"num_blocks": 24},                              # forces preemption
    "chunked-prefill": {"max_num_batched_tokens": 16},            # prompts split over steps
    "tiny-pool-chunked": {"num_blocks": 40, "max_num_batched_tokens": 16},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_virtual_engine_gives_the_paged_engines_tokens(variant):
    model = tiny_model(1)
    prompts, params = workload(np.random.default_rng(11))
    paged = make_engine(model, "paged", **VARIANTS[variant])
    virtual = poison(make_engine(model, "virtual", **VARIANTS[variant]))
    assert isinstance(virtual.manager, vm.VirtualBlockManager) and virtual.manager.num_blocks == paged.manager.num_blocks
    want, got = run(paged, prompts, params), run(virtual, prompts, params)
    assert tokens(got) == tokens(want)
    for o in got:
        assert all(np.isfinite(c.cumulative_logprob or 0.0) for c in o.outputs)
    m = virtual.manager
    assert m.num_forks > 0 and m.fork_copied_tokens > 0          # n > 1 and the beams copied their parents
    assert not m.table.requests and m.num_used_blocks == 0
    if "tiny-pool" in variant:
        assert virtual.scheduler.num_preemptions > 0
    virtual.cache.close()
    assert not m.table.mappings()


def test_virtual_mode_turns_prefix_caching_off_and_counts_pages():
    config = EngineConfig(kv_cache="virtual")
    assert config.enable_prefix_caching is False
    model = tiny_model()
    # on a CPU a page is block_size tokens of one tensor: the same pool from the same budget
    pools = [LLMEngine(model, TOKENIZER, EngineConfig(kv_cache=mode, block_size=8, kv_cache_memory_mb=0.5))
             .manager.num_blocks for mode in ("paged", "virtual")]
    assert pools[0] == pools[1] > 0
    engine = make_engine(model, "virtual", block_size=8, num_blocks=10)
    m = engine.manager
    assert m.block_size == 8 and m.num_blocks == 10 and m.capacity % 8 == 0 and m.capacity >= engine.max_model_len
    assert engine.cache.block_size == m.capacity and engine.cache.num_blocks == 16 + 4 - 1
    with pytest.raises(InvalidRequest, match="KV blocks"):   # 3 samples of 30 tokens: 3 x 4 pages > 10
        engine.add_request(list(range(20)), SamplingParams(n=3, max_tokens=10))
    engine.add_request(list(range(20)), SamplingParams(n=2, max_tokens=10))


@pytest.mark.skipif(not interpreting(), reason="the Triton kernels on CPU tensors need Triton's interpreter")
@pytest.mark.parametrize("fused", ["off", "on"])
def test_triton_kernels_on_the_slot_cache_match_paged(fused):
    """Chapter 5's write and prefill kernels, Chapter 7's flash-decoding and (fused) Chapter 10's
    RoPE + cache write, interpreted, read the virtual cache as a pool of one block per slot."""
    model = tiny_model(5)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in (5, 13, 22)]
    params = SamplingParams(temperature=0, max_tokens=5)
    want = run(make_engine(model, "paged", attention_backend="torch", fused_decode="off"), prompts, params)
    # chunked (a prefill after a cached part: the paged prefill kernel) and fresh prefills (FA2 varlen)
    engine = poison(make_engine(model, "virtual", attention_backend="triton", max_num_batched_tokens=16,
                                fused_decode=fused))
    assert engine.cache.kernels is not None and engine.fused_decode == (fused == "on")
    assert tokens(run(engine, prompts, params)) == tokens(want)


# --- the manager -----------------------------------------------------------------------------

def small_manager(num_blocks=12, slots=4, block_size=2, capacity_tokens=12, ahead=0, poison_pages=True):
    model = tiny_model(layers=1)
    config = EngineConfig(kv_cache="virtual", block_size=block_size, max_num_seqs=slots, max_n=1,
                          max_num_batched_tokens=64, max_model_len=capacity_tokens)
    manager, cache = vm.build_kv_cache(model, config, num_blocks, poison=poison_pages)
    manager.ahead_tokens = ahead
    return manager, cache


def check_invariants(m: vm.VirtualBlockManager) -> None:
    g, t = m.geometry, m.table
    maps = t.mappings()
    assert len(set(maps.values())) == len(maps), "a physical page behind two virtual pages"
    assert len(maps) + t.num_free_pages == t.num_physical_pages
    for seq_id in m.seq_ids():
        if not m.has_slot(seq_id):   # a pending fork holds nothing yet
            continue
        slot, n = m.block_table(seq_id)[0], m.num_tokens(seq_id)
        assert t.tokens[slot] == n
        assert t.mapped_pages[slot] >= g.pages_for(n)                     # mapped >= held
        for tensor in range(g.num_tensors):
            for page in range(t.mapped_pages[slot]):
                assert (tensor, slot, page) in maps
        assert g.pages_for(n) * g.page_bytes - n * g.bytes_per_token < g.page_bytes   # waste < one page
    assert t.waste_bytes() <= len(t.requests) * g.num_tensors * (g.page_bytes - 1)
    assert 0 <= m.num_used_blocks <= m.num_blocks
    assert m.num_available_blocks + m.num_used_blocks == m.num_blocks


OPS = st.lists(st.tuples(st.sampled_from(["allocate", "append", "fork", "free"]), st.integers(0, 7),
                         st.integers(1, 5)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, ahead=st.sampled_from([0, 3]))
def test_manager_invariants(ops, ahead):
    m, cache = small_manager(ahead=ahead)
    written: dict = {}   # seq id -> the token ids whose rows we wrote (row value = token id)
    names = iter(range(10**6))
    k0 = cache.k[0]
    for op, pick, count in ops:
        live = m.seq_ids()
        try:
            if op == "allocate":
                sid = f"s{next(names)}"
                m.allocate(sid, [pick + i for i in range(count)])
                slots, new = m.slot_mapping(sid), list(m.token_ids(sid))
            elif op == "append" and live:
                sid = live[pick % len(live)]
                if m.num_tokens(sid) + count > m.capacity:
                    continue
                res = m.append_slots([sid], [[pick] * count])
                assert res.copies == () and list(res.slots) == m.slot_mapping(sid)[-count:]
                slots, new = list(res.slots), [pick] * count
            elif op == "fork" and live:
                parent = live[pick % len(live)]
                sid = f"f{next(names)}"
                m.fork(parent, sid)
                written[sid] = list(written.get(parent, []))
                continue
            elif op == "free" and live:
                sid = live[pick % len(live)]
                m.free(sid)
                written.pop(sid, None)
                continue
            else:
                continue
        except OutOfBlocks:
            check_invariants(m)
            continue
        # write the new tokens' ids into their rows (as the forward pass would), then check that
        # every materialized sequence reads back all of its tokens: forks copied their parents' rows
        k0.view(-1, *k0.shape[2:])[torch.tensor(slots)] = torch.tensor(new, dtype=k0.dtype)[:, None, None]
        written[sid] = list(m.token_ids(sid))
        check_invariants(m)
        for s in m.seq_ids():
            if m.has_slot(s) and s in written:
                got = k0[m.block_table(s)[0], :m.num_tokens(s), 0, 0].tolist()
                assert got == [float(x) for x in m.token_ids(s)], s
    for s in m.seq_ids():
        m.free(s)
    assert m.num_used_blocks == 0 and not m.table.requests
    cache.close()
    assert not m.table.mappings() and m.table.num_free_pages == m.table.num_physical_pages


def test_forks_copy_only_used_rows_and_keep_a_freed_parent():
    m, cache = small_manager(num_blocks=12, slots=4, block_size=2)
    m.allocate("p", [1, 2, 3])                      # 2 pages of 2 tokens
    k = cache.k[0]
    k.view(-1, *k.shape[2:])[torch.tensor(m.slot_mapping("p"))] = 1.0
    m.fork("p", "c")
    assert "c" in m and m.num_used_blocks == 2      # the child holds nothing until it appends
    m.free("p")                                    # the parent's slot waits for the copy
    assert m.num_used_blocks == 2 and len(m.table.requests) == 1
    m.append_slots(["c"], [[4]])
    assert m.num_used_blocks == 2 and len(m.table.requests) == 1   # parent released after the copy
    assert k[m.block_table("c")[0], :3].eq(1.0).all()
    assert m.fork_copied_tokens == 3


def test_out_of_slots_and_pages_change_nothing():
    m, _ = small_manager(num_blocks=6, slots=2, block_size=2, capacity_tokens=12)
    m.allocate("a", [1] * 5)                         # 3 pages
    m.allocate("b", [1] * 2)                         # 1 page
    with pytest.raises(vm.OutOfSlots):
        m.allocate("c", [1])
    before = (m.num_used_blocks, m.table.mappings(), m.token_ids("a"), m.token_ids("b"))
    with pytest.raises(OutOfBlocks):                 # a: +1 page, b: +2 pages > 2 available
        m.append_slots(["a", "b"], [[1, 1], [1, 1, 1, 1]])
    assert before == (m.num_used_blocks, m.table.mappings(), m.token_ids("a"), m.token_ids("b"))
    with pytest.raises(ValueError, match="more than a slot holds"):
        m.append_slots(["a"], [[1] * 8])


def test_impossible_configurations_say_why():
    with pytest.raises(ValueError, match="kv_cache must be"):
        EngineConfig(kv_cache="contiguous")
    with pytest.raises(ValueError, match="one process"):
        EngineConfig(kv_cache="virtual", tensor_parallel_size=2)
    from types import SimpleNamespace

    mla = SimpleNamespace(config=SimpleNamespace(is_mla=True))   # what build_kv_cache looks at first
    with pytest.raises(ValueError, match="MLA"):
        vm.build_kv_cache(mla, EngineConfig(kv_cache="virtual"), 8)


# --- GPU ---------------------------------------------------------------------------------------

def _vmm_ok() -> tuple[bool, str]:
    from minillm.vmm import driver as drv

    return drv.available()


gpu = pytest.mark.skipif(not _vmm_ok()[0], reason=f"needs CUDA and cuda-bindings: {_vmm_ok()[1]}")


def _teacher_forced(engine: LLMEngine, prompts, steps: int) -> list[list[int]]:
    """Greedy argmax of every step, feeding back fixed tokens (so one mode's near-tie cannot
    steer the other's sequence): prefill, then ``steps`` decode steps of all prompts."""
    from minillm.model.paged import PagedBatch

    m, runner, device = engine.manager, engine.runner, engine.device
    ids = list(range(len(prompts)))
    for i, p in zip(ids, prompts):
        m.allocate(i, p)
    out = [runner.forward(PagedBatch.from_manager(m, ids, [len(p) for p in prompts], device=device))
           .argmax(-1).tolist()]
    for step in range(steps):
        m.append_slots(ids, [(7 * step + 3 * i) % VOCAB for i in ids])
        out.append(runner.forward(PagedBatch.from_manager(m, ids, 1, device=device)).argmax(-1).tolist())
    for i in ids:
        m.free(i)
    return out


@gpu
@pytest.mark.parametrize("graphs", ["off", "all"])
def test_gpu_virtual_engine_matches_paged(graphs):
    from minillm.model import load_model
    from minillm.vmm import driver as drv

    model, _ = load_model(BUNDLED_MODEL, device="cuda", dtype="bfloat16")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 200, n).tolist() for n in (5, 37, 130, 300)]
    common = dict(device="cuda", max_num_seqs=8, max_n=4, max_num_batched_tokens=512, cuda_graphs=graphs,
                  gpu_memory_utilization=0.5, seed=0)
    got = {}
    free0 = None
    for mode in ("paged", "virtual"):
        engine = LLMEngine(model, TOKENIZER, EngineConfig(kv_cache=mode, **common))
        if graphs != "off":
            assert engine.runner.cuda_graphs
        got[mode] = _teacher_forced(engine, prompts, steps=24)
        if mode == "virtual":
            assert engine.manager.table.map_calls > 0
            # the engine itself, end to end: greedy, n > 1 and beams, every block freed
            params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                      SamplingParams(temperature=0.7, n=3, max_tokens=12, seed=1, ignore_eos=True),
                      SamplingParams(num_beams=3, max_tokens=8)]
            outs = run(engine, ["ROMEO:\n", "JULIET:\nO Romeo", "First Citizen:\n"], params)
            assert all(len(o.outputs[0].token_ids) > 0 for o in outs)
            torch.cuda.synchronize()
            free0 = drv.mem_info()[0]
            mapped = engine.manager.table.mapped_bytes()
            engine.cache.close()
            assert not engine.manager.table.mappings()
            del engine
            gc.collect()
            torch.cuda.synchronize()
            assert drv.mem_info()[0] >= free0 + mapped - (64 << 20)   # the mapped pages came back
        else:
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    assert got["virtual"] == got["paged"]


# --- the benchmark's engine part, on the CPU -----------------------------------------------------

def test_bench_engine_part_on_cpu(tmp_path, monkeypatch):
    """`bench.ch11_virtual_memory.engine_part` with a tiny model on the simulated allocator: the
    rows are written, both modes produce every token, and the mapping counters add up."""
    from bench import ch11_virtual_memory as b
    from bench.common import Results
    from minillm.experiments.ch09_engine_benchmark import bench_engine_config

    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    results = Results("cpu", env={})
    shape = {"preset": "llama-tiny", "dtype": "float32", "concurrency": 4, "prompt_len": (4, 24),
             "output_len": (2, 12), "engine": bench_engine_config(4, device="cpu", cuda_graphs="off", block_size=8)}
    got = b.engine_part(results, "cpu", num_requests=6, repeats=1, workload_shape=shape)
    assert set(got) == {"paged", "virtual"}
    v = got["virtual"]
    assert v["map_calls_warmup"] > 0 and v["map_calls"] >= 0 and v["kv_mapped_bytes"] >= v["kv_used_bytes"] > 0
    assert v["slot_tokens"] % 8 == 0 and v["page_bytes"] == 8 * 2 * 32 * 4   # 8 tokens of 2 KV heads of 32, fp32
    rows = {(r["params"]["mode"], r["metric"]): r for r in results.rows if r["benchmark"] == b.BENCHMARK}
    assert rows["virtual", "output_tokens_per_s"]["peer"] == "paged"
    assert rows["virtual", "output_tokens_per_s"]["ratio"] > 0
    assert {b.row_part(r) for r in results.rows} == {"engine"}
    assert b.selected_parts("engine") == ("engine",) and b.selected_parts("") == b.PARTS
    with pytest.raises(ValueError, match="unknown parts"):
        b.selected_parts("engine,nope")
