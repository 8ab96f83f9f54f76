"""Chapter 5 benchmark: what paging the KV cache costs attention.

**Decode.** `paged_decode_attention` over a paged pool against *the same kernel* over a
contiguous cache (`contiguous_as_paged`: one block per sequence, ``block_size = L``), on the
same bytes: one random ``[B·L, kv_heads, head_dim]`` buffer per point, viewed as a pool of
blocks of each size in turn, and as ``[B, L, kv_heads, head_dim]`` for the contiguous peer.
Only the order in which a sequence's rows are visited differs, and the kernel's addressing
(the contiguous view takes the one-table-entry-per-tile path, since ``L`` is a multiple of
``BLOCK_N``). The blocks of the paged pool are a **random permutation** of all the pool's
blocks: consecutive blocks of a sequence are as far apart as they can be (worst-case
locality; a fresh engine hands out blocks more or less in order, a long-running one
scattered like this).

Points: bf16, head_dim 128, 32 query heads, 8 KV heads (GQA 4:1, Llama-3-8B) and 32 (MHA),
batch 1/8/32, context L = 4k/32k, block sizes 16/32/64/128/256 (vLLM's usual range) and
1/8 (the ends of the curve); every sequence at length L. Points whose K+V exceed
``MAX_CACHE_BYTES`` are skipped, and inputs that do not fit are recorded as ``oom``.

**Prefill.** `paged_prefill_attention` (new tokens over a cached paged prefix plus
themselves, causal) against Chapter 4's `flash_attention_varlen` on the same K/V stored
contiguously (packed varlen layout, ``cu_seqlens_k``; it autotunes and on Hopper loads tiles
with TMA, which the paged kernel cannot). ``PREFILL_POINTS`` (batch, cached prefix, new
tokens) cover a fresh prompt, prefix-cache hits and chunked prefill; blocks shuffled as above.

The sweep stops starting points after ``MINILLM_CH05_BUDGET_S`` seconds (default 300; status
"partial"); decode points come first.

Rows (``params``: kind = "decode" or "prefill", batch, q_heads, kv_heads, head_dim, dtype,
block_size, blocks = "shuffled"; decode: context; prefill: cached, new):

===================  ========================================================================
``oom``              True when the inputs of a point did not fit (nothing else is recorded)
``time_ms``          decode: median time of the paged call, peer ``contiguous`` (the same
                     kernel on the contiguous view of the same bytes): ratio > 1 means paged
                     is faster. Where the block size is a multiple of the kernel's
                     ``BLOCK_N`` (one table entry per tile), a second row with peer
                     ``general_path``: the same paged call forced onto the per-position path
                     (ratio > 1: the fast path pays). Prefill: peer ``flash_attention_varlen``
``bandwidth_TBps``   decode: `minillm.costs.paged_decode_attention_bytes` (K and V over the context, q, out,
                     lse, the table entries) / time; ours paged, peer contiguous; fraction of
                     the measured copy bandwidth
``TFLOPs``           prefill: 4·D·q_heads·(visible query-key pairs) / time
                     (`minillm.costs.attention_head_flops`), peer
                     flash_attention_varlen; fraction of the measured bf16 matmul rate
``rel_err``          ‖ours − ref‖ / ‖ref‖ (fp32). Decode: sequence 0 against SDPA in fp32 on
                     its gathered K/V. Prefill: against flash_attention_varlen
===================  ========================================================================

What to expect (to be measured): a tile is ``BLOCK_N`` rows of one KV head, each row
``head_dim`` contiguous elements (256 bytes), in the paged pool exactly as in the
contiguous token-major cache; paging changes which rows follow which, plus one table load
per tile (or per position, for blocks smaller than a tile) and the address arithmetic. Decode
is memory bound, so paged decode should run close to contiguous for blocks of 16 and more;
block size 1 turns every row into its own scattered 256-byte read.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

from minillm.costs import attention_head_flops, kv_cache_bytes, paged_decode_attention_bytes
from minillm.kernels.ch04_flash_attention import flash_attention_varlen
from minillm.kernels.ch05_paged_attention import (
    blocks_per_tile, contiguous_as_paged, decode_block_n, paged_decode_attention,
    paged_prefill_attention,
)

from bench.common import (
    Results, attempt, cuda_device, decode_error, dtype_name, fraction, free_memory, rel_err, shuffled_tables,
    sweep_start,
)

BENCHMARK = "ch05_paged_attention"
Q_HEADS, HEAD_DIM = 32, 128
KV_HEADS = (8, 32)
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 32768)
#: The usual range first, then the ends of the curve.
BLOCK_SIZES = (16, 32, 64, 128, 256, 1, 8)
DTYPE = torch.bfloat16
#: Skip decode points whose K+V cache is larger than this (bytes).
MAX_CACHE_BYTES = 40e9
#: Prefill points: (batch, cached prefix tokens, new tokens per sequence).
PREFILL_POINTS = (
    (4, 0, 2048),      # fresh prompts: no prefix
    (4, 4096, 512),    # prefix-cache hits: a long shared system prompt, a short question
    (16, 2048, 256),   # chunked prefill: chunks of 256 after 2k tokens
    (1, 16384, 2048),  # a long prompt's late chunk
)
PREFILL_BLOCK_SIZES = (16, 128)
PREFILL_HEADS = (32, 8)  # (q_heads, kv_heads): Llama-3-8B
WARMUP_MS, REP_MS = 25, 100


def budget_s() -> float:
    """Seconds after which no new point is started: ``MINILLM_CH05_BUDGET_S`` (default 300)."""
    return float(os.environ.get("MINILLM_CH05_BUDGET_S", "300"))


# ----------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------
def run(results: Results, device) -> None:
    """Run the Chapter 5 sweep on ``device`` (CUDA) and add its rows to ``results``.

    Needs ``results.ceilings`` (copy_TBps, bf16_matmul_TFLOPs) for the fractions."""
    device = cuda_device(device, "the Chapter 5 benchmark")
    sweep(results, device)


def sweep(results: Results, device, q_heads: int = Q_HEADS, kv_heads_list=KV_HEADS, batches=BATCHES,
          contexts=CONTEXTS, head_dim: int = HEAD_DIM, block_sizes=BLOCK_SIZES, dtype: torch.dtype = DTYPE,
          timer: Callable[[Callable[[], Any]], float] | None = None, prefill_points=PREFILL_POINTS,
          prefill_block_sizes=PREFILL_BLOCK_SIZES, prefill_heads=PREFILL_HEADS) -> None:
    """The loops of `run`: the decode points, then the prefill points, until the time budget
    is spent. ``timer(fn) -> ms`` defaults to `bench.common.time_ms` (CUDA only); the CPU
    tests pass a stand-in to check the bookkeeping under the interpreter. Every context must
    be a multiple of every block size (one buffer serves all of them)."""
    for context in contexts:
        for bs in block_sizes:
            if context % bs:
                raise ValueError(f"context {context} is not a multiple of block size {bs}")
    timer, gen, out_of_time = sweep_start(results, BENCHMARK, device, budget_s(), timer, WARMUP_MS, REP_MS)
    ceilings = results.ceilings or {}

    for kv_heads in kv_heads_list:
        for batch in batches:
            for context in contexts:
                if kv_cache_bytes(batch * context, kv_heads, head_dim, dtype.itemsize) > MAX_CACHE_BYTES:
                    continue
                if out_of_time():
                    return
                t0 = time.perf_counter()
                _run_decode_point(results, device, gen, batch, q_heads, kv_heads, context, head_dim, block_sizes,
                                  dtype, ceilings.get("copy_TBps"), timer)
                free_memory()
                print(f"  [{BENCHMARK}] decode kv_heads={kv_heads} batch={batch} L={context}: "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)

    pq, pkv = prefill_heads
    for batch, cached, new in prefill_points:
        for bs in prefill_block_sizes:
            if out_of_time():
                return
            t0 = time.perf_counter()
            _run_prefill_point(results, device, gen, batch, cached, new, pq, pkv, head_dim, bs, dtype,
                               ceilings.get("bf16_matmul_TFLOPs"), timer)
            free_memory()
            print(f"  [{BENCHMARK}] prefill batch={batch} cached={cached} new={new} block={bs}: "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)


def _run_decode_point(results: Results, device, gen, batch: int, q_heads: int, kv_heads: int, context: int,
                      head_dim: int, block_sizes, dtype: torch.dtype, copy_tbps, timer) -> None:
    """One (kv_heads, batch, context): the contiguous peer once, then every block size."""
    base = {"kind": "decode", "batch": batch, "q_heads": q_heads, "kv_heads": kv_heads, "context": context,
            "head_dim": head_dim, "dtype": dtype_name(dtype)}
    n_tokens = batch * context

    def make():
        q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
        k = torch.randn(n_tokens, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
        v = torch.randn(n_tokens, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
        return q, k, v

    inputs, _ = attempt(make)
    if inputs is None:
        gb = kv_cache_bytes(batch * context, kv_heads, head_dim, dtype.itemsize) / 1e9
        for bs in block_sizes:
            results.add(BENCHMARK, {**base, "block_size": bs, "blocks": "shuffled"}, "oom", True,
                        note=f"inputs ({gb:.1f} GB of cache) did not fit")
        return
    q, k_flat, v_flat = inputs
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out = torch.empty(batch, q_heads, head_dim, device=device, dtype=dtype)
    lse = torch.empty(batch, q_heads, device=device, dtype=torch.float32)

    # The contiguous peer: the same bytes as [B, L, Hkv, D], one block per sequence.
    k_contig, tables_contig = contiguous_as_paged(k_flat.view(batch, context, kv_heads, head_dim))
    v_contig, _ = contiguous_as_paged(v_flat.view(batch, context, kv_heads, head_dim))

    def contig_call():
        return paged_decode_attention(q, k_contig, v_contig, tables_contig, lens, out=out, lse=lse)

    contig_call()
    contig_ms = timer(contig_call)
    bytes_of = lambda bs: paged_decode_attention_bytes([context] * batch, q_heads, kv_heads, head_dim,  # noqa: E731
                                                       dtype.itemsize, bs)
    tbps = lambda ms, bs: bytes_of(bs) / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    contig_tbps = tbps(contig_ms, context)
    block_n = decode_block_n(head_dim, dtype)

    for bs in block_sizes:
        params = {**base, "block_size": bs, "blocks": "shuffled"}
        add = lambda *a, **kw: results.add(BENCHMARK, params, *a, **kw)  # noqa: E731
        k_pool = k_flat.view(n_tokens // bs, bs, kv_heads, head_dim)
        v_pool = v_flat.view(n_tokens // bs, bs, kv_heads, head_dim)
        tables = shuffled_tables(batch, context // bs, device, gen)

        def paged_call(path=None):
            return paged_decode_attention(q, k_pool, v_pool, tables, lens, out=out, lse=lse, tile_in_block=path)

        paged_call()
        err = decode_error(q, k_pool, v_pool, tables, context, out)
        paged_ms = timer(paged_call)
        note = "same kernel on the contiguous view of the same bytes; blocks randomly permuted"
        add("time_ms", paged_ms, "contiguous", contig_ms, note=note)
        n_per_tile = blocks_per_tile(bs, block_n, None)
        if n_per_tile:  # a special tile path ran: what does it buy over the general one?
            general_ms = timer(lambda: paged_call(False))
            what = (f"block_size is a multiple of BLOCK_N={block_n}: one table entry per tile" if n_per_tile == 1
                    else f"BLOCK_N={block_n} is {n_per_tile} whole blocks: {n_per_tile} table entries per tile")
            add("time_ms", paged_ms, "general_path", general_ms, note=f"{what} vs one per position")
        add("bandwidth_TBps", tbps(paged_ms, bs), "contiguous", contig_tbps,
            fraction_of_ceiling=fraction(tbps(paged_ms, bs), copy_tbps),
            note="paged_decode_attention_bytes (K, V over the context; q, out, lse; table) / time")
        add("rel_err", err, "sdpa_fp32 (sequence 0)", None)


def _run_prefill_point(results: Results, device, gen, batch: int, cached: int, new: int, q_heads: int,
                       kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, mm_tflops, timer) -> None:
    params = {"kind": "prefill", "batch": batch, "cached": cached, "new": new, "q_heads": q_heads,
              "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype_name(dtype), "block_size": block_size,
              "blocks": "shuffled"}
    add = lambda *a, **kw: results.add(BENCHMARK, params, *a, **kw)  # noqa: E731
    kv_len = cached + new
    blocks_per_seq = -(-kv_len // block_size)

    def make():
        q = torch.randn(batch * new, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
        k = torch.randn(batch * kv_len, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
        v = torch.randn(batch * kv_len, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
        pool_shape = (batch * blocks_per_seq, block_size, kv_heads, head_dim)
        return q, k, v, torch.zeros(pool_shape, device=device, dtype=dtype), torch.zeros(pool_shape, device=device,
                                                                                           dtype=dtype)

    inputs, _ = attempt(make)
    if inputs is None:
        add("oom", True, note="inputs did not fit")
        return
    q, k, v, k_pool, v_pool = inputs
    tables = shuffled_tables(batch, blocks_per_seq, device, gen)
    # Scatter the packed K/V into the pool: token p of sequence b to its slot.
    pos = torch.arange(kv_len, device=device)
    slots = (tables.long()[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
    k_pool.view(-1, kv_heads, head_dim)[slots] = k
    v_pool.view(-1, kv_heads, head_dim)[slots] = v
    cu_q = torch.arange(0, batch * new + 1, new, device=device, dtype=torch.int32)
    cu_k = torch.arange(0, batch * kv_len + 1, kv_len, device=device, dtype=torch.int32)
    lens = torch.full((batch,), kv_len, dtype=torch.int32, device=device)

    def ours():
        return paged_prefill_attention(q, cu_q, k_pool, v_pool, tables, lens, new)[0]

    def peer():
        return flash_attention_varlen(q, k, v, cu_q, cu_k, new, kv_len, causal=True)

    ours_out, peer_out = ours(), peer()
    ours_ms = timer(ours)
    peer_ms, status = attempt(lambda: timer(peer), allow_errors=True)
    flops = batch * q_heads * attention_head_flops(new, cached + new, head_dim)  # causal, bottom-right aligned
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    note = "; ".join(x for x in ("varlen: contiguous packed K/V, autotuned (TMA on Hopper)", status) if x)
    add("time_ms", ours_ms, "flash_attention_varlen", peer_ms, note=note)
    add("TFLOPs", tflops(ours_ms), "flash_attention_varlen", tflops(peer_ms),
        fraction_of_ceiling=fraction(tflops(ours_ms), mm_tflops), note="4·D·H·(visible causal pairs) / time")
    add("rel_err", rel_err(ours_out, peer_out), "flash_attention_varlen", None)


# ----------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------
def summary(results: Results | dict) -> str:
    """Decode: per (kv_heads, batch, context), the contiguous time and bandwidth, then
    ``contiguous_ms / paged_ms`` per block size (> 1: paged faster). Prefill: one line per
    point and block size against flash_attention_varlen."""
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    dec: dict[tuple, dict] = {}
    sizes: set[int] = set()
    for r in select(data, BENCHMARK, "time_ms", kind="decode"):
        p = r["params"]
        row = dec.setdefault((p["kv_heads"], p["batch"], p["context"]), {})
        if r["peer"] == "contiguous":
            row["contig"] = r["peer_value"]
            row[p["block_size"]] = r["ratio"]
            sizes.add(p["block_size"])
    for r in select(data, BENCHMARK, "bandwidth_TBps", kind="decode"):
        p = r["params"]
        row = dec.setdefault((p["kv_heads"], p["batch"], p["context"]), {})
        if r["peer_value"] and r["ours"] and r["fraction_of_ceiling"]:
            row["contig_frac"] = r["fraction_of_ceiling"] * r["peer_value"] / r["ours"]
    for r in select(data, BENCHMARK, "oom", kind="decode"):
        p = r["params"]
        dec.setdefault((p["kv_heads"], p["batch"], p["context"]), {})["oom"] = True

    def f(x, fmt="{:.3f}"):
        return "—" if x is None else fmt.format(x)

    cols = sorted(sizes)
    lines = [f"{'Hkv':>4} {'B':>3} {'L':>6} {'contig ms':>9} {'of copy':>7} | "
             + " ".join(f"{'bs' + str(bs):>6}" for bs in cols) + "   (contiguous_ms / paged_ms)"]
    for key in sorted(dec):
        row = dec[key]
        if row.get("oom"):
            lines.append(f"{key[0]:>4} {key[1]:>3} {key[2]:>6}  OOM (inputs)")
            continue
        lines.append(f"{key[0]:>4} {key[1]:>3} {key[2]:>6} {f(row.get('contig')):>9} "
                     f"{f(row.get('contig_frac'), '{:.0%}'):>7} | "
                     + " ".join(f"{f(row.get(bs), '{:.2f}'):>6}" for bs in cols))

    paths = [r for r in select(data, BENCHMARK, "time_ms", kind="decode") if r["peer"] == "general_path"]
    if paths:
        lines.append("")
        lines.append("one table entry per tile vs the general path (general_ms / fast_ms; > 1: the fast path pays)")
        lines.append(f"{'Hkv':>4} {'B':>3} {'L':>6} {'bs':>4} {'fast ms':>9} {'general ms':>10} {'ratio':>6}")
        for r in sorted(paths, key=lambda r: (r["params"]["kv_heads"], r["params"]["batch"], r["params"]["context"],
                                              r["params"]["block_size"])):
            p = r["params"]
            lines.append(f"{p['kv_heads']:>4} {p['batch']:>3} {p['context']:>6} {p['block_size']:>4} {f(r['ours']):>9} "
                         f"{f(r['peer_value']):>10} {f(r['ratio'], '{:.2f}'):>6}")

    pre = select(data, BENCHMARK, "time_ms", kind="prefill")
    if pre:
        tf = {(tuple(sorted(r["params"].items()))): r for r in select(data, BENCHMARK, "TFLOPs", kind="prefill")}
        lines.append("")
        lines.append(f"{'B':>3} {'cached':>6} {'new':>5} {'bs':>4} {'paged ms':>9} {'varlen ms':>9} "
                     f"{'varlen/paged':>12} {'paged TF':>8} {'of mm':>6}")
        for r in sorted(pre, key=lambda r: (r["params"]["batch"], r["params"]["cached"], r["params"]["new"],
                                            r["params"]["block_size"])):
            p = r["params"]
            t = tf.get(tuple(sorted(p.items())), {})
            lines.append(f"{p['batch']:>3} {p['cached']:>6} {p['new']:>5} {p['block_size']:>4} {f(r['ours']):>9} "
                         f"{f(r['peer_value']):>9} {f(r['ratio'], '{:.2f}'):>12} {f(t.get('ours'), '{:.1f}'):>8} "
                         f"{f(t.get('fraction_of_ceiling'), '{:.0%}'):>6}")
    return "\n".join(lines)


if __name__ == "__main__":
    from bench.run import main

    raise SystemExit(main(["--only", BENCHMARK]))
