"""Chapter 11 benchmark: unmodified contiguous kernels on a KV cache in virtual memory, against
the paged kernels of Chapters 5 and 7 on the same tokens.

The cache is `minillm.vmm.VirtualKVCache` (one layer's K and V; 2 MB pages mapped through
``cuMemMap``; each request a contiguous ``[L, kv_heads, head_dim]`` stretch of a
``[B, capacity, kv_heads, head_dim]`` virtual tensor, ``capacity`` = L + ``STEPS`` tokens
rounded up to whole pages, as the engine's slots). Shapes: bf16, 32 query heads, 8 KV
heads of 128 (Llama-3-8B), batch 1, 8, 32, context L = 4k, 32k (every sequence at L). The
paged peers read the same tokens from a pool of blocks of 16 in shuffled order
(`bench.common.paged_cache`).

- **decode** (one query per sequence). Ours: Chapter 7's `flash_decode_attention` on the
  virtual cache seen as a pool with *one block per sequence* (`contiguous_as_paged`: block
  size ``capacity``, table ``[[0], [1], …]``): with a single block, its table lookup is one
  load per sequence and every tile is a contiguous run of rows, which is exactly a contiguous
  split-K decode kernel (FA2 with ``q_len = 1`` would also run, but reads K and V once per
  *query* head: 4x the bytes under GQA 4:1). Peers: the same kernel on the paged pool
  (``paged_flash_decoding``), Chapter 5's `paged_decode_attention` on the pool
  (``paged_ch05``), SDPA (PyTorch's backend choice) on the virtual cache (``sdpa_virtual``),
  and Chapter 7's kernel on an ordinary ``torch.empty`` copy of the cache (``torch_memory``:
  whether mapped memory reads as fast as the caching allocator's); and ours with each way of
  loading a tile forced (Chapter 7's stage-1 switches): pointer loads (``pointer_loads``) and
  bulk TMA copies of whole tiles (``tma_loads``; sm_90 only, pointer loads elsewhere).
- **prefill** (the whole prompt, causal). Ours: Chapter 4's `flash_attention` on the virtual
  cache (K/V views ``[B, kv_heads, L, head_dim]`` with the cache's strides). Peers:
  Chapter 5's `paged_prefill_attention` on the pool (``paged_prefill``), and
  `flash_attention` on the ``torch.empty`` copy (``torch_memory``). Points with ``B · L``
  above ``MAX_PREFILL_TOKENS`` are skipped (a note says so).
- **memory**: mapped bytes of the virtual cache against the pool's allocated blocks, and the
  bytes of each that hold no token.
- **host work per step**: ``STEPS`` decode steps of every sequence from L: the virtual cache's
  `grow` for each sequence (mapping a page for K and for V when a sequence crosses a 2 MB
  boundary) against the paged `BlockManager`'s ``append_slots`` plus the padded block table
  copied to the GPU (what an engine does per step). One layer: a model of N layers maps N
  times as many pages (the block table does not grow with layers).
- **mapping latency**: host time of ``cuMemCreate``, ``cuMemMap`` + ``cuMemSetAccess`` and
  ``cuMemUnmap`` of one page (2 MB), medians over ``MAP_PAGES`` pages.

Rows (``params``: kind, batch, context, q_heads, kv_heads, head_dim, dtype, page_bytes, block_size):

======================  =====================================================================
``time_ms``             median over 3 interleaved rounds (`bench.common.interleaved_times`) of the
                        median ``triton.testing.do_bench`` time (cold L2), one row per peer
``TFLOPs``              prefill: `minillm.costs.attention_head_flops` · q_heads · B / time
``bandwidth_TBps``      decode: `minillm.costs.decode_attention_bytes` / time, fraction of copy
``graph_time_ms``       decode: per call, replaying a CUDA graph of `GRAPH_REPEATS` calls that take
                        turns over copies of the caches (`l2_copies`), as an engine's decode step
                        runs; ours with its default loads (inside a capture: bulk copies on sm_90),
                        peers ``paged_flash_decoding`` and ``pointer_loads``
``rel_err``             ours against ``paged_flash_decoding`` / ``paged_prefill`` (fp32 norms)
``mapped_bytes``        physical bytes behind the cache; ``wasted_bytes``: of which no token
``host_step_us``        host time per decode step (median over ``STEPS`` steps)
``create_us``, ``map_us``, ``unmap_us``   one 2 MB page, median (kind "mapping")
======================  =====================================================================

- **engine** (kind ``engine``): the engine of Chapter 9 on its own workload
  (`bench.ch09_engine`: the random-weight ``llama-280m`` in bf16, prompts and outputs of
  32-512 tokens, 64 requests at once, CUDA graphs for every step), once with
  ``kv_cache="paged"`` and once with ``kv_cache="virtual"`` (`minillm.vmm.manager`), both
  alive in this process over one copy of the weights. Each engine first runs the warm-up
  workload of Chapter 9 (compiles, captures, and in virtual mode maps the pages of the slots
  it uses); then the two take turns at ``ENGINE_REPEATS`` timed runs each of
  ``ENGINE_REQUESTS`` requests, a new workload (seed) each round, the same for both modes.
  The paged engine keeps Chapter 9's settings (prefix caching on: random prompts share
  nothing, and no round repeats an earlier one's prompts); the virtual one has no prefix cache.

Rows of the engine part (``params``: kind "engine", mode, model, dtype, num_requests,
concurrency, prompt_len, output_len, max_num_batched_tokens, repeats; virtual rows add
page_bytes and slot_tokens):

==========================  ===================================================================
``output_tokens_per_s``     median of the timed runs; mode virtual: ours, peer ``paged`` (ratio =
                            virtual / paged); mode paged: the paged engine alone
``decode_step_ms``          median wall time of a full (64-sequence) pure-decode step, as above
``elapsed_s``, ``steps``    of the timed runs (mean), as above
``prompt_steps_s``          wall time of the steps that computed prompt tokens (mean per run);
                            ``decode_steps_s`` of the others, as above
``map_calls``               (tensor, page) mappings during the timed runs (mean per run);
                            ``map_calls_per_step`` the same per engine step;
                            ``map_calls_warmup`` during the warm-up run; ``map_ms`` host time
                            of the timed runs' ``cuMemMap`` + ``cuMemSetAccess`` (mean per run)
``kv_mapped_bytes``         after the timed runs: bytes of mapped pages (virtual; nothing is
                            unmapped under deferred reclamation unless the pool runs short)
                            against the paged pool's peak blocks in use (peer ``paged``)
``kv_used_bytes``           the most bytes the live sequences' tokens held in one step
==========================  ===================================================================

Imports without a GPU; `run` needs CUDA and ``cuda-bindings``. Stops starting kernel points
after ``MINILLM_CH11_BUDGET_S`` seconds (default 240). ``MINILLM_CH11_PARTS`` (``kernels``,
``engine``; comma-separated, default both) runs only some parts; the saved file then keeps the
earlier rows of the others. ``MINILLM_CH11_ENGINE_REQUESTS`` sets ``ENGINE_REQUESTS``.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

import torch

from minillm.costs import attention_head_flops, decode_attention_bytes
from minillm.kernels.base import l2_copies
from minillm.kernels.ch04_flash_attention import flash_attention
from minillm.kernels.ch05_paged_attention import contiguous_as_paged, paged_decode_attention, paged_prefill_attention
from minillm.kernels.ch07_flash_decoding import flash_decode_attention

from bench.common import (
    Results, attempt, cuda_device, dtype_name, fraction, free_memory, paged_cache, rel_err, sequence_kv, sweep_start,
    graph_time_ms, interleaved_times, time_sdpa,
)

BENCHMARK = "ch11_virtual_memory"
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 32768)
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
MAX_PREFILL_TOKENS = 262_144
STEPS = 64
MAP_PAGES = 256
#: Calls captured per CUDA graph by the ``graph_time_ms`` rows (their times are per call).
GRAPH_REPEATS = 20
#: The graph rows take turns over this many copies of the caches at most: enough that together
#: they outsize the L2 twice, so that a replay reads K and V from HBM as a model's decode step
#: (whose other layers evict them) does.
GRAPH_MAX_COPIES = 4
SEED = 11
WARMUP_MS, REP_MS = 25, 100


def budget_s() -> float:
    """Seconds after which no new point is started: ``MINILLM_CH11_BUDGET_S`` (default 240)."""
    return float(os.environ.get("MINILLM_CH11_BUDGET_S", "240"))


#: The parts in run order (`run`); ``MINILLM_CH11_PARTS`` selects some.
PARTS = ("kernels", "engine")
ENGINE_REQUESTS = int(os.environ.get("MINILLM_CH11_ENGINE_REQUESTS", 128))
#: Timed runs per mode. One run of 128 requests takes 1-2 s on an H100 and single runs of the
#: same engine spread by up to 20 % (host time: 26.0k and 21.6k tok/s in one run of this
#: benchmark), so the rows take the median of several.
ENGINE_REPEATS = 6
#: The engine part's modes, in the order their timed runs take turns.
ENGINE_MODES = ("paged", "virtual")


def selected_parts(spec: str | None = None) -> tuple[str, ...]:
    """The parts ``MINILLM_CH11_PARTS`` (or ``spec``) names, in run order; all when empty."""
    spec = os.environ.get("MINILLM_CH11_PARTS", "") if spec is None else spec
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        raise ValueError(f"MINILLM_CH11_PARTS: unknown parts {unknown}; the parts are {list(PARTS)}")
    return tuple(p for p in PARTS if p in names) if names else PARTS


def row_part(row: dict) -> str:
    """The part that wrote a row of this benchmark."""
    return "engine" if (row.get("params") or {}).get("kind") == "engine" else "kernels"


def run(results: Results, device) -> None:
    """The selected parts on ``device`` (CUDA, with ``cuda-bindings``)."""
    from minillm.vmm import MISSING, available

    device = cuda_device(device, "the Chapter 11 benchmark")
    ok, why = available()
    if not ok:
        raise RuntimeError(f"the Chapter 11 benchmark cannot run here ({why}). {MISSING}")
    parts = selected_parts()
    if set(parts) != set(PARTS):
        results.keep_previous(BENCHMARK, lambda row: row_part(row) not in parts,
                              why=f"MINILLM_CH11_PARTS={','.join(parts)}: the other parts' rows")
        print(f"  [{BENCHMARK}] parts {list(parts)}; the others keep their earlier rows", flush=True)
    if "kernels" in parts:
        sweep(results, device)
    if "engine" in parts:
        free_memory()
        engine_part(results, device)


def sweep(results: Results, device, batches=BATCHES, contexts=CONTEXTS, q_heads: int = Q_HEADS,
          kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, block_size: int = BLOCK_SIZE,
          dtype: torch.dtype = DTYPE, timer: Callable[[Callable[[], Any]], float] | None = None) -> None:
    timer, gen, out_of_time = sweep_start(results, BENCHMARK, device, budget_s(), timer, WARMUP_MS, REP_MS)
    t0 = time.perf_counter()
    mapping_latency(results, device)
    print(f"  [{BENCHMARK}] mapping latency: {time.perf_counter() - t0:.1f} s", flush=True)
    ceilings = results.ceilings or {}
    for context in contexts:
        for batch in batches:
            if out_of_time():
                return
            t0 = time.perf_counter()
            _point(results, device, gen, batch, context, q_heads, kv_heads, head_dim, block_size, dtype, ceilings,
                   timer)
            free_memory()
            print(f"  [{BENCHMARK}] batch={batch} L={context}: {time.perf_counter() - t0:.1f} s", flush=True)


def mapping_latency(results: Results, device, pages: int = MAP_PAGES) -> dict[str, float]:
    """Median host microseconds of cuMemCreate, cuMemMap + cuMemSetAccess, and cuMemUnmap
    of one page (the granularity), over ``pages`` pages of one reserved range."""
    from minillm.vmm import driver as drv

    index = device.index if device.index is not None else torch.cuda.current_device()
    drv.ensure_context(index)
    prop, descs = drv.allocation_prop(index), drv.access_descs(index)
    page = drv.granularity(prop)
    free0, _ = drv.mem_info()
    base = drv.reserve(pages * page, page)
    create, mapping, unmapping, handles = [], [], [], []
    try:
        for i in range(pages):
            t = time.perf_counter()
            handles.append(drv.create(page, prop))
            create.append(time.perf_counter() - t)
        for i, h in enumerate(handles):
            t = time.perf_counter()
            drv.map_page(base + i * page, page, h, descs)
            mapping.append(time.perf_counter() - t)
        torch.cuda.synchronize(device)
        for i in range(pages):
            t = time.perf_counter()
            drv.unmap(base + i * page, page)
            unmapping.append(time.perf_counter() - t)
    finally:
        for h in handles:
            drv.release(h)
        drv.free_range(base, pages * page)
    out = {"create_us": statistics.median(create) * 1e6, "map_us": statistics.median(mapping) * 1e6,
           "unmap_us": statistics.median(unmapping) * 1e6}
    params = {"kind": "mapping", "page_bytes": page, "pages": pages}
    note = f"p90 map {sorted(mapping)[int(0.9 * len(mapping))] * 1e6:.1f} us; free memory before {free0 / 2**30:.1f} GiB"
    for metric, value in out.items():
        results.add(BENCHMARK, params, metric, value, note=note if metric == "map_us" else None)
    return out


def _point(results, device, gen, batch, context, q_heads, kv_heads, head_dim, block_size, dtype, ceilings, timer):
    from minillm.paged import BlockManager, padded_block_tables
    from minillm.vmm import VirtualKVCache
    from minillm.vmm.manager import slot_capacity

    base = {"batch": batch, "context": context, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": dtype_name(dtype), "block_size": block_size}
    max_len = context + STEPS
    # Each slot is a whole number of pages, as in the engine (`minillm.vmm.manager`): the
    # contiguous kernel's "block" is then a multiple of its tile and every tile lies in one
    # block (`blocks_per_tile` = 1). A slot of context + STEPS tokens exactly would not be,
    # and would send the kernel down the per-row gather path.
    capacity = slot_capacity(max_len, kv_heads * head_dim * dtype.itemsize, page_bytes(device))
    made, status = attempt(lambda: paged_cache(SEED, batch, kv_heads, context, head_dim, block_size, dtype, device, gen))
    if made is None:
        results.add(BENCHMARK, {**base, "kind": "decode"}, "oom", True, note=f"paged pool: {status}")
        return
    k_pool, v_pool, tables = made
    cache = VirtualKVCache(1, kv_heads, head_dim, batch, capacity, dtype=dtype, device=device)
    try:
        page = cache.page_bytes
        base["page_bytes"] = page
        for b in range(batch):  # the same tokens, contiguous per sequence
            cache.admit(b, context)
            kb, vb = sequence_kv(b, SEED, context, kv_heads, head_dim, dtype, device)
            cache.k[0][b, :context].copy_(kb)
            cache.v[0][b, :context].copy_(vb)
        k_virt, v_virt = cache.k[0], cache.v[0]                  # [B, capacity, Hkv, D]
        k_torch, v_torch = k_virt[:, :context].clone(), v_virt[:, :context].clone()  # ordinary memory
        _decode(results, {**base, "kind": "decode"}, device, gen, batch, context, q_heads, kv_heads, head_dim, dtype,
                k_virt, v_virt, k_torch, v_torch, k_pool, v_pool, tables, ceilings.get("copy_TBps"), timer)
        if device.type == "cuda":
            _decode_graph(results, {**base, "kind": "decode"}, device, gen, batch, context, q_heads, kv_heads,
                          head_dim, dtype, capacity, k_virt, v_virt, k_pool, v_pool, tables, timer)
        if batch * context <= MAX_PREFILL_TOKENS:
            _prefill(results, {**base, "kind": "prefill"}, device, gen, batch, context, q_heads, head_dim, dtype,
                     k_virt, v_virt, k_torch, v_torch, k_pool, v_pool, tables, ceilings.get("bf16_matmul_TFLOPs"),
                     timer)
        else:
            results.add(BENCHMARK, {**base, "kind": "prefill"}, "time_ms", None,
                        note=f"skipped: B·L = {batch * context} > {MAX_PREFILL_TOKENS} tokens")
        del k_torch, v_torch

        # memory: what is mapped / allocated, and how much of it holds no token
        used = 2 * batch * context * kv_heads * head_dim * dtype.itemsize
        mapped = cache.table.mapped_bytes()
        pool_bytes = 2 * tables.numel() * block_size * kv_heads * head_dim * dtype.itemsize
        mem = {**base, "kind": "memory"}
        results.add(BENCHMARK, mem, "mapped_bytes", mapped, peer="paged_blocks", peer_value=pool_bytes)
        results.add(BENCHMARK, mem, "wasted_bytes", mapped - used, peer="paged_blocks", peer_value=pool_bytes - used,
                    note="every sequence at exactly L tokens: pages and blocks both end full; the length "
                         "distributions are the notebook's simulation")

        # host work per decode step
        mgr = BlockManager(batch * -(-max_len // block_size), block_size, enable_prefix_caching=False)
        for b in range(batch):
            mgr.allocate(b, [1] * context)
        width = -(-max_len // block_size)
        ids = list(range(batch))
        vmm_steps, paged_steps = [], []
        for s in range(1, STEPS + 1):
            t = time.perf_counter()
            for b in ids:
                cache.grow(b, context + s)
            vmm_steps.append(time.perf_counter() - t)
            t = time.perf_counter()
            mgr.append_slots(ids, [1] * batch)
            padded_block_tables([mgr.block_table(b) for b in ids], width, device=device)
            paged_steps.append(time.perf_counter() - t)
        maps = cache.table.map_calls
        results.add(BENCHMARK, {**base, "kind": "host", "steps": STEPS}, "host_step_us",
                    statistics.median(vmm_steps) * 1e6, peer="paged_block_table",
                    peer_value=statistics.median(paged_steps) * 1e6,
                    note=f"virtual: grow() per sequence, max step {max(vmm_steps) * 1e6:.0f} us; paged: append_slots "
                         f"+ padded table to GPU, max {max(paged_steps) * 1e6:.0f} us; {maps} page mappings in all")
    finally:
        torch.cuda.synchronize(device)
        cache.close()


def page_bytes(device: torch.device) -> int:
    """The page `VirtualKVCache` maps on ``device``: the driver's granularity (2 MB)."""
    from minillm.vmm.driver import device_granularity

    return device_granularity(device.index if device.index is not None else torch.cuda.current_device())


