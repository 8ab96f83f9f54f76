"""Chapter 7 benchmark, Gluon: flash-decoding with a loader warp and bulk copies, on an sm_90 GPU.

At every decode point of ``bench/ch07_flash_decoding.py`` (bf16, head dim 128, 32 query heads
over 8 or 32 KV heads, batch 1/8/32, contexts 4k/32k/128k, 16-token blocks in a shuffled
pool), in the same process and on the same values:

- ``gluon``: `flash_decode_attention_gluon` with its defaults (persistent programs, one per SM;
  units of work with `plan_splits`'s split count);
- ``gluon_line``: the same kernel on the balanced schedule (``schedule="line"``: the work
  line cut into one equal chunk per program), which measures what balancing buys;
- ``gluon_wave_splits``: the units with the Triton kernel's split count
  (`num_splits_heuristic`), which separates the kernel from the split plan;
- ``gluon_merge_launch``: the default kernel with its splits merged by a second launch
  (``merge="launch"``, Chapter 7's stage 2) instead of by each unit's last program, at the
  points where the plan splits; ``gluon_st2_merge_launch`` the same with a ring of 2 slots
  instead of 3;
- ``gluon_hnd``: the default kernel on the same values in a head-major pool (``kv_layout="HND"``:
  ``[num_blocks, kv_heads, block_size, head_dim]``, one KV head's 16 keys one run of 4 KB
  instead of 16 rows of 256 bytes ``kv_heads · 256`` bytes apart), the same tables;
- ``triton``: `flash_decode_attention`, Chapter 7's kernel with its defaults;
- the peers on a contiguous cache of the same values: SDPA pinned to cuDNN and to
  FlashAttention-2 (``sdpa_cudnn``, ``sdpa_flash``).

The paged kernels are timed taking turns (`bench.common.interleaved_times`, the median
of ``MINILLM_CH07_GLUON_ROUNDS`` rounds, default 3), so that a difference of a few percent
is not clock drift; SDPA is timed on its own cache before the pool is built (the two layouts
of the largest point do not fit together). Where the head-major copy of the pool does not
fit beside it, the pool is converted one tensor at a time after the others were timed, and
``gluon_hnd`` is timed alone (its rows say so). Caches of at most ``GRAPH_MAX_CACHE_BYTES`` are
also timed replaying a CUDA graph (the GPU's time without launch overhead).

Rows (``params``: kind "decode", batch, q_heads, kv_heads, context, head_dim, dtype,
block_size, blocks, kernel, num_splits; None for the line):

==================  ========================================================================
``time_ms``         kernel ``gluon``: one row per peer (sdpa_cudnn, sdpa_flash, triton),
                    ratio = peer / ours (> 1: the Gluon kernel is faster); kernels
                    ``gluon_line``, ``gluon_wave_splits``, ``gluon_merge_launch``,
                    ``gluon_st2_merge_launch`` and ``gluon_hnd`` against ``gluon``; ``gluon_hnd``
                    and the two merge launches against ``sdpa_cudnn`` too; kernel ``triton`` against
                    ``sdpa_cudnn`` (the same run's reading of the chapter's kernel)
``graph_time_ms``   the same pairs as CUDA-graph times, where measured
``bandwidth_TBps``  useful bytes (`minillm.costs.paged_decode_attention_bytes`) / time of
                    ``gluon``, ``gluon_hnd`` and ``triton`` (eager, and graph time where
                    measured), fraction of the measured copy bandwidth
``rel_err``         ‖gluon − SDPA‖ / ‖SDPA‖ (the first SDPA backend that ran) and against
                    the Triton kernel's output; ``gluon_hnd`` against ``gluon`` (the same
                    arithmetic in the same order: 0 unless the layouts' reads differ);
                    the two merge launches against ``gluon`` (another merge's rounding)
==================  ========================================================================

The sweep stops starting points after ``MINILLM_CH07_GLUON_BUDGET_S`` seconds (default 240).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

from minillm.costs import kv_cache_bytes, paged_decode_attention_bytes
from minillm.kernels.ch05_paged_attention import decode_block_n
from minillm.kernels.ch07_flash_decoding import flash_decode_attention, num_sms, num_splits_heuristic
from minillm.kernels.ch07_flash_decoding_gluon import (
    NUM_STAGES, flash_decode_attention_gluon, gluon_decode_applies, plan_splits, to_head_major,
)

from bench.ch07_flash_decoding import (
    BATCHES, BLOCK_SIZE, CONTEXTS, DTYPE, GRAPH_MAX_CACHE_BYTES, GRAPH_REPEATS, HEAD_DIM, KV_HEADS,
    MAX_CACHE_BYTES, Q_HEADS, REP_MS, WARMUP_MS, sdpa_peers,
)
from bench.common import (
    Results, attempt, cuda_device, dtype_name, fraction, free_device_bytes, free_memory, graph_time_ms,
    interleaved_times, paged_cache, rel_err, sweep_start,
)

BENCHMARK = "ch07_gluon"
PEERS = ("sdpa_cudnn", "sdpa_flash", "triton")
#: The kernels whose splits a second launch merges: name -> ring slots.
MERGE_LAUNCHES = {"gluon_merge_launch": NUM_STAGES, "gluon_st2_merge_launch": 2}
#: Head room asked of the GPU's free memory for building the head-major pool beside the other.
HND_MEMORY_MARGIN = 1.1


def budget_s() -> float:
    """Seconds after which no new point is started: ``MINILLM_CH07_GLUON_BUDGET_S`` (default 240)."""
    return float(os.environ.get("MINILLM_CH07_GLUON_BUDGET_S", "240"))


def timing_rounds() -> int:
    """Rounds of the interleaved timing (their median): ``MINILLM_CH07_GLUON_ROUNDS`` (default 3)."""
    return max(1, int(os.environ.get("MINILLM_CH07_GLUON_ROUNDS", "3")))


def run(results: Results, device) -> None:
    """Every decode point on ``device`` (an sm_90 GPU) until the budget is spent; elsewhere nothing."""
    device = cuda_device(device, "the Chapter 7 Gluon benchmark")
    q = torch.empty(1, 8, HEAD_DIM, device=device, dtype=DTYPE)
    pool = torch.empty(1, BLOCK_SIZE, 2, HEAD_DIM, device=device, dtype=DTYPE)
    if not gluon_decode_applies(q, pool, pool):
        print(f"  [{BENCHMARK}] needs an sm_90 GPU: nothing measured", flush=True)
        return
    sweep(results, device)


def sweep(results: Results, device, points=None, timer: Callable[[Callable[[], Any]], float] | None = None) -> None:
    timer, tables_gen, out_of_time = sweep_start(results, BENCHMARK, device, budget_s(), timer, WARMUP_MS, REP_MS)
    copy_tbps = (results.ceilings or {}).get("copy_TBps")
    if points is None:
        points = sorted(((b, kv, L) for kv in KV_HEADS for b in BATCHES for L in CONTEXTS
                         if kv_cache_bytes(b * L, kv, HEAD_DIM, DTYPE.itemsize) <= MAX_CACHE_BYTES),
                        key=lambda p: (p[0] * p[1] * p[2], p))
    for batch, kv_heads, context in points:
        if out_of_time():
            return
        t0 = time.perf_counter()
        _point(results, device, batch, kv_heads, context, timer, tables_gen, copy_tbps)
        free_memory()
        print(f"  [{BENCHMARK}] decode B={batch} Hkv={kv_heads} L={context}: {time.perf_counter() - t0:.1f} s",
              flush=True)


def _point(results: Results, device, batch: int, kv_heads: int, context: int, timer, tables_gen, copy_tbps) -> None:
    seed = 7919 * batch + 131 * kv_heads + context  # Chapter 7's benchmark's seed for the point: the same values
    sms = num_sms(device)
    wave_splits = num_splits_heuristic(batch, kv_heads, context, sms, decode_block_n(HEAD_DIM, DTYPE))
    plan = plan_splits(batch, kv_heads, context, sms)
    base = {"kind": "decode", "batch": batch, "q_heads": Q_HEADS, "kv_heads": kv_heads, "context": context,
            "head_dim": HEAD_DIM, "dtype": dtype_name(DTYPE), "block_size": BLOCK_SIZE, "blocks": "shuffled"}
    n_bytes = paged_decode_attention_bytes([context] * batch, Q_HEADS, kv_heads, HEAD_DIM, DTYPE.itemsize, BLOCK_SIZE)
    tbps = lambda ms: n_bytes / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    use_graphs = kv_cache_bytes(batch * context, kv_heads, HEAD_DIM, DTYPE.itemsize) <= GRAPH_MAX_CACHE_BYTES

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=device, dtype=DTYPE, generator=gen)
    sdpa, sdpa_out, graph_ms = sdpa_peers(q, seed, batch, kv_heads, context, HEAD_DIM, DTYPE, device, timer,
                                          use_graphs)
    free_memory()
    inputs, status = attempt(lambda: paged_cache(seed, batch, kv_heads, context, HEAD_DIM, BLOCK_SIZE, DTYPE, device,
                                                 tables_gen))
    if inputs is None:
        results.add(BENCHMARK, {**base, "kernel": "gluon"}, "oom", True, note=f"paged inputs: {status}")
        return
    pools = {"NHD": inputs[:2]}
    tables = inputs[2]
    del inputs
    pool_bytes = 2 * pools["NHD"][0].numel() * pools["NHD"][0].element_size()
    hnd_together = pool_bytes * HND_MEMORY_MARGIN < free_device_bytes(device)
    if hnd_together:
        pools["HND"] = tuple(to_head_major(p) for p in pools["NHD"])
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    outs = {name: torch.empty(batch, Q_HEADS, HEAD_DIM, device=device, dtype=DTYPE) for name in
            ("gluon", "gluon_line", "gluon_wave_splits", *MERGE_LAUNCHES, "triton", "gluon_hnd")}
    lse = torch.empty(batch, Q_HEADS, device=device, dtype=torch.float32)
    hnd_call = lambda: flash_decode_attention_gluon(q, *pools["HND"], tables, lens, num_splits=plan,  # noqa: E731
                                                    kv_layout="HND", out=outs["gluon_hnd"], lse=lse)
    k_pool, v_pool = pools["NHD"]
    calls = {
        "gluon": lambda: flash_decode_attention_gluon(q, k_pool, v_pool, tables, lens, num_splits=plan,
                                                      out=outs["gluon"], lse=lse),
        "gluon_line": lambda: flash_decode_attention_gluon(q, k_pool, v_pool, tables, lens, schedule="line",
                                                           out=outs["gluon_line"], lse=lse),
        "gluon_wave_splits": lambda: flash_decode_attention_gluon(q, k_pool, v_pool, tables, lens,
                                                                  num_splits=wave_splits,
                                                                  out=outs["gluon_wave_splits"], lse=lse),
        "triton": lambda: flash_decode_attention(q, k_pool, v_pool, tables, lens, num_splits=wave_splits,
                                                 out=outs["triton"], lse=lse),
    }
    if plan > 1:
        for name, stages in MERGE_LAUNCHES.items():
            calls[name] = lambda name=name, stages=stages: flash_decode_attention_gluon(
                q, k_pool, v_pool, tables, lens, num_splits=plan, merge="launch", num_stages=stages, out=outs[name],
                lse=lse)
    if hnd_together:
        calls["gluon_hnd"] = hnd_call
    eager = interleaved_times(calls, timer, timing_rounds())
    if use_graphs:
        for name, fn in calls.items():
            graph_ms[name] = graph_time_ms(fn, GRAPH_REPEATS, timer)
    if not hnd_together:  # convert one tensor at a time: the NHD pool goes as the HND one comes
        del calls, k_pool, v_pool
        nhd, hnd = list(pools.pop("NHD")), []
        while nhd:
            hnd.append(to_head_major(nhd.pop(0)))
            free_memory()
        pools["HND"] = tuple(hnd)
        hnd_call()
        eager["gluon_hnd"] = timer(hnd_call)
    hnd_note = None if hnd_together else "timed alone, after the others (the two pools do not fit together)"
    eager.update({name: sdpa[name][0] for name in ("sdpa_cudnn", "sdpa_flash")})

    def add(kernel, metric, ours, peer, peer_value, **kw):
        splits = {"gluon": plan, "gluon_line": None, "gluon_wave_splits": wave_splits, "triton": wave_splits,
                  "gluon_hnd": plan, **dict.fromkeys(MERGE_LAUNCHES, plan)}[kernel]
        results.add(BENCHMARK, {**base, "kernel": kernel, "num_splits": splits}, metric, ours, peer, peer_value, **kw)

    for peer in PEERS:
        add("gluon", "time_ms", eager["gluon"], peer, eager[peer], note=sdpa[peer][1] if peer in sdpa else None)
        if use_graphs:
            add("gluon", "graph_time_ms", graph_ms["gluon"], peer, graph_ms.get(peer),
                note=f"per call, replaying a CUDA graph of {GRAPH_REPEATS} calls")
    for other in ("gluon_line", "gluon_wave_splits", *MERGE_LAUNCHES, "gluon_hnd"):
        if other not in eager:
            continue
        add(other, "time_ms", eager[other], "gluon", eager["gluon"], note=hnd_note if other == "gluon_hnd" else None)
        if use_graphs and other in graph_ms:
            add(other, "graph_time_ms", graph_ms[other], "gluon", graph_ms["gluon"])
    for name in MERGE_LAUNCHES:
        if name in eager:
            add(name, "time_ms", eager[name], "sdpa_cudnn", eager["sdpa_cudnn"])
            if use_graphs:
                add(name, "graph_time_ms", graph_ms[name], "sdpa_cudnn", graph_ms.get("sdpa_cudnn"))
    add("gluon_hnd", "time_ms", eager["gluon_hnd"], "sdpa_cudnn", eager["sdpa_cudnn"], note=hnd_note)
    if use_graphs and "gluon_hnd" in graph_ms:
        add("gluon_hnd", "graph_time_ms", graph_ms["gluon_hnd"], "sdpa_cudnn", graph_ms.get("sdpa_cudnn"))
    add("triton", "time_ms", eager["triton"], "sdpa_cudnn", eager["sdpa_cudnn"])
    if use_graphs:
        add("triton", "graph_time_ms", graph_ms["triton"], "sdpa_cudnn", graph_ms.get("sdpa_cudnn"))
    for kernel in ("gluon", "gluon_hnd", "triton"):
        add(kernel, "bandwidth_TBps", tbps(eager[kernel]), "sdpa_cudnn", tbps(eager["sdpa_cudnn"]),
            fraction_of_ceiling=fraction(tbps(eager[kernel]), copy_tbps),
            note="paged_decode_attention_bytes / eager time")
        if use_graphs and kernel in graph_ms:
            add(kernel, "graph_bandwidth_TBps", tbps(graph_ms[kernel]), "sdpa_cudnn", tbps(graph_ms.get("sdpa_cudnn")),
                fraction_of_ceiling=fraction(tbps(graph_ms[kernel]), copy_tbps),
                note="paged_decode_attention_bytes / graph time")
    add("gluon", "rel_err", rel_err(outs["gluon"], sdpa_out[1]) if sdpa_out else None, "sdpa", None,
        note=f"whole batch against {sdpa_out[0]}" if sdpa_out else "no SDPA backend ran")
    add("gluon", "rel_err", rel_err(outs["gluon"], outs["triton"]), "triton", None)
    add("gluon_hnd", "rel_err", rel_err(outs["gluon_hnd"], outs["gluon"]), "gluon", None)
    for name in MERGE_LAUNCHES:
        if name in eager:
            add(name, "rel_err", rel_err(outs[name], outs["gluon"]), "gluon", None)


def summary(results: Results | dict) -> str:
    """One line per point: the Gluon kernel's time, its ratios to cuDNN and to the Triton kernel,
    the line's time over the units' (the default's), and the head-major pool's ratio to cuDNN
    (graph time where measured)."""
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    lines = [f"{'B':>3} {'Hkv':>4} {'L':>7} {'S':>4}  gluon us  /cuDNN  /triton  triton/cuDNN  graph: /cuDNN /triton"
             "  line/units (graph)  HND/cuDNN (graph)"]
    by_point: dict[tuple, dict] = {}
    for r in select(data, BENCHMARK):
        p = r["params"]
        by_point.setdefault((p["batch"], p["kv_heads"], p["context"]), {})[(p["kernel"], r["metric"], r["peer"])] = r
    fmt = lambda r, key="ratio", f=".3f": format(r[key], f) if r and r.get(key) is not None else "—"  # noqa: E731
    for (b, kv, L), rows in sorted(by_point.items()):
        g = rows.get(("gluon", "time_ms", "sdpa_cudnn"))
        us = f"{g['ours'] * 1e3:8.1f}" if g else "       —"
        line = rows.get(("gluon_line", "graph_time_ms", "gluon")) or rows.get(("gluon_line", "time_ms", "gluon"))
        hnd = rows.get(("gluon_hnd", "graph_time_ms", "sdpa_cudnn")) or rows.get(("gluon_hnd", "time_ms", "sdpa_cudnn"))
        lines.append(f"{b:>3} {kv:>4} {L:>7} {g['params']['num_splits'] if g else '—':>4}  {us}  "
                     f"{fmt(g):>6}  {fmt(rows.get(('gluon', 'time_ms', 'triton'))):>7}  "
                     f"{fmt(rows.get(('triton', 'time_ms', 'sdpa_cudnn'))):>12}  "
                     f"{fmt(rows.get(('gluon', 'graph_time_ms', 'sdpa_cudnn'))):>13} "
                     f"{fmt(rows.get(('gluon', 'graph_time_ms', 'triton'))):>7}  "
                     f"{format(1 / line['ratio'], '.3f') if line and line.get('ratio') else '—':>18}  "
                     f"{fmt(hnd):>17}")
    return "\n".join(lines)
