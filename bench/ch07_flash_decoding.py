"""Chapter 7 benchmark: flash-decoding over the paged cache, against the unsplit kernel and SDPA.

**Decode points.** bf16, head_dim 128, 32 query heads, 8 KV heads (GQA 4:1, Llama-3-8B) and
32 (MHA), batch 1/8/32, context L = 4k/32k/128k, every sequence at length L, a paged cache of
blocks of 16 whose block tables are a random permutation of the pool (Chapter 5's worst-case
locality). Peers, on the same K/V values:

- ``sdpa_flash`` / ``sdpa_cudnn``: ``F.scaled_dot_product_attention`` with a length-1 query
  over a contiguous cache ``[B, Hkv, L, D]`` (``enable_gqa`` for GQA), pinned to
  ``SDPBackend.FLASH_ATTENTION`` and to ``SDPBackend.CUDNN_ATTENTION`` (Chapter 2's
  `time_sdpa`). A backend that refuses the inputs gets an empty value and the reason in the
  row's note. The contiguous cache holds the same tokens in logical order: for a single query
  attention is a sum over keys, so the order of the blocks does not change the output, and
  our output is checked against SDPA's.
- ``ch05_unsplit``: Chapter 5's `paged_decode_attention` on the same paged pool (one program
  per sequence and KV head).

The two layouts are never held at once: the K/V of each sequence are drawn from their own
seeded generator, first into the contiguous cache (the SDPA peers are timed, their outputs
kept, the cache freed), then again, identically, into the paged pool. So the largest point
(32 x 32 heads x 128k tokens: 68.7 GB of K+V) needs one copy of the cache, not two.

**Extra points.** (a) ``long_context``: batch 1, 8 KV heads, L = 65536, ours against the
unsplit kernel (the chapter's goal: at least 5x). (b) ``split_sweep``: at batch 1 and 8, 8
and 32 KV heads, L = 32k, the time of every split count in ``ABLATION_SPLITS`` and of the
counts the rules pick (``ours`` = `num_splits_heuristic`, ``fa2`` = `fa2_num_splits` called as
FlashAttention-2 calls it, with 2 x SMs slots and 128-key blocks, ``partition_128`` and
``partition_512`` = fixed partitions as in vLLM V2), so a plot of time against S can mark
where each rule lands.

(c) ``loads``: how stage 1 loads its K/V tiles, at the points of ``LOAD_POINTS``, each variant
a switch of stage 1's ``config`` (`LOAD_VARIANTS`): on the paged pool (16-token blocks, where a
128-key tile is 8 blocks and only pointer loads apply) with and without the ``evict_first``
hint, and on a contiguous cache seen as one block per sequence (Chapter 11's layout:
``[batch, L + SLOT_EXTRA, kv_heads, head_dim]``, `contiguous_as_paged`) with pointer loads,
with the hint, and with bulk TMA loads (sm_90). Against SDPA cuDNN on the same values.

The sweep stops starting points after ``MINILLM_CH07_BUDGET_S`` seconds (default 200; status
"partial"); the long-context point and the split sweep come first, then the decode points
from the smallest cache to the largest, then the load variants.

Rows (``params``: kind, batch, q_heads, kv_heads, context, head_dim, dtype, block_size,
blocks = "shuffled", num_splits = the S that ``ours`` used; split_sweep rows add ``rule``):

====================  =======================================================================
``oom``               True when a point's inputs did not fit (nothing else recorded for it)
``time_ms``           decode: `flash_decode_attention` with the default heuristic and the
                      default merge (`FUSED_MERGE`: in stage 1's last program, one launch),
                      one row per peer (sdpa_flash, sdpa_cudnn, ch05_unsplit): ratio =
                      peer/ours; and one row with peer ``two_launch``: the same call with the
                      merge in a second launch (stage 2, `reduce_splits`), ratio > 1: the
                      one-launch merge is faster (equal calls with one split: no merge).
                      long_context: peer ch05_unsplit. split_sweep: ours = the time with
                      ``num_splits`` splits, peer ``num_splits_1`` (the same kernel unsplit)
``bandwidth_TBps``    `minillm.costs.paged_decode_attention_bytes` (K, V, q, out, lse, table: the useful
                      bytes; the workspace is not counted, so its cost shows as lost
                      bandwidth) / time; one row per peer as for time_ms; fraction of the
                      measured copy bandwidth
``rel_err``           ‖ours − ref‖ / ‖ref‖ (fp32): peer ``sdpa_fp32 (sequence 0)`` (SDPA in
                      fp32 on sequence 0's gathered K/V), and peer ``sdpa`` (the whole batch
                      against the first SDPA backend that ran)
``reduce_time_ms``    stage 2 alone (`reduce_splits` on the partials stage 1 left in the
                      workspace); 0 with one split (no stage 2)
``reduce_share``      reduce_time_ms / time of the whole two-launch call (what the second
                      launch costs; the one-launch merge removes it)
``reduce_share_graph``  the same share in CUDA-graph time (stage 2's GPU time, without its
                      launch overhead); points timed with graphs only
``merge_share_graph``  what the default one-launch merge costs: (graph time of the default
                      call − graph time of stage 1 alone) / graph time of the default call
``graph_time_ms``     as time_ms (one row per peer, two_launch included; split_sweep: peer
                      num_splits_1), per call
                      replaying a CUDA graph of ``GRAPH_REPEATS`` calls: the GPU's time
                      without launch overhead. Decode points of at most
                      ``GRAPH_MAX_CACHE_BYTES`` of cache, and every split_sweep row; CUDA only
``async_time_ms``     the asynchronized softmax (``phi = PHI``) against peer ``exact`` (the
                      default call): ratio = exact/async (> 1: async is faster)
``fallback_fraction``  fraction of stage-1 programs of the async call that fell back
``load_time_ms``      loads (params add ``layout``, ``variant``): the variant's eager time
                      against peer ``sdpa_cudnn`` (ratio = cudnn/variant, > 1: ours faster)
``load_graph_time_ms``  the same as CUDA-graph times (caches of at most
                      ``GRAPH_MAX_CACHE_BYTES``)
``load_rel_err``      ‖variant − cudnn‖ / ‖cudnn‖ on the whole batch
====================  =======================================================================
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

from minillm.costs import kv_cache_bytes, paged_decode_attention_bytes
from minillm.kernels.ch07_flash_decoding import (
    VLLM_PARTITION, fa2_num_splits, flash_decode_attention, num_sms, num_splits_heuristic, partition_splits,
    reduce_splits, split_attention, split_counters, split_workspace, tma_applies,
)
from minillm.kernels.ch05_paged_attention import contiguous_as_paged, decode_block_n, paged_decode_attention

from bench.common import (
    Results, attempt, contiguous_cache, cuda_device, decode_error, dtype_name, fraction, free_memory, graph_time_ms,
    interleaved_times, paged_cache, rel_err, sequence_kv, sweep_start, time_sdpa,
)

BENCHMARK = "ch07_flash_decoding"
Q_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 128, 16
KV_HEADS = (8, 32)
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 32768, 131072)
DTYPE = torch.bfloat16
#: Skip points whose K+V cache (one layout) is larger than this, in bytes: the largest point,
#: 68.7 GB, fits an H200 (one layout at a time, see the module docstring).
MAX_CACHE_BYTES = 100e9
#: (batch, kv_heads, context) of the long-context comparison with the unsplit kernel.
LONG_POINT = (1, 8, 65536)
#: (batch, kv_heads, context) of the split-count sweep, and the split counts it times.
ABLATION_POINTS = ((1, 8, 32768), (1, 32, 32768), (8, 8, 32768), (8, 32, 32768))
ABLATION_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
#: The unified max of the asynchronized softmax, natural-log units. The random bf16 inputs
#: give scores of about N(0, 1) (q, k standard normal, scale 1/sqrt(D)), so every split's max
#: lies within a few units of 0, deep inside bf16's window of ±60 binades.
PHI = 0.0
PEERS = ("sdpa_flash", "sdpa_cudnn", "ch05_unsplit")
WARMUP_MS, REP_MS = 25, 100
#: Decode points whose K+V cache is at most this many bytes are also timed replaying a CUDA
#: graph (``graph_time_ms`` rows): at 4.8 TB/s, 256 MB take ~55 µs, and below that the ~20-40
#: µs of Python and launch overhead per eager call (two launches when split) would be what an
#: eager timing measures.
GRAPH_MAX_CACHE_BYTES = 256e6
#: Calls captured per CUDA graph (the graph timings are per call).
GRAPH_REPEATS = 16
#: (batch, kv_heads, context) of the load-variant ablation (``loads`` rows).
LOAD_POINTS = ((1, 8, 4096), (1, 8, 32768), (1, 8, 131072), (8, 8, 32768), (32, 8, 4096))
#: Free slots after each sequence in the ablation's contiguous cache: L + 128 is a multiple of
#: the 128-key tile, as a virtual-memory slot of whole 2 MB pages is (Chapter 11).
SLOT_EXTRA = 128
#: (layout, variant) -> stage 1's ``config`` (`flash_decode_attention`'s ``config=``).
LOAD_VARIANTS = {
    ("paged_16", "pointer"): dict(TMA=False, KV_EVICT=""),
    ("paged_16", "pointer_evict_first"): dict(TMA=False, KV_EVICT="evict_first"),
    ("contiguous", "pointer"): dict(TMA=False, KV_EVICT=""),
    ("contiguous", "pointer_evict_first"): dict(TMA=False, KV_EVICT="evict_first"),
    ("contiguous", "tma"): dict(TMA=True, KV_EVICT=""),
}


def budget_s() -> float:
    """Seconds after which no new point is started: ``MINILLM_CH07_BUDGET_S`` (default 200)."""
    return float(os.environ.get("MINILLM_CH07_BUDGET_S", "200"))


# ----------------------------------------------------------------------------------------
# Inputs: the same K/V values, contiguous for SDPA or paged for ours (`contiguous_cache`,
# `paged_cache`: bench.common)
# ----------------------------------------------------------------------------------------
def fa2_choice(batch: int, kv_heads: int, context: int, sms: int, block_n: int) -> int:
    """The split count FlashAttention-2 would pick for this decode step: GQA packs a group's
    query heads into one program (``batch · kv_heads`` programs), key blocks of ``block_n``,
    and twice the SM count as slots (two 128-thread programs per SM, flash_api.cpp)."""
    return fa2_num_splits(batch * kv_heads, -(-context // block_n), 2 * sms)


def sdpa_peers(q, seed, batch, kv_heads, context, head_dim, dtype, device, timer, use_graphs):
    """Time the pinned SDPA backends on a contiguous cache of the point's values (freed on
    return). Returns ``(sdpa, sdpa_out, graph_ms)``: ``sdpa[name] = (ms or None, note)``,
    ``sdpa_out = (name, out)`` of the first backend that ran (or None), and the CUDA-graph
    times per name when ``use_graphs``."""
    from torch.nn.attention import SDPBackend

    backends = (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION))
    cache, status = attempt(lambda: contiguous_cache(seed, batch, kv_heads, context, head_dim, dtype, device))
    if cache is None:
        return {name: (None, f"contiguous cache: {status}") for name, _ in backends}, None, {}
    k, v = cache
    sdpa: dict[str, tuple[float | None, str | None]] = {}
    sdpa_out, graph_ms = None, {}
    for name, backend in backends:
        res, why = attempt(lambda b=backend: time_sdpa(q, k, v, b, timer), allow_errors=True)
        sdpa[name] = (res[0] if res else None, why)
        if res is not None and sdpa_out is None:
            sdpa_out = (name, res[1].clone())
        if res is not None and use_graphs:
            graph_ms[name], _ = attempt(lambda b=backend: _sdpa_graph_ms(q, k, v, b, timer), allow_errors=True)
    return sdpa, sdpa_out, graph_ms


def _sdpa_graph_ms(q, k, v, backend, timer) -> float:
    """`time_sdpa`'s call (length-1 query, pinned ``backend``) timed as a CUDA graph of
    ``GRAPH_REPEATS`` calls: the backend is chosen when the graph is captured."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    q4, gqa = q[:, :, None], q.shape[1] != k.shape[1]
    with sdpa_kernel(backend):
        return graph_time_ms(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=gqa), GRAPH_REPEATS, timer)