def _decode(results, params, device, gen, batch, context, q_heads, kv_heads, head_dim, dtype, k_virt, v_virt,
            k_torch, v_torch, k_pool, v_pool, tables, copy_tbps, timer):
    add = lambda *a, **kw: results.add(BENCHMARK, params, *a, **kw)  # noqa: E731
    q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    kv_pool, one_block = contiguous_as_paged(k_virt)  # [B, capacity, Hkv, D] = B blocks of capacity
    vv_pool, _ = contiguous_as_paged(v_virt)
    kt_pool, _ = contiguous_as_paged(k_torch)
    vt_pool, _ = contiguous_as_paged(v_torch)
    outs = {name: torch.empty(batch, q_heads, head_dim, device=device, dtype=dtype)
            for name in ("v", "p", "c", "t", "ptr", "tma")}
    lse = torch.empty(batch, q_heads, device=device, dtype=torch.float32)
    calls = {
        "ours": lambda: flash_decode_attention(q, kv_pool, vv_pool, one_block, lens, max_seq_len=context,
                                               out=outs["v"], lse=lse),
        "paged_flash_decoding": lambda: flash_decode_attention(q, k_pool, v_pool, tables, lens, max_seq_len=context,
                                                               out=outs["p"], lse=lse),
        "paged_ch05": lambda: paged_decode_attention(q, k_pool, v_pool, tables, lens, out=outs["c"], lse=lse),
        "torch_memory": lambda: flash_decode_attention(q, kt_pool, vt_pool, one_block, lens, max_seq_len=context,
                                                       out=outs["t"], lse=lse),
        # How the tiles of the one-block cache are loaded (Chapter 7's switches): pointer
        # loads, and bulk TMA copies (sm_90; elsewhere these are pointer loads again).
        "pointer_loads": lambda: flash_decode_attention(q, kv_pool, vv_pool, one_block, lens, max_seq_len=context,
                                                        out=outs["ptr"], lse=lse, config={"TMA": False}),
        "tma_loads": lambda: flash_decode_attention(q, kv_pool, vv_pool, one_block, lens, max_seq_len=context,
                                                    out=outs["tma"], lse=lse, config={"TMA": True}),
    }
    ms = interleaved_times(calls, timer)
    sdpa_ms, _ = attempt(lambda: time_sdpa(q, k_virt[:, :context].transpose(1, 2), v_virt[:, :context].transpose(1, 2),
                                           None, timer)[0], allow_errors=True)
    ms["sdpa_virtual"] = sdpa_ms
    n_bytes = decode_attention_bytes([context] * batch, q_heads, kv_heads, head_dim, dtype.itemsize)
    tbps = lambda t: n_bytes / (t * 1e-3) / 1e12 if t else None  # noqa: E731
    for peer in ("paged_flash_decoding", "paged_ch05", "sdpa_virtual", "torch_memory", "pointer_loads", "tma_loads"):
        add("time_ms", ms["ours"], peer=peer, peer_value=ms[peer])
    add("bandwidth_TBps", tbps(ms["ours"]), peer="paged_flash_decoding", peer_value=tbps(ms["paged_flash_decoding"]),
        fraction_of_ceiling=fraction(tbps(ms["ours"]), copy_tbps))
    add("rel_err", rel_err(outs["v"], outs["p"]), peer="paged_ch05", peer_value=rel_err(outs["c"], outs["p"]),
        note="against paged_flash_decoding on the same tokens")


