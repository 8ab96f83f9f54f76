"""Chapter 11 on the GPU: the virtual-memory KV cache through CUDA's VMM API (minillm.vmm).

Skipped without a CUDA device or without NVIDIA's driver bindings (``pip install
cuda-bindings``). What is checked: the granularity; a page mapped and unmapped by hand;
a cache that grows page by page while a torch tensor over it sees every write; release and
reuse (deferred and eager reclamation); unmodified contiguous kernels (Chapter 4's
FlashAttention-2, Chapter 7's decode kernel with a one-block table) reading it; and that
nothing leaks (``cuMemGetInfo`` before and after)."""
from __future__ import annotations

import gc

import pytest
import torch

from minillm.vmm import driver as drv

ok, why = drv.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"needs CUDA and cuda-bindings: {why}")

MiB = 1 << 20


@pytest.fixture
def dev():
    torch.cuda.synchronize()
    drv.ensure_context(torch.cuda.current_device())
    device = torch.device("cuda", torch.cuda.current_device())
    # CUDA loads a kernel's code into device memory at its first launch: launch the ones the
    # tests use now, so the free-memory balances below count only what the cache maps.
    torch.full((64,), 3.0, device=device)[:10].sum().item()
    return device


def _free_bytes() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # torch's own cached segments are not ours to count
    return drv.mem_info()[0]


