"""Chapter 11 on the CPU: the page table of the virtual-memory KV cache, the reference
arithmetic, the cost formulas, the simulations (waste, reclamation, overlap, GMLake's
stitching) and the DLPack export. The GPU side is tests/test_ch11_vmm_gpu.py."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import costs
from minillm.experiments import ch11_virtual_memory as ex
from minillm.experiments.ch05_fragmentation import Requests, paged_waste
from minillm.reference import ch11_virtual_memory as ref
from minillm.vmm import dlpack
from minillm.vmm.pagetable import Geometry, OutOfPages, PageTable, pages_for


# ----------------------------------------------------------------------- costs and reference
def test_cost_formulas():
    assert costs.vmm_bytes_per_token_layer(8, 128, 2) == 2048
    assert costs.vmm_bytes_per_token_layer(8, 128, 2) * 2 == costs.gqa_kv_bytes_per_token(8, 128, 2)
    assert costs.vmm_tokens_per_page(8, 128, 2 << 20) == 1024
    assert costs.vmm_tokens_per_page(1, 128, 2 << 20) == 8192
    assert costs.vmm_pages_needed(0, 8, 128, 2 << 20) == 0
    assert costs.vmm_pages_needed(1, 8, 128, 2 << 20, layers=32) == 64
    assert costs.vmm_pages_needed(1024, 8, 128, 2 << 20) == 2
    assert costs.vmm_pages_needed(1025, 8, 128, 2 << 20, layers=2) == 8
    assert "vmm_pages_needed" in costs.__all__


@given(tokens=st.integers(0, 10_000), bpt=st.integers(1, 5000), page=st.integers(1, 1 << 16))
def test_reference_pages_and_waste(tokens, bpt, page):
    n = int(ref.pages_needed(tokens, bpt, page))
    assert n == pages_for(tokens, bpt, page)
    assert n * page >= tokens * bpt and (n == 0 or (n - 1) * page < tokens * bpt)
    w = int(ref.mapped_waste_bytes(tokens, bpt, page))
    assert 0 <= w < page
    assert int(ref.pages_to_map(tokens, tokens + 1, bpt, page)) in range(0, -(-bpt // page) + 2)


def test_reference_translate():
    page, bpt, max_len = 64, 24, 10  # 240 bytes per slot -> 4 pages
    sb = ref.slot_bytes(max_len, bpt, page)
    assert sb == 256
    table = np.array([7, 3, -1, -1, 0, 5, 1, -1])  # slot 0 has pages 0-1, slot 1 has pages 0-2
    offs = ref.token_offsets([0, 0, 1, 1], [0, 5, 0, 9], sb, bpt)
    assert offs.tolist() == [0, 120, 256, 256 + 216]
    assert ref.translate(offs[:3], table, page).tolist() == [7 * 64, 3 * 64 + 56, 0]
    with pytest.raises(ValueError, match="unmapped"):
        ref.translate(offs[3:], table, page)  # token 9 of slot 1 is in its page 3, unmapped


# ----------------------------------------------------------------------- the page table
def _geometry(tensors=2, slots=3, bpt=48, page=128, max_len=20):
    return Geometry(tensors, slots, bpt, page, max_len)


class _Recorder:
    def __init__(self):
        self.live: dict[tuple[int, int, int], int] = {}

    def map(self, tensor, slot, page, phys):
        key = (tensor, slot, page)
        assert key not in self.live, "virtual page mapped twice"
        assert phys not in self.live.values(), "physical page behind two virtual pages"
        self.live[key] = phys

    def unmap(self, tensor, slot, page, phys):
        assert self.live.pop((tensor, slot, page)) == phys


def _invariants(table: PageTable, rec: _Recorder):
    g = table.geometry
    assert table.mappings() == rec.live
    assert table.mapped_bytes() >= table.used_bytes()
    assert 0 <= table.waste_bytes() <= len(table.requests) * g.num_tensors * (g.page_bytes - 1)
    if table.reclamation == "eager":
        assert table.retained_bytes() == 0
    assert len(rec.live) + table.num_free_pages == table.num_physical_pages
    for req in table.requests:  # every active request's tokens are backed
        s = table.slot(req)
        assert table.mapped_pages[s] >= g.pages_for(table.tokens[s])
        for t in range(g.num_tensors):
            for p in range(table.mapped_pages[s]):
                assert table.physical(t, s, p) is not None


_ops = st.lists(st.tuples(st.sampled_from(["admit", "grow", "release"]), st.integers(0, 5), st.integers(0, 20)),
                max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=_ops, policy=st.sampled_from(["eager", "deferred"]), pool=st.integers(2, 40),
       tensors=st.integers(1, 4), bpt=st.integers(1, 100), page=st.sampled_from([16, 64, 128, 256]))
def test_page_table_invariants(ops, policy, pool, tensors, bpt, page):
    g = _geometry(tensors=tensors, bpt=bpt, page=page)
    rec = _Recorder()
    table = PageTable(g, pool, policy, rec)
    for op, req, tokens in ops:
        try:
            if op == "admit" and req not in table.requests:
                table.admit(req, tokens)
            elif op == "grow" and req in table.requests:
                table.grow(req, max(tokens, table.tokens[table.slot(req)]))
            elif op == "release" and req in table.requests:
                before = table.map_calls
                table.release(req)
                assert table.map_calls == before
        except OutOfPages:
            pass
        _invariants(table, rec)
    table.close()
    assert rec.live == {} and table.mapped_bytes() == 0 and table.num_free_pages == pool
    assert table.map_calls == table.unmap_calls


def test_deferred_reclamation_reuses_pages_without_mapping():
    g = _geometry(tensors=2, slots=2, bpt=32, page=64, max_len=40)  # 2 tokens a page
    for policy, expect_maps in (("eager", 2 * 5 + 2 * 3), ("deferred", 2 * 5)):
        table = PageTable(g, 100, policy)
        table.admit("a", 10)          # 5 pages per tensor
        table.release("a")
        slot = table.admit("b", 6)    # 3 pages: deferred reuses a's slot and maps nothing
        assert table.map_calls == expect_maps, policy
        if policy == "deferred":
            assert slot == 0 and table.retained_bytes() == 2 * 2 * 64
        table.close()


def test_reclaim_from_idle_slots_when_the_pool_is_empty():
    g = _geometry(tensors=1, slots=2, bpt=64, page=64, max_len=10)
    table = PageTable(g, 6, "deferred")
    table.admit("a", 6)
    table.release("a")  # slot 0 keeps 6 pages; the pool is empty
    assert table.num_free_pages == 0
    table.admit("b", 0)
    assert table.slot("b") == 1  # the empty slot: no retained page is enough for 0 tokens... any fits
    table.grow("b", 4)           # must reclaim 4 of slot 0's pages
    assert table.mapped_pages == [2, 4] and table.unmap_calls == 4
    with pytest.raises(OutOfPages):
        table.grow("b", 9)       # 9 pages > the pool of 6
    table.close()


# ----------------------------------------------------------------------- the simulations
def test_virtual_waste_equals_paged_waste_at_the_same_granularity():
    r = ex.SHAREGPT_LIKE.sample(300, seed=1)
    m = ex.LLAMA3_8B_KV  # 2 KiB per token and tensor
    for page, block in ((32 * ex.KiB, 16), (64 * ex.KiB, 32), (2 * ex.MiB, 1024)):
        for when in ("lifetime", "final"):
            assert ex.virtual_waste(r, m, page, when=when) == pytest.approx(paged_waste(r, block, when=when))
    curves = ex.waste_curves(r, m)
    assert curves["virtual"] == sorted(curves["virtual"])  # bigger pages waste more
    assert curves["tokens_per_page"][-1] == 1024 and curves["block_bytes"] == [32768, 65536]


@pytest.mark.parametrize("policy", ["eager", "deferred"])
@pytest.mark.parametrize("lookahead", [0, 1])
def test_serving_simulation(policy, lookahead):
    r = Requests.of([30, 5, 50, 12, 7, 64] * 4, [10, 40, 3, 25, 60, 8] * 4, 128)
    m = ex.KVModel("tiny", 2, 2, 16, 2)  # 64 bytes per token and tensor
    tr = ex.simulate_virtual_serving(r, m, 512, 512 * 60, 6, reclamation=policy, lookahead=lookahead, check=True)
    assert tr.running.max() <= 6 and (tr.mapped >= tr.used).all()
    assert tr.used.sum() == sum(sum(range(p, p + o)) for p, o in zip(r.prompt_lens, r.output_lens)) * 64 * 4
    assert tr.map_calls.sum() >= tr.unmap_calls.sum()
    if policy == "eager" and lookahead == 0:
        assert tr.retained.sum() == 0
        assert tr.waste == pytest.approx(tr.waste_excluding_retained)


def test_deferred_reclamation_saves_mapping_calls():
    r = ex.ALPACA_LIKE.sample(200, seed=0)
    m = ex.LLAMA3_8B_KV
    eager = ex.simulate_virtual_serving(r, m, 64 * ex.KiB, 4 << 30, 32, reclamation="eager")
    deferred = ex.simulate_virtual_serving(r, m, 64 * ex.KiB, 4 << 30, 32, reclamation="deferred")
    assert deferred.map_calls.sum() < eager.map_calls.sum() and deferred.unmap_calls.sum() < eager.unmap_calls.sum()
    assert deferred.used.sum() == eager.used.sum()


def test_mapping_overhead_model():
    calls = np.array([0, 10, 0, 100, 3])
    sync = ex.mapping_overhead(calls, 1e-5, 1e-3, ahead=False)
    hidden = ex.mapping_overhead(calls, 1e-5, 1e-3, ahead=True)
    assert sync["added_s"] == pytest.approx(113e-5) and sync["steps_delayed"] == 3
    assert hidden["added_s"] == pytest.approx(0.0) and hidden["steps_delayed"] == 0
    slow = ex.mapping_overhead(calls, 1e-4, 1e-3, ahead=True)  # 100 calls = 10 ms > a 1 ms step
    assert slow["added_s"] == pytest.approx(9e-3) and slow["steps_delayed"] == 1


def test_stitching_never_reserves_more_than_the_live_peak():
    for seed in range(3):
        t = ex.random_allocation_trace(400, seed=seed)
        plain = ex.replay_allocations(t, stitching=False)
        stitched = ex.replay_allocations(t, stitching=True)
        assert stitched["peak_reserved_pages"] == t.peak_live_pages() == stitched["peak_live_pages"]
        assert plain["peak_reserved_pages"] >= stitched["peak_reserved_pages"]
        assert stitched["fragmentation"] == 0.0
    # a hole in the middle: 4 free pages in two runs of 2 serve an allocation of 4 only by stitching
    t = ex.AllocationTrace(((0, 2), (1, 2), (2, 2), (3, 2), (0, 0), (2, 0), (4, 4)))
    assert ex.replay_allocations(t, stitching=True)["peak_reserved_pages"] == 8
    assert ex.replay_allocations(t, stitching=True)["stitched"] == 1
    assert ex.replay_allocations(t, stitching=False)["peak_reserved_pages"] == 12


# ----------------------------------------------------------------------- DLPack and imports
def test_dlpack_export_shares_memory_and_keeps_the_owner_alive():
    owner = torch.arange(2 * 3 * 8, dtype=torch.bfloat16)
    n0 = dlpack.live_exports()
    t = dlpack.as_tensor(owner.data_ptr(), (2, 3, 4), (12, 4, 1), torch.bfloat16, "cpu", owner)
    assert t.dtype == torch.bfloat16 and t.stride() == (12, 4, 1)
    assert torch.equal(t[1, 2], owner[20:24])
    t[0, 0, 0] = 42
    assert owner[0] == 42
    del owner
    gc.collect()
    view = t[1]
    del t
    gc.collect()
    assert dlpack.live_exports() == n0 + 1 and view.float().sum() > 0
    del view
    gc.collect()
    assert dlpack.live_exports() == n0


def test_vmm_imports_on_cpu_and_explains():
    import minillm.vmm as vmm

    ok, why = vmm.available()
    if not torch.cuda.is_available():
        assert not ok and why
        with pytest.raises(RuntimeError, match="cuda-bindings"):
            vmm.VirtualKVCache(1, 8, 128, 2, 4096)


def test_bench_imports_and_is_registered():
    from bench import ch11_virtual_memory as b
    from bench.run import BENCHMARKS

    assert ("ch11_virtual_memory", "bench.ch11_virtual_memory") in BENCHMARKS
    assert callable(b.run)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU stand-in; on a GPU the benchmark itself runs")
def test_bench_bookkeeping_on_cpu(monkeypatch):
    """The benchmark's sweep on the CPU (kernels in Triton's interpreter, tiny shapes), with a
    stand-in cache of ordinary memory and a stand-in timer: every row it records, and that
    the kernels on the "virtual" cache agree with the paged ones."""
    import minillm.vmm
    from bench import ch11_virtual_memory as b
    from bench.common import Results

    class FakeCache:
        def __init__(self, layers, kv_heads, head_dim, max_batch, max_len, *, dtype, device, **kw):
            self.page_bytes = 256
            g = Geometry(2 * layers, max_batch, kv_heads * head_dim * dtype.itemsize, self.page_bytes, max_len)
            self.table = PageTable(g, g.num_tensors * max_batch * g.pages_per_slot)
            self.k = [torch.zeros(max_batch, max_len, kv_heads, head_dim, dtype=dtype) for _ in range(layers)]
            self.v = [torch.zeros_like(t) for t in self.k]

        def admit(self, req, tokens=0):
            return self.table.admit(req, tokens)

        def grow(self, req, tokens, ahead=0):
            return self.table.grow(req, tokens, ahead)

        def close(self):
            self.table.close()

    monkeypatch.setattr(minillm.vmm, "VirtualKVCache", FakeCache)
    monkeypatch.setattr(b, "mapping_latency", lambda results, device: None)
    monkeypatch.setattr(b, "page_bytes", lambda device: 256)
    monkeypatch.setattr(b, "STEPS", 4)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    res = Results("cpu-test", {"copy_TBps": 1.0, "bf16_matmul_TFLOPs": 1.0}, env={})
    b.sweep(res, torch.device("cpu"), batches=(2,), contexts=(32,), q_heads=4, kv_heads=2, head_dim=16,
            block_size=8, dtype=torch.float32, timer=lambda fn: 1.0)
    rows = {(r["params"]["kind"], r["metric"], r["peer"]): r for r in res.rows}
    assert {peer for kind, m, peer in rows if kind == "decode" and m == "time_ms"} == {
        "paged_flash_decoding", "paged_ch05", "sdpa_virtual", "torch_memory", "pointer_loads", "tma_loads"}
    assert rows[("decode", "rel_err", "paged_ch05")]["ours"] < 1e-4
    assert rows[("prefill", "rel_err", None)]["ours"] < 1e-4
    assert rows[("memory", "wasted_bytes", "paged_blocks")]["peer_value"] == 0
    assert rows[("host", "host_step_us", "paged_block_table")]["ours"] > 0