def _decode_graph(results, params, device, gen, batch, context, q_heads, kv_heads, head_dim, dtype, capacity,
                  k_virt, v_virt, k_pool, v_pool, tables, timer):
    """``graph_time_ms`` rows: the decode calls replayed from a CUDA graph, as an engine's
    decode step runs them (no host time per call). Ours with its default loads, which inside a
    capture are bulk copies on sm_90 (Chapter 7's ``TMA_ON_HOPPER = "captured"``), and with
    pointer loads forced; the peer, the paged kernel on the pool. Small caches are copied
    (`minillm.kernels.base.l2_copies`) into a second virtual cache and more pools, and the
    calls take turns."""
    from minillm.vmm import VirtualKVCache

    add = lambda *a, **kw: results.add(BENCHMARK, params, *a, **kw)  # noqa: E731
    copies = l2_copies(2 * batch * context * kv_heads * head_dim * dtype.itemsize, device, GRAPH_MAX_COPIES)
    extra = (VirtualKVCache(1, kv_heads, head_dim, batch * (copies - 1), capacity, dtype=dtype, device=device)
             if copies > 1 else None)
    virtual, pools = [(k_virt, v_virt)], [(k_pool, v_pool, tables)]
    try:
        for c in range(copies - 1):
            slots = [extra.admit((c, b), context) for b in range(batch)]
            if slots != list(range(slots[0], slots[0] + batch)):
                raise RuntimeError(f"copy {c}: slots {slots} are not one run")
            rows = slice(slots[0], slots[0] + batch)
            extra.k[0][rows, :context].copy_(k_virt[:, :context])
            extra.v[0][rows, :context].copy_(v_virt[:, :context])
            virtual.append((extra.k[0][rows], extra.v[0][rows]))
            pools.append((k_pool.clone(), v_pool.clone(), tables))
        q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        out = torch.empty(batch, q_heads, head_dim, device=device, dtype=dtype)
        lse = torch.empty(batch, q_heads, device=device, dtype=torch.float32)

        def on_virtual(config):
            fns = []
            for k, v in virtual:
                (kp, one_block), (vp, _) = contiguous_as_paged(k), contiguous_as_paged(v)
                fns.append(lambda kp=kp, vp=vp, t=one_block: flash_decode_attention(
                    q, kp, vp, t, lens, max_seq_len=context, out=out, lse=lse, config=config))
            return fns

        on_pool = [lambda kp=kp, vp=vp, t=t: flash_decode_attention(q, kp, vp, t, lens, max_seq_len=context, out=out,
                                                                     lse=lse) for kp, vp, t in pools]
        ms = {name: graph_time_ms(fns, GRAPH_REPEATS, timer) for name, fns in (
            ("ours", on_virtual(None)), ("paged_flash_decoding", on_pool), ("pointer_loads", on_virtual({"TMA": False})))}
        note = (f"per call, replaying a CUDA graph of {GRAPH_REPEATS} calls over {copies} cop"
                f"{'y' if copies == 1 else 'ies'} of the caches; ours: the default loads (bulk copies when captured "
                "on sm_90)")
        for peer in ("paged_flash_decoding", "pointer_loads"):
            add("graph_time_ms", ms["ours"], peer=peer, peer_value=ms[peer], note=note)
    finally:
        del virtual, pools
        torch.cuda.synchronize(device)
        if extra is not None:
            extra.close()