# ----------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------
def run(results: Results, device) -> None:
    """Run the Chapter 7 sweep on ``device`` (CUDA) and add its rows to ``results``.

    Needs ``results.ceilings["copy_TBps"]`` for the bandwidth fractions."""
    device = cuda_device(device, "the Chapter 7 benchmark")
    sweep(results, device)


def sweep(results: Results, device, q_heads: int = Q_HEADS, kv_heads_list=KV_HEADS, batches=BATCHES,
          contexts=CONTEXTS, head_dim: int = HEAD_DIM, block_size: int = BLOCK_SIZE, dtype: torch.dtype = DTYPE,
          timer: Callable[[Callable[[], Any]], float] | None = None, long_point=LONG_POINT,
          ablation_points=ABLATION_POINTS, ablation_splits=ABLATION_SPLITS,
          max_cache_bytes: float = MAX_CACHE_BYTES, load_points=LOAD_POINTS) -> None:
    """The loops of `run`: the long-context point, the split sweep, the decode points
    (smallest cache first), then the load variants, until the time budget is spent. ``timer(fn) -> ms`` defaults to
    `bench.common.time_ms` (CUDA only); the CPU tests pass a stand-in that calls ``fn`` once,
    to check the bookkeeping under the interpreter. Contexts must be multiples of the block size."""
    timer, tables_gen, out_of_time = sweep_start(results, BENCHMARK, device, budget_s(), timer, WARMUP_MS, REP_MS)
    copy_tbps = (results.ceilings or {}).get("copy_TBps")
    setup = dict(q_heads=q_heads, head_dim=head_dim, block_size=block_size, dtype=dtype, copy_tbps=copy_tbps,
                 timer=timer, tables_gen=tables_gen)

    def timed(label, fn, *args, **kwargs):
        t0 = time.perf_counter()
        fn(results, device, *args, **kwargs, **setup)
        free_memory()
        print(f"  [{BENCHMARK}] {label}: {time.perf_counter() - t0:.1f} s", flush=True)

    if long_point and not out_of_time():
        timed(f"long context {long_point}", _run_long_point, *long_point)
    for batch, kv_heads, context in ablation_points:
        if out_of_time():
            return
        timed(f"split sweep B={batch} Hkv={kv_heads} L={context}", _run_split_sweep, batch, kv_heads, context,
              ablation_splits)
    points = [(kv, b, L) for kv in kv_heads_list for b in batches for L in contexts
              if kv_cache_bytes(b * L, kv, head_dim, dtype.itemsize) <= max_cache_bytes]
    for kv_heads, batch, context in sorted(points, key=lambda p: (p[0] * p[1] * p[2], p)):
        if out_of_time():
            return
        timed(f"decode Hkv={kv_heads} B={batch} L={context}", _run_decode_point, batch, kv_heads, context)
    for batch, kv_heads, context in load_points:
        if out_of_time():
            return
        timed(f"loads B={batch} Hkv={kv_heads} L={context}", _run_loads_point, batch, kv_heads, context)