def test_granularity_and_one_page_by_hand(dev):
    from minillm.vmm.dlpack import as_tensor

    prop, descs = drv.allocation_prop(dev.index), drv.access_descs(dev.index)
    page = drv.granularity(prop)
    assert page >= 64 * 1024 and page & (page - 1) == 0
    assert drv.granularity(prop, recommended=True) % page == 0
    free0 = _free_bytes()
    base = drv.reserve(4 * page, page)
    handle = drv.create(page, prop)
    drv.map_page(base + page, page, handle, descs)          # only the second page is backed
    t = as_tensor(base + page, (page // 4,), (1,), torch.float32, dev, None)
    t.fill_(3.0)
    assert float(t.sum()) == 3.0 * (page // 4)
    del t
    torch.cuda.synchronize()
    drv.unmap(base + page, page)
    drv.map_page(base, page, handle, descs)                 # the same physical page, elsewhere
    t = as_tensor(base, (page // 4,), (1,), torch.float32, dev, None)
    assert float(t[:10].sum()) == 30.0                      # its content moved with it
    del t
    torch.cuda.synchronize()
    drv.unmap(base, page)
    drv.release(handle)
    drv.free_range(base, 4 * page)
    assert abs(_free_bytes() - free0) < 4 * MiB


def test_cache_grows_and_the_tensor_sees_writes(dev):
    from minillm.vmm import VirtualKVCache

    free0 = _free_bytes()
    with VirtualKVCache(2, 8, 128, 3, 4096, dtype=torch.bfloat16, device=dev) as cache:
        page, bpt = cache.page_bytes, 8 * 128 * 2
        tokens_per_page = page // bpt                      # 1024 with 2 MB pages
        assert cache.k[0].shape == (3, 4096, 8, 128) and cache.k[1].stride(1) == 8 * 128
        slot = cache.admit("a", 1)
        assert cache.table.map_calls == 4                  # one page in each of K0, V0, K1, V1
        assert cache.physical_bytes() == 4 * page
        k = cache.k[1][slot]
        k[:1].fill_(1.5)
        made = cache.grow("a", tokens_per_page + 5)
        assert made == 4
        x = torch.randn(tokens_per_page + 5, 8, 128, device=dev, dtype=torch.bfloat16)
        k[: tokens_per_page + 5].copy_(x)                  # writes across the page boundary
        assert torch.equal(cache.k[1][slot, : tokens_per_page + 5], x)
        assert cache.table.mapped_bytes() == 8 * page
        assert all(t > 0 for t in cache.map_seconds)
        del k, x
    assert abs(_free_bytes() - free0) < 8 * MiB, "pages or ranges leaked"


@pytest.mark.parametrize("policy", ["deferred", "eager"])
def test_release_and_reuse(dev, policy):
    from minillm.vmm import VirtualKVCache

    free0 = _free_bytes()
    cache = VirtualKVCache(1, 8, 128, 2, 4096, device=dev, reclamation=policy)
    try:
        s_a = cache.admit("a", 3000)                       # 3 pages per tensor
        cache.k[0][s_a, :3000].fill_(2.0)
        maps = cache.table.map_calls
        cache.release("a")
        s_b = cache.admit("b", 2000)
        if policy == "deferred":                           # same slot, no new mapping, old pages retained
            assert s_b == s_a and cache.table.map_calls == maps and cache.table.unmap_calls == 0
            assert float(cache.k[0][s_b, :2000].float().mean()) == 2.0  # the old content is still there
        else:
            assert cache.table.unmap_calls == 6
            assert cache.physical_bytes() == 6 * cache.page_bytes       # physical pages pooled, mapped again
        cache.v[0][s_b, :2000].fill_(-1.0)
        assert float(cache.v[0][s_b, :2000].float().sum()) == -2000.0 * 8 * 128
        cache.release("b")
    finally:
        cache.close()
    assert cache.table.mapped_bytes() == 0
    assert abs(_free_bytes() - free0) < 8 * MiB, "pages or ranges leaked"


def test_contiguous_kernels_run_on_the_virtual_cache(dev):
    import torch.nn.functional as F

    from minillm.kernels.ch04_flash_attention import flash_attention
    from minillm.kernels.ch05_paged_attention import contiguous_as_paged
    from minillm.kernels.ch07_flash_decoding import flash_decode_attention
    from minillm.vmm import VirtualKVCache

    B, L, Hq, Hkv, D = 2, 1500, 8, 2, 64
    g = torch.Generator(device=dev).manual_seed(0)
    with VirtualKVCache(1, Hkv, D, B, 4096, dtype=torch.float16, device=dev) as cache:
        k, v = cache.layer(0)
        for b in range(B):
            cache.admit(b, L)
        kx = torch.randn(B, L, Hkv, D, device=dev, dtype=torch.float16, generator=g)
        vx = torch.randn(B, L, Hkv, D, device=dev, dtype=torch.float16, generator=g)
        k[:, :L].copy_(kx)
        v[:, :L].copy_(vx)
        # prefill: FA2 on [B, Hkv, L, D] views of the virtual tensors
        q = torch.randn(B, Hq, L, D, device=dev, dtype=torch.float16, generator=g)
        out = flash_attention(q, k[:, :L].transpose(1, 2), v[:, :L].transpose(1, 2), causal=True)
        ref = F.scaled_dot_product_attention(q, kx.transpose(1, 2), vx.transpose(1, 2), is_causal=True,
                                             enable_gqa=True)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
        # decode: Chapter 7's kernel, one block per sequence
        qd = torch.randn(B, Hq, D, device=dev, dtype=torch.float16, generator=g)
        kp, table = contiguous_as_paged(k)
        vp, _ = contiguous_as_paged(v)
        lens = torch.tensor([L, L - 700], dtype=torch.int32, device=dev)
        od, _ = flash_decode_attention(qd, kp, vp, table, lens)
        for b in range(B):
            n = int(lens[b])
            r = F.scaled_dot_product_attention(qd[b:b + 1, :, None], kx[b:b + 1, :n].transpose(1, 2),
                                               vx[b:b + 1, :n].transpose(1, 2), enable_gqa=True)[:, :, 0]
            torch.testing.assert_close(od[b:b + 1], r, atol=2e-3, rtol=2e-3)
        torch.cuda.synchronize()


def test_mapping_latency_measurement(dev):
    from bench.ch11_virtual_memory import mapping_latency
    from bench.common import Results

    res = Results("test-gpu", env={})
    free0 = _free_bytes()
    out = mapping_latency(res, dev, pages=8)
    assert set(out) == {"create_us", "map_us", "unmap_us"} and all(v > 0 for v in out.values())
    assert abs(_free_bytes() - free0) < 4 * MiB