def _prefill(results, params, device, gen, batch, context, q_heads, head_dim, dtype, k_virt, v_virt, k_torch,
             v_torch, k_pool, v_pool, tables, matmul_tflops, timer):
    add = lambda *a, **kw: results.add(BENCHMARK, params, *a, **kw)  # noqa: E731
    made, status = attempt(lambda: torch.randn(batch * context, q_heads, head_dim, device=device, dtype=dtype,
                                               generator=gen))
    if made is None:
        add("oom", True, note=f"prefill queries: {status}")
        return
    q_packed = made                                               # [B·L, Hq, D]
    q4 = q_packed.view(batch, context, q_heads, head_dim).transpose(1, 2)  # [B, Hq, L, D]
    kv = (k_virt[:, :context].transpose(1, 2), v_virt[:, :context].transpose(1, 2))   # [B, Hkv, L, D] views
    kt = (k_torch.transpose(1, 2), v_torch.transpose(1, 2))
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    cu = torch.arange(0, (batch + 1) * context, context, dtype=torch.int32, device=device)
    out_v = torch.empty(batch, q_heads, context, head_dim, device=device, dtype=dtype)
    out_p = torch.empty_like(q_packed)
    out_t = torch.empty_like(out_v)
    calls = {
        "ours": lambda: flash_attention(q4, *kv, causal=True, out=out_v),
        "paged_prefill": lambda: paged_prefill_attention(q_packed, cu, k_pool, v_pool, tables, lens, context,
                                                         causal=True, out=out_p),
        "torch_memory": lambda: flash_attention(q4, *kt, causal=True, out=out_t),
    }
    ms = interleaved_times(calls, timer)
    flops = attention_head_flops(context, context, head_dim, causal=True) * q_heads * batch
    tflops = lambda t: flops / (t * 1e-3) / 1e12 if t else None  # noqa: E731
    for peer in ("paged_prefill", "torch_memory"):
        add("time_ms", ms["ours"], peer=peer, peer_value=ms[peer])
    add("TFLOPs", tflops(ms["ours"]), peer="paged_prefill", peer_value=tflops(ms["paged_prefill"]),
        fraction_of_ceiling=fraction(tflops(ms["ours"]), matmul_tflops))
    add("rel_err", rel_err(out_v.transpose(1, 2).reshape(out_p.shape), out_p), note="against paged_prefill")