def _params(kind: str, batch: int, q_heads: int, kv_heads: int, context: int, head_dim: int, block_size: int,
            dtype, **extra) -> dict:
    return {"kind": kind, "batch": batch, "q_heads": q_heads, "kv_heads": kv_heads, "context": context,
            "head_dim": head_dim, "dtype": dtype_name(dtype), "block_size": block_size, "blocks": "shuffled",
            **extra}


def _paged_inputs(results, params, seed, batch, q_heads, kv_heads, context, head_dim, block_size, dtype, device,
                  tables_gen):
    """``(q, k_pool, v_pool, tables, lens)`` or None (an ``oom`` row is added)."""
    def make():
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
        return (q, *paged_cache(seed, batch, kv_heads, context, head_dim, block_size, dtype, device, tables_gen))

    inputs, _ = attempt(make)
    if inputs is None:
        gb = kv_cache_bytes(batch * context, kv_heads, head_dim, dtype.itemsize) / 1e9
        results.add(BENCHMARK, params, "oom", True, note=f"paged inputs ({gb:.1f} GB of cache) did not fit")
        return None
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return (*inputs, lens)


def _run_decode_point(results: Results, device, batch: int, kv_heads: int, context: int, *, q_heads, head_dim,
                      block_size, dtype, copy_tbps, timer, tables_gen) -> None:
    seed = 7919 * batch + 131 * kv_heads + context  # one seed per point, the same in every run
    sms = num_sms(device)
    block_n = decode_block_n(head_dim, dtype)
    splits = num_splits_heuristic(batch, kv_heads, context, sms, block_n)
    params = _params("decode", batch, q_heads, kv_heads, context, head_dim, block_size, dtype, num_splits=splits)
    add = lambda *a, **kw: results.add(BENCHMARK, params, *a, **kw)  # noqa: E731
    n_bytes = paged_decode_attention_bytes([context] * batch, q_heads, kv_heads, head_dim, dtype.itemsize, block_size)
    tbps = lambda ms: n_bytes / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731

    # 1. The SDPA peers on the contiguous cache, which is then freed.
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
    use_graphs = torch.device(device).type == "cuda" and (
        kv_cache_bytes(batch * context, kv_heads, head_dim, dtype.itemsize) <= GRAPH_MAX_CACHE_BYTES)
    sdpa, sdpa_out, graph_ms = sdpa_peers(q, seed, batch, kv_heads, context, head_dim, dtype, device, timer,
                                          use_graphs)
    free_memory()

    # 2. Ours and Chapter 5's on the paged pool holding the same values.
    inputs = _paged_inputs(results, params, seed, batch, q_heads, kv_heads, context, head_dim, block_size, dtype,
                           device, tables_gen)
    if inputs is None:
        return
    q, k_pool, v_pool, tables, lens = inputs
    out = torch.empty(batch, q_heads, head_dim, device=device, dtype=dtype)
    lse = torch.empty(batch, q_heads, device=device, dtype=torch.float32)
    workspace = ((*split_workspace(batch, q_heads, splits, head_dim, device), split_counters(batch, q_heads, device))
                 if splits > 1 else None)

    def ours(phi=None, fallbacks=None, fused_merge=None):  # None: the default merge (FUSED_MERGE)
        return flash_decode_attention(q, k_pool, v_pool, tables, lens, out=out, lse=lse, num_splits=splits, phi=phi,
                                      workspace=workspace, fallbacks=fallbacks, fused_merge=fused_merge)

    def two_launch():
        return ours(fused_merge=False)

    def ch05():
        return paged_decode_attention(q, k_pool, v_pool, tables, lens, out=out, lse=lse)

    ours()
    err_seq0 = decode_error(q, k_pool, v_pool, tables, context, out)
    err_sdpa = rel_err(out, sdpa_out[1]) if sdpa_out else None
    ours_ms = timer(ours)
    two_launch()
    two_ms = timer(two_launch)
    ch05()
    ch05_ms = timer(ch05)
    if splits > 1:  # stage 2 alone, on the partials the last call left in the workspace
        ours()
        reduce_ms = timer(lambda: reduce_splits(workspace[0], workspace[1], out, lse))
    else:
        reduce_ms = 0.0
    if use_graphs:
        graph_ms["ours"] = graph_time_ms(ours, GRAPH_REPEATS, timer)
        graph_ms["two_launch"] = graph_time_ms(two_launch, GRAPH_REPEATS, timer)
        graph_ms["ch05_unsplit"] = graph_time_ms(ch05, GRAPH_REPEATS, timer)
        if splits > 1:
            graph_ms["reduce"] = graph_time_ms(lambda: reduce_splits(workspace[0], workspace[1], out, lse),
                                               GRAPH_REPEATS, timer)
            graph_ms["stage1"] = graph_time_ms(
                lambda: split_attention(q, k_pool, v_pool, tables, lens, workspace[0], workspace[1]),
                GRAPH_REPEATS, timer)
    flags = torch.zeros(batch, kv_heads, splits, dtype=torch.int32, device=device)
    ours(PHI, flags)
    fell_back = float(flags.float().mean())
    async_ms = timer(lambda: ours(PHI))

    peer_ms = {"sdpa_flash": sdpa["sdpa_flash"][0], "sdpa_cudnn": sdpa["sdpa_cudnn"][0], "ch05_unsplit": ch05_ms}
    notes = {"sdpa_flash": sdpa["sdpa_flash"][1], "sdpa_cudnn": sdpa["sdpa_cudnn"][1],
             "ch05_unsplit": "Chapter 5's paged_decode_attention on the same pool"}
    for peer in PEERS:
        note = "; ".join(x for x in (f"ours: {splits} split(s), default heuristic", notes[peer]) if x)
        add("time_ms", ours_ms, peer, peer_ms[peer], note=note)
        add("bandwidth_TBps", tbps(ours_ms), peer, tbps(peer_ms[peer]),
            fraction_of_ceiling=fraction(tbps(ours_ms), copy_tbps),
            note="paged_decode_attention_bytes (K, V, q, out, lse, table) / time; workspace not counted")
    merge_note = (f"ours: stage 2 merged in stage 1's last program (one launch); peer: stage 2 as a second launch"
                  if splits > 1 else "one split: no merge, both are the same call")
    add("time_ms", ours_ms, "two_launch", two_ms, note=merge_note)
    if use_graphs:
        for peer in (*PEERS, "two_launch"):
            add("graph_time_ms", graph_ms["ours"], peer, graph_ms.get(peer),
                note=f"per call, replaying a CUDA graph of {GRAPH_REPEATS} calls")
    add("rel_err", err_seq0, "sdpa_fp32 (sequence 0)", None)
    add("rel_err", err_sdpa, "sdpa", None,
        note=f"whole batch against {sdpa_out[0]}" if sdpa_out else "no SDPA backend ran")
    add("reduce_time_ms", reduce_ms, note=None if splits > 1 else "one split: no stage 2")
    add("reduce_share", reduce_ms / two_ms if two_ms else None,
        note="reduce_time_ms / time_ms of the two-launch call")
    if use_graphs:
        reduce_graph = graph_ms.get("reduce", 0.0)
        add("reduce_share_graph", reduce_graph / graph_ms["two_launch"] if graph_ms["two_launch"] else None,
            note=f"stage 2's graph time ({reduce_graph * 1e3:.1f} us) / graph time of the two-launch call"
            if splits > 1 else "one split: no stage 2")
        merge_added = graph_ms["ours"] - graph_ms["stage1"] if splits > 1 else 0.0
        add("merge_share_graph", merge_added / graph_ms["ours"] if graph_ms["ours"] else None,
            note=f"time the one-launch merge adds ({merge_added * 1e3:.1f} us: graph time of the default call minus "
                 "that of stage 1 alone, writing its partials) / graph time of the default call"
            if splits > 1 else "one split: no merge")
    add("async_time_ms", async_ms, "exact", ours_ms, note=f"phi={PHI}; {fell_back:.1%} of programs fell back")
    add("fallback_fraction", fell_back, note=f"phi={PHI}; {batch}x{kv_heads}x{splits} stage-1 programs")