# == the engine on the virtual cache ==============================================================

def engine_part(results: Results, device, num_requests: int = ENGINE_REQUESTS, repeats: int = ENGINE_REPEATS, *,
                workload_shape: dict | None = None) -> dict:
    """Chapter 9's offline workload through the engine in paged and in virtual mode (see the
    module docstring); returns ``{mode: measurements}``. ``workload_shape`` overrides Chapter
    9's ``preset``, ``dtype``, ``engine`` (an `EngineConfig`), ``concurrency``, ``prompt_len``,
    ``output_len`` (the CPU test runs a tiny model through the same code)."""
    from bench import ch09_engine as ch09
    from minillm.experiments import ch09_engine_benchmark as eb
    from minillm.model import load_model, load_tokenizer

    w = {"preset": ch09.PRESET, "dtype": ch09.DTYPE, "engine": ch09.ENGINE, "concurrency": ch09.CONCURRENCY,
         "prompt_len": ch09.PROMPT_LEN, "output_len": ch09.OUTPUT_LEN, **(workload_shape or {})}
    path = eb.build_random_llama(w["preset"], dtype=w["dtype"], device=str(torch.device(device).type))
    model, mconfig = load_model(path, device=device, dtype=w["dtype"])
    tokenizer, _ = load_tokenizer(path)
    # A new workload each round (both modes run the same one): the paged engine's prefix cache
    # would otherwise find every prompt of a repeated workload cached by the previous round,
    # and skip its prefill (measured: its prompt steps fell from 2,048 tokens to ~80).
    workloads = [eb.make_workload(eb.WorkloadSpec(num_requests, w["prompt_len"], w["output_len"], seed=i),
                                  mconfig.vocab_size) for i in range(repeats)]
    # Chapter 9's warm-up workload: one batch of short outputs (compile, capture, map)
    warm_out = (w["output_len"][0], max(w["output_len"][0], 64))
    warmup = eb.make_workload(eb.WorkloadSpec(w["concurrency"], w["prompt_len"], warm_out, seed=1000),
                              mconfig.vocab_size)
    token_bytes = 2 * mconfig.num_hidden_layers * mconfig.num_key_value_heads * mconfig.head_dim * \
        model.lm_head.weight.element_size()          # one token, every layer, K and V
    base = {"kind": "engine", "model": w["preset"] + "-random", "dtype": w["dtype"], "num_requests": num_requests,
            "concurrency": w["concurrency"], "prompt_len": f"{w['prompt_len'][0]}-{w['prompt_len'][1]}",
            "output_len": f"{w['output_len'][0]}-{w['output_len'][1]}",
            "max_num_batched_tokens": w["engine"].max_num_batched_tokens, "repeats": repeats}
    # Both engines live side by side (one copy of the weights) and their timed runs take turns,
    # so that both see the same drift of clocks and host load.
    # On a GPU an engine's KV budget is ``total · gpu_memory_utilization`` minus what is in use
    # (`LLMEngine._pool_blocks`): the i-th engine built asks for i + 1 shares, so that each gets
    # one share of the configured fraction.
    share = w["engine"].gpu_memory_utilization / len(ENGINE_MODES)
    engines: dict[str, dict] = {}
    for i, mode in enumerate(ENGINE_MODES):
        t0 = time.perf_counter()
        engine = eb.build_engine(path, model=model, tokenizer=tokenizer, config=w["engine"], kv_cache=mode,
                                 gpu_memory_utilization=(i + 1) * share)
        table = getattr(engine.manager, "table", None)
        maps0 = table.map_calls if table is not None else 0
        eb.run_offline(engine, warmup, use_tqdm=False)
        engines[mode] = dict(engine=engine, table=table, setup=time.perf_counter() - t0,
                             maps_warm=(table.map_calls - maps0) if table is not None else 0,
                             map_seconds=getattr(getattr(engine.cache, "backing", None), "map_seconds", []),
                             runs=[], maps=[], map_s=[], used=[], prompt_s=[], decode_s=[])
    for workload in workloads:
        for mode, e in engines.items():
            engine, table = e["engine"], e["table"]
            m0 = table.map_calls if table is not None else 0
            s0 = len(e["map_seconds"])
            e["runs"].append(eb.run_offline(engine, workload, mode=mode, use_tqdm=False))
            if table is not None:
                e["maps"].append(table.map_calls - m0)
                e["map_s"].append(sum(e["map_seconds"][s0:]))
            e["used"].append(max((s.kv_tokens for s in engine.steps), default=0) * token_bytes)
            with_prompt = [any(n > 1 for n in s.tokens.values()) for s in engine.steps]
            e["prompt_s"].append(sum(s.end - s.start for s, p in zip(engine.steps, with_prompt) if p))
            e["decode_s"].append(sum(s.end - s.start for s, p in zip(engine.steps, with_prompt) if not p))
    got: dict[str, dict] = {}
    for mode, e in engines.items():
        engine, table, runs = e["engine"], e["table"], e["runs"]
        m = got[mode] = {
            "output_tokens_per_s": statistics.median(r.output_tokens_per_s for r in runs),
            "runs_tokens_per_s": [r.output_tokens_per_s for r in runs],
            "decode_step_ms": statistics.median(r.decode_step_ms for r in runs if r.decode_step_ms is not None)
            if any(r.decode_step_ms is not None for r in runs) else None,
            "elapsed_s": statistics.mean(r.elapsed_s for r in runs),
            "steps": statistics.mean(r.steps for r in runs),
            "preemptions": sum(r.preemptions for r in runs),
            "kv_used_bytes": max(e["used"]),
            "prompt_steps_s": statistics.mean(e["prompt_s"]),
            "decode_steps_s": statistics.mean(e["decode_s"]),
        }
        if table is not None:
            m.update(map_calls=statistics.mean(e["maps"]), map_calls_warmup=e["maps_warm"],
                     map_ms=statistics.mean(e["map_s"]) * 1e3, kv_mapped_bytes=table.mapped_bytes(),
                     page_bytes=table.geometry.page_bytes, slot_tokens=engine.manager.capacity)
            m["map_calls_per_step"] = m["map_calls"] / m["steps"] if m["steps"] else None
        else:
            m["kv_mapped_bytes"] = max(r.peak_kv_blocks for r in runs) * engine.block_bytes
        print(f"  [{BENCHMARK}] engine {mode}: {m['output_tokens_per_s']:,.0f} output tok/s "
              f"(runs {', '.join(f'{x:,.0f}' for x in m['runs_tokens_per_s'])}), decode step "
              f"{m['decode_step_ms'] or float('nan'):.2f} ms, {m.get('map_calls', 0):g} maps per run "
              f"({e['maps_warm']} in the warm-up), {m['preemptions']} preemptions; setup + warm-up {e['setup']:.1f} s",
              flush=True)
    for e in engines.values():
        if e["table"] is not None:
            e["engine"].cache.close()
    del engines, engine
    free_memory()

    paged, virt = got["paged"], got["virtual"]
    vparams = {**base, "mode": "virtual", "page_bytes": virt["page_bytes"], "slot_tokens": virt["slot_tokens"]}
    pparams = {**base, "mode": "paged", "block_size": w["engine"].block_size}
    runs_note = lambda m: "timed runs: " + ", ".join(f"{x:,.0f}" for x in m["runs_tokens_per_s"]) + " tok/s"  # noqa: E731
    results.add(BENCHMARK, vparams, "output_tokens_per_s", virt["output_tokens_per_s"], "paged",
                paged["output_tokens_per_s"], note=f"{runs_note(virt)}; paged {runs_note(paged)}")
    results.add(BENCHMARK, pparams, "output_tokens_per_s", paged["output_tokens_per_s"], note=runs_note(paged))
    for metric in ("decode_step_ms", "elapsed_s", "prompt_steps_s", "decode_steps_s"):
        results.add(BENCHMARK, vparams, metric, virt[metric], "paged", paged[metric])
    results.add(BENCHMARK, vparams, "steps", virt["steps"], "paged", paged["steps"], better="lower")
    results.add(BENCHMARK, vparams, "preemptions", virt["preemptions"], "paged", paged["preemptions"], better="lower")
    results.add(BENCHMARK, vparams, "map_calls", virt["map_calls"], better="lower",
                note="(tensor, page) mappings per timed run; a slot reused keeps its pages (deferred reclamation)")
    results.add(BENCHMARK, vparams, "map_calls_per_step", virt["map_calls_per_step"], better="lower")
    results.add(BENCHMARK, vparams, "map_calls_warmup", virt["map_calls_warmup"], better="lower",
                note="during the warm-up run, which maps the pages of every slot it uses")
    results.add(BENCHMARK, vparams, "map_ms", virt["map_ms"], note="host time of the mappings, per timed run")
    results.add(BENCHMARK, vparams, "kv_mapped_bytes", virt["kv_mapped_bytes"], "paged", paged["kv_mapped_bytes"],
                note="virtual: pages mapped after the runs; paged: peak blocks in use x block bytes")
    results.add(BENCHMARK, vparams, "kv_used_bytes", virt["kv_used_bytes"], "paged", paged["kv_used_bytes"],
                note="the most bytes the live sequences' tokens held in one step")
    return got


def summary(results: Results) -> str:
    lines = [f"{BENCHMARK}: ours = contiguous kernels on the virtual-memory cache (engine: kv_cache='virtual')"]
    for r in results.rows:
        if r["benchmark"] != BENCHMARK or r["metric"] not in ("time_ms", "map_us", "host_step_us",
                                                               "output_tokens_per_s", "map_calls_per_step"):
            continue
        p = r["params"]
        where = (f"engine {p.get('mode')}" if p.get("kind") == "engine"
                 else f"{p.get('kind')} B={p.get('batch', '-')} L={p.get('context', '-')}")
        ours = f"{r['ours']:.4g}" if isinstance(r["ours"], (int, float)) else str(r["ours"])
        peer = f" vs {r['peer']} {r['peer_value']:.4g}" if isinstance(r.get("peer_value"), (int, float)) else ""
        lines.append(f"  {where:28s} {r['metric']:13s} {ours}{peer}")
    return "\n".join(lines)