def _run_loads_point(results: Results, device, batch: int, kv_heads: int, context: int, *, q_heads, head_dim,
                     block_size, dtype, copy_tbps, timer, tables_gen) -> None:
    """Each of `LOAD_VARIANTS` (eager and, for small caches, CUDA-graph times) against SDPA
    cuDNN on the same values: the paged pool and a contiguous one-block-per-sequence cache."""
    from torch.nn.attention import SDPBackend

    seed = 7919 * batch + 131 * kv_heads + context
    sms = num_sms(device)
    splits = num_splits_heuristic(batch, kv_heads, context, sms, decode_block_n(head_dim, dtype))
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
    use_graphs = torch.device(device).type == "cuda" and (
        kv_cache_bytes(batch * context, kv_heads, head_dim, dtype.itemsize) <= GRAPH_MAX_CACHE_BYTES)
    base = _params("loads", batch, q_heads, kv_heads, context, head_dim, block_size, dtype, num_splits=splits)

    cudnn_ms, cudnn_graph, cudnn_out, why = None, None, None, None
    if torch.device(device).type == "cuda":
        cache, why = attempt(lambda: contiguous_cache(seed, batch, kv_heads, context, head_dim, dtype, device))
        if cache is not None:
            res, why = attempt(lambda: time_sdpa(q, *cache, SDPBackend.CUDNN_ATTENTION, timer), allow_errors=True)
            if res is not None:
                cudnn_ms, cudnn_out = res[0], res[1].clone()
                if use_graphs:
                    cudnn_graph, _ = attempt(lambda: _sdpa_graph_ms(q, *cache, SDPBackend.CUDNN_ATTENTION, timer),
                                             allow_errors=True)
        del cache
        free_memory()
    else:
        why = "no SDPA cuDNN off CUDA"
    inputs = _paged_inputs(results, base, seed, batch, q_heads, kv_heads, context, head_dim, block_size, dtype,
                           device, tables_gen)
    if inputs is None:
        return
    _, k_pool, v_pool, tables, lens = inputs
    made, status = attempt(lambda: _contiguous_slots(seed, batch, kv_heads, context, head_dim, dtype, device))
    if made is None:
        results.add(BENCHMARK, {**base, "layout": "contiguous"}, "oom", True, note=f"contiguous cache: {status}")
        return
    layouts = {"paged_16": (k_pool, v_pool, tables), "contiguous": made}
    outs = {key: torch.empty(batch, q_heads, head_dim, device=device, dtype=dtype) for key in LOAD_VARIANTS}
    lse = torch.empty(batch, q_heads, device=device, dtype=torch.float32)
    workspace = ((*split_workspace(batch, q_heads, splits, head_dim, device), split_counters(batch, q_heads, device))
                 if splits > 1 else None)

    def call(key):
        k, v, t = layouts[key[0]]
        return lambda: flash_decode_attention(q, k, v, t, lens, out=outs[key], lse=lse, num_splits=splits,
                                              workspace=workspace, config=LOAD_VARIANTS[key])

    calls = {key: call(key) for key in LOAD_VARIANTS}
    ms = interleaved_times(calls, timer)
    graph = {key: graph_time_ms(fn, GRAPH_REPEATS, timer) for key, fn in calls.items()} if use_graphs else {}
    tma_used = tma_applies(*made[:2], decode_block_n(head_dim, dtype), head_dim)
    for (layout, variant), t in ms.items():
        params = {**base, "layout": layout, "variant": variant,
                  "block_size": block_size if layout == "paged_16" else context + SLOT_EXTRA}
        note = (f"ours: {splits} split(s); {LOAD_VARIANTS[(layout, variant)]}"
                + ("" if variant != "tma" or tma_used else " (TMA does not apply here: pointer loads)"))
        results.add(BENCHMARK, params, "load_time_ms", t, "sdpa_cudnn", cudnn_ms,
                    note=note if cudnn_ms is not None else f"{note}; cuDNN: {why}")
        if use_graphs:
            results.add(BENCHMARK, params, "load_graph_time_ms", graph[(layout, variant)], "sdpa_cudnn", cudnn_graph,
                        note=f"per call, replaying a CUDA graph of {GRAPH_REPEATS} calls")
        results.add(BENCHMARK, params, "load_rel_err",
                    rel_err(outs[(layout, variant)], cudnn_out) if cudnn_out is not None else None, "sdpa_cudnn",
                    None)


def _contiguous_slots(seed, batch, kv_heads, context, head_dim, dtype, device):
    """``(k_pool, v_pool, tables)``: `sequence_kv`'s values in a contiguous ``[batch, context +
    SLOT_EXTRA, kv_heads, head_dim]`` cache seen as one block per sequence (`contiguous_as_paged`)."""
    k = torch.zeros(batch, context + SLOT_EXTRA, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.zeros_like(k)
    for b in range(batch):
        kb, vb = sequence_kv(b, seed, context, kv_heads, head_dim, dtype, device)
        k[b, :context], v[b, :context] = kb, vb
    k_pool, tables = contiguous_as_paged(k)
    v_pool, _ = contiguous_as_paged(v)
    return k_pool, v_pool, tables


def _run_long_point(results: Results, device, batch: int, kv_heads: int, context: int, *, q_heads, head_dim,
                    block_size, dtype, copy_tbps, timer, tables_gen) -> None:
    """Ours (default heuristic) against Chapter 5's unsplit kernel at one long sequence."""
    splits = num_splits_heuristic(batch, kv_heads, context, num_sms(device), decode_block_n(head_dim, dtype))
    params = _params("long_context", batch, q_heads, kv_heads, context, head_dim, block_size, dtype,
                     num_splits=splits)
    inputs = _paged_inputs(results, params, 1, batch, q_heads, kv_heads, context, head_dim, block_size, dtype,
                           device, tables_gen)
    if inputs is None:
        return
    q, k_pool, v_pool, tables, lens = inputs

    def ours():
        return flash_decode_attention(q, k_pool, v_pool, tables, lens, num_splits=splits)[0]

    def ch05():
        return paged_decode_attention(q, k_pool, v_pool, tables, lens)[0]

    err = rel_err(ours(), ch05())
    ours_ms, ch05_ms = timer(ours), timer(ch05)
    n_bytes = paged_decode_attention_bytes([context] * batch, q_heads, kv_heads, head_dim, dtype.itemsize, block_size)
    tbps = lambda ms: n_bytes / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    add = lambda *a, **kw: results.add(BENCHMARK, params, *a, **kw)  # noqa: E731
    add("time_ms", ours_ms, "ch05_unsplit", ch05_ms, note=f"goal: ratio >= 5; {splits} splits")
    add("bandwidth_TBps", tbps(ours_ms), "ch05_unsplit", tbps(ch05_ms),
        fraction_of_ceiling=fraction(tbps(ours_ms), copy_tbps))
    add("rel_err", err, "ch05_unsplit", None)


def _run_split_sweep(results: Results, device, batch: int, kv_heads: int, context: int, split_counts, *, q_heads,
                     head_dim, block_size, dtype, copy_tbps, timer, tables_gen) -> None:
    """The time of each split count, and of each rule's pick (timed once per distinct S)."""
    sms = num_sms(device)
    block_n = decode_block_n(head_dim, dtype)
    rules = {"ours": num_splits_heuristic(batch, kv_heads, context, sms, block_n),
             "fa2": fa2_choice(batch, kv_heads, context, sms, block_n),
             "partition_128": partition_splits(context, 128),
             f"partition_{VLLM_PARTITION}": partition_splits(context, VLLM_PARTITION)}
    base = _params("split_sweep", batch, q_heads, kv_heads, context, head_dim, block_size, dtype)
    inputs = _paged_inputs(results, base, 2, batch, q_heads, kv_heads, context, head_dim, block_size, dtype, device,
                           tables_gen)
    if inputs is None:
        return
    q, k_pool, v_pool, tables, lens = inputs
    out = torch.empty(batch, q_heads, head_dim, device=device, dtype=dtype)
    lse = torch.empty(batch, q_heads, device=device, dtype=torch.float32)
    n_bytes = paged_decode_attention_bytes([context] * batch, q_heads, kv_heads, head_dim, dtype.itemsize, block_size)
    tbps = lambda ms: n_bytes / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    use_graphs = torch.device(device).type == "cuda"
    times: dict[int, tuple[float, float | None]] = {}  # splits -> (eager ms, graph ms)

    def time_of(splits: int) -> tuple[float, float | None]:
        if splits not in times:
            ws = split_workspace(batch, q_heads, splits, head_dim, device) if splits > 1 else None
            fn = lambda: flash_decode_attention(q, k_pool, v_pool, tables, lens, out=out, lse=lse,  # noqa: E731
                                                num_splits=splits, workspace=ws)
            fn()
            times[splits] = (timer(fn), graph_time_ms(fn, GRAPH_REPEATS, timer) if use_graphs else None)
        return times[splits]

    unsplit, unsplit_graph = time_of(1)
    picks = [("sweep", s) for s in split_counts] + list(rules.items())
    for rule, splits in picks:
        ms, graph = time_of(splits)
        params = {**base, "rule": rule, "num_splits": splits}
        results.add(BENCHMARK, params, "time_ms", ms, "num_splits_1", unsplit)
        results.add(BENCHMARK, params, "bandwidth_TBps", tbps(ms), "num_splits_1", tbps(unsplit),
                    fraction_of_ceiling=fraction(tbps(ms), copy_tbps))
        if use_graphs:
            results.add(BENCHMARK, params, "graph_time_ms", graph, "num_splits_1", unsplit_graph,
                        note=f"per call, replaying a CUDA graph of {GRAPH_REPEATS} calls")


# ----------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------
def summary(results: Results | dict) -> str:
    """Decode: per point, our time and its ratio to each peer (> 1: ours faster), bandwidth,
    stage 2's share and async/exact. Then the long-context point and the split sweep."""
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results

    def f(x, fmt="{:.3f}"):
        return "—" if x is None else fmt.format(x)

    pts: dict[tuple, dict] = {}
    for r in select(data, BENCHMARK, kind="decode"):
        p = r["params"]
        row = pts.setdefault((p["kv_heads"], p["batch"], p["context"]), {"S": p.get("num_splits")})
        if r["metric"] == "time_ms":
            row["ours"] = r["ours"]
            row[r["peer"]] = r["ratio"]
        elif r["metric"] == "bandwidth_TBps" and r["peer"] == "ch05_unsplit":
            row["tbps"], row["frac"] = r["ours"], r["fraction_of_ceiling"]
        elif r["metric"] in ("reduce_share", "reduce_share_graph", "merge_share_graph", "oom"):
            row[r["metric"]] = r["ours"]
        elif r["metric"] == "async_time_ms":
            row["async"] = r["ratio"]
    lines = [f"{'Hkv':>4} {'B':>3} {'L':>6} {'S':>4} {'ours ms':>8} " + " ".join(f"{p:>12}" for p in PEERS)
             + f" {'TB/s':>5} {'of copy':>7} {'reduce':>6} {'graph':>5} {'merge':>5} {'2-launch':>8} {'exact/async':>11}   (peer_ms / ours_ms)"]
    for key in sorted(pts):
        row = pts[key]
        if row.get("oom"):
            lines.append(f"{key[0]:>4} {key[1]:>3} {key[2]:>6}  OOM (inputs)")
            continue
        lines.append(f"{key[0]:>4} {key[1]:>3} {key[2]:>6} {f(row.get('S'), '{}'):>4} {f(row.get('ours')):>8} "
                     + " ".join(f"{f(row.get(p), '{:.2f}'):>12}" for p in PEERS)
                     + f" {f(row.get('tbps'), '{:.2f}'):>5} {f(row.get('frac'), '{:.0%}'):>7} "
                       f"{f(row.get('reduce_share'), '{:.0%}'):>6} {f(row.get('reduce_share_graph'), '{:.0%}'):>5} "
                       f"{f(row.get('merge_share_graph'), '{:.0%}'):>5} "
                       f"{f(row.get('two_launch'), '{:.2f}'):>8} "
                       f"{f(row.get('async'), '{:.3f}'):>11}")
    for r in select(data, BENCHMARK, "time_ms", kind="long_context"):
        p = r["params"]
        lines.append(f"\nlong context B={p['batch']} Hkv={p['kv_heads']} L={p['context']} S={p['num_splits']}: "
                     f"ours {f(r['ours'])} ms, unsplit {f(r['peer_value'])} ms, speed-up {f(r['ratio'], '{:.1f}')}x "
                     "(goal >= 5x)")
    sweeps: dict[tuple, dict] = {}
    for metric in ("time_ms", "graph_time_ms"):
        for r in select(data, BENCHMARK, metric, kind="split_sweep"):
            p = r["params"]
            entry = sweeps.setdefault((p["batch"], p["kv_heads"], p["context"]), {"rules": {}})
            entry.setdefault(metric, {})[p["num_splits"]] = r["ours"]
            if p["rule"] != "sweep":
                entry["rules"][p["rule"]] = p["num_splits"]
    loads: dict[tuple, dict] = {}
    for metric in ("load_time_ms", "load_graph_time_ms"):
        for r in select(data, BENCHMARK, metric, kind="loads"):
            p = r["params"]
            entry = loads.setdefault((p["batch"], p["kv_heads"], p["context"]), {})
            entry[(metric, p["layout"], p["variant"])] = (r["ours"], r["ratio"])
            entry["cudnn" if metric == "load_time_ms" else "cudnn_graph"] = r["peer_value"]
    if loads:
        keys = list(LOAD_VARIANTS)
        lines.append("\nloads: eager ms (cudnn/variant) per layout/variant; graph ms where timed")
        lines.append(f"{'B':>3} {'Hkv':>4} {'L':>6} {'cudnn':>7} " + " ".join(f"{l}:{v}".rjust(25) for l, v in keys))
        for (batch, kv_heads, context), entry in sorted(loads.items()):
            for metric, label in (("load_time_ms", "cudnn"), ("load_graph_time_ms", "cudnn_graph")):
                if not any((metric, *k) in entry for k in keys):
                    continue
                cells = []
                for k in keys:
                    ms, ratio = entry.get((metric, *k), (None, None))
                    cells.append(f"{f(ms, '{:.4f}')}({f(ratio, '{:.3f}')})".rjust(25))
                lines.append(f"{batch:>3} {kv_heads:>4} {context:>6} {f(entry.get(label), '{:.4f}'):>7} "
                             + " ".join(cells) + ("" if metric == "load_time_ms" else "  graph"))
    for (batch, kv_heads, context), entry in sorted(sweeps.items()):
        picks = ", ".join(f"{rule}={s}" for rule, s in entry["rules"].items())
        lines.append(f"\nsplit sweep B={batch} Hkv={kv_heads} L={context} ({picks}), ms per S:")
        for metric, label in (("time_ms", "eager"), ("graph_time_ms", "graph")):
            if entry.get(metric):
                lines.append(f"  {label}: " + " ".join(f"{s}:{f(ms)}" for s, ms in sorted(entry[metric].items())))
    return "\n".join(lines)


if __name__ == "__main__":
    from bench.run import main

    raise SystemExit(main(["--only", BENCHMARK]))
