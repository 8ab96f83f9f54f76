"""Chapter 2 benchmark: one decode step's attention over the KV cache, and the cache write.

Peers, measured in the same run on the same random inputs (all sequences at length L):

- ``sdpa_default``: ``F.scaled_dot_product_attention(q, k, v, enable_gqa=…)`` with a query
  of length 1 (``q: [B, H, 1, D]``, K/V the cache ``[B, Hkv, L, D]``), PyTorch choosing
  the backend as it would in a model's decode step;
- ``sdpa_flash``: the same call pinned to ``SDPBackend.FLASH_ATTENTION``; if PyTorch refuses
  that backend for these inputs, pinned to ``EFFICIENT_ATTENTION`` instead and recorded as
  ``sdpa_efficient`` (the note says why flash was refused);
- for the write: ``torch_index_put`` (``k_cache[b_idx, :, pos] = k_new``, the one-line
  PyTorch way, twice: K and V) and ``torch_index_copy`` (``index_copy_`` of the rows into
  the cache viewed as ``[B·Hkv·max_len, D]``, twice).

Points: bf16, head_dim 128, 32 query heads, 8 KV heads (GQA 4:1, Llama-3-8B) and 32 (MHA,
Llama-2-7B), batch 1/8/32/64, context L = 1k/4k/16k/32k; points whose K+V cache exceeds
``MAX_CACHE_BYTES`` are skipped. The sweep stops starting points after
``MINILLM_CH02_BUDGET_S`` seconds (default 120; status "partial").

Rows (``params``: batch, q_heads, kv_heads, context, head_dim, dtype; write rows have no
context but ``max_len``):

===================  ========================================================================
``oom``              True when the inputs of a point did not fit (nothing else is recorded)
``time_ms``          median time of `decode_attention`; one row per peer (sdpa_default, sdpa_flash)
``bandwidth_TBps``   `minillm.costs.decode_attention_bytes` (K and V over L, q, out, lse) / time; ours with
                     the pinned peer's value; fraction of the measured copy bandwidth (it
                     can pass 1: a copy reads and writes, this kernel almost only reads,
                     and HBM serves pure reads a little faster than a read/write mix)
``rel_err``          ‖ours − peer‖ / ‖peer‖ (fp32) against the sdpa_default output
``write_kv_time_ms``  `write_kv` of one token per sequence (each at its own random slot);
                     one row per peer (torch_index_put, torch_index_copy). A write moves a
                     few KB, so this is mostly the launch: the CPU cost of the call shows up
                     in it (the GPU waits for the launch), as it does in an eager decode step
``write_kv_graph_time_ms``  the same, per call, replaying a CUDA graph of ``GRAPH_REPEATS``
                     calls: the GPU-side time alone, without the launch overhead
===================  ========================================================================

What to expect: decode attention is memory bound, so bandwidth is the figure of merit. Our
kernel runs ``batch · kv_heads`` programs; at batch 1 with 8 KV heads that is 8 programs on
a GPU of 132 SMs, each streaming its whole sequence alone, so it reaches a small fraction of
the bandwidth at long contexts. Splitting each sequence over several programs
(flash-decoding) is the fix; this chapter's kernel is the baseline that shows why.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

from minillm.costs import decode_attention_bytes, kv_cache_bytes
from minillm.kernels.ch02_kv_cache import decode_attention, write_kv

from bench.common import (
    Results, attempt, cuda_device, dtype_name, fraction, free_memory, graph_time_ms, rel_err, sweep_start, time_sdpa,
)

BENCHMARK = "ch02_decode_attention"
Q_HEADS, HEAD_DIM = 32, 128
KV_HEADS = (8, 32)
BATCHES = (1, 8, 32, 64)
CONTEXTS = (1024, 4096, 16384, 32768)
DTYPE = torch.bfloat16
#: Skip points whose K+V cache is larger than this (bytes).
MAX_CACHE_BYTES = 40e9
#: Cache length of the write benchmark (its time does not depend on it).
WRITE_MAX_LEN = 4096
WARMUP_MS, REP_MS = 25, 100
#: Calls per CUDA graph for the launch-free write timing.
GRAPH_REPEATS = 64


def budget_s() -> float:
    """Seconds after which no new point is started: ``MINILLM_CH02_BUDGET_S`` (default 120)."""
    return float(os.environ.get("MINILLM_CH02_BUDGET_S", "120"))


# ----------------------------------------------------------------------------------------
# Peers (`time_sdpa`: bench.common)
# ----------------------------------------------------------------------------------------
def pinned_peer(q, k, v, timer: Callable) -> tuple[str, tuple[float, torch.Tensor] | None, str | None]:
    """The flash backend, or the memory-efficient one if flash refuses these inputs.
    Returns ``(peer name, (ms, out) or None, note)``."""
    from torch.nn.attention import SDPBackend

    res, status = attempt(lambda: time_sdpa(q, k, v, SDPBackend.FLASH_ATTENTION, timer), allow_errors=True)
    if res is not None or status == "oom":
        return "sdpa_flash", res, status
    res, status2 = attempt(lambda: time_sdpa(q, k, v, SDPBackend.EFFICIENT_ATTENTION, timer), allow_errors=True)
    note = f"flash refused ({status})" + (f"; efficient {status2}" if status2 else "")
    return "sdpa_efficient", res, note


# ----------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------
def run(results: Results, device) -> None:
    """Run the Chapter 2 sweep on ``device`` (CUDA) and add its rows to ``results``.

    Needs ``results.ceilings["copy_TBps"]`` for the bandwidth fractions."""
    device = cuda_device(device, "the Chapter 2 benchmark")
    sweep(results, device)


def sweep(results: Results, device, q_heads: int = Q_HEADS, kv_heads_list=KV_HEADS, batches=BATCHES,
          contexts=CONTEXTS, head_dim: int = HEAD_DIM, dtype: torch.dtype = DTYPE,
          timer: Callable[[Callable[[], Any]], float] | None = None, write_max_len: int = WRITE_MAX_LEN) -> None:
    """The loops of `run`: first the (cheap) write points, then the decode points, until the
    time budget is spent. ``timer(fn) -> ms`` defaults to `bench.common.time_ms` (CUDA only);
    the CPU tests pass a stand-in to check the bookkeeping under the interpreter."""
    timer, gen, out_of_time = sweep_start(results, BENCHMARK, device, budget_s(), timer, WARMUP_MS, REP_MS)
    copy_tbps = (results.ceilings or {}).get("copy_TBps")

    for kv_heads in kv_heads_list:
        for batch in batches:
            if out_of_time():
                return
            _run_write_point(results, device, gen, batch, kv_heads, head_dim, dtype, write_max_len, timer)

    for kv_heads in kv_heads_list:
        for batch in batches:
            for context in contexts:
                if kv_cache_bytes(batch * context, kv_heads, head_dim, dtype.itemsize) > MAX_CACHE_BYTES:
                    continue
                if out_of_time():
                    return
                t0 = time.perf_counter()
                _run_decode_point(results, device, gen, batch, q_heads, kv_heads, context, head_dim, dtype,
                                  copy_tbps, timer)
                print(f"  [{BENCHMARK}] kv_heads={kv_heads} batch={batch} L={context}: "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)


def _run_decode_point(results: Results, device, gen, batch: int, q_heads: int, kv_heads: int, context: int,
                      head_dim: int, dtype: torch.dtype, copy_tbps, timer) -> None:
    params = {"batch": batch, "q_heads": q_heads, "kv_heads": kv_heads, "context": context,
              "head_dim": head_dim, "dtype": dtype_name(dtype)}
    add = lambda *a, **kw: results.add(BENCHMARK, params, *a, **kw)  # noqa: E731

    def make():
        q = torch.randn(batch, q_heads, head_dim, device=device, dtype=dtype, generator=gen)
        k = torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=dtype, generator=gen)
        v = torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=dtype, generator=gen)
        return q, k, v

    inputs, status = attempt(make)
    if inputs is None:
        add("oom", True, note=f"inputs ({kv_cache_bytes(batch * context, kv_heads, head_dim, dtype.itemsize) / 1e9:.1f}"
                              " GB of cache) did not fit")
        return
    q, k, v = inputs
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out = torch.empty(batch, q_heads, head_dim, device=device, dtype=dtype)
    lse = torch.empty(batch, q_heads, device=device, dtype=torch.float32)

    def ours_call():
        return decode_attention(q, k, v, lens, out=out, lse=lse)

    ours_call()
    ours_ms = timer(ours_call)

    default, default_status = attempt(lambda: time_sdpa(q, k, v, None, timer), allow_errors=True)
    pinned_name, pinned, pinned_note = pinned_peer(q, k, v, timer)

    n_bytes = decode_attention_bytes([context] * batch, q_heads, kv_heads, head_dim, dtype.itemsize)
    tbps = lambda ms: n_bytes / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    add("time_ms", ours_ms, "sdpa_default", default[0] if default else None, note=default_status)
    add("time_ms", ours_ms, pinned_name, pinned[0] if pinned else None, note=pinned_note)
    add("bandwidth_TBps", tbps(ours_ms), pinned_name, tbps(pinned[0]) if pinned else None,
        fraction_of_ceiling=fraction(tbps(ours_ms), copy_tbps),
        note="decode_attention_bytes (K, V over the context; q, out, lse) / time")
    ref_name, ref = ("sdpa_default", default) if default else (pinned_name, pinned)
    if ref is not None:
        add("rel_err", rel_err(out, ref[1]), ref_name, None)
    del q, k, v, default, pinned, ref, out, lse
    free_memory()


def _run_write_point(results: Results, device, gen, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                     max_len: int, timer) -> None:
    """One decode step's cache write: one new token per sequence, at a random slot of each."""
    params = {"batch": batch, "kv_heads": kv_heads, "max_len": max_len, "head_dim": head_dim,
              "dtype": dtype_name(dtype)}
    k_cache = torch.randn(batch, kv_heads, max_len, head_dim, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(batch, kv_heads, max_len, head_dim, device=device, dtype=dtype, generator=gen)
    k_new = torch.randn(batch, kv_heads, 1, head_dim, device=device, dtype=dtype, generator=gen)
    v_new = torch.randn(batch, kv_heads, 1, head_dim, device=device, dtype=dtype, generator=gen)
    slots = torch.randint(0, max_len, (batch, 1), device=device, dtype=torch.int32, generator=gen)

    b_idx = torch.arange(batch, device=device)
    pos = slots[:, 0].long()
    k_rows, v_rows = k_new[:, :, 0], v_new[:, :, 0]  # [B, Hkv, D]
    # Row of (b, h, pos[b]) in the cache viewed as [B·Hkv·max_len, D].
    flat_rows = ((b_idx[:, None] * kv_heads + torch.arange(kv_heads, device=device)) * max_len + pos[:, None]).reshape(-1)
    k_flat, v_flat = k_cache.view(-1, head_dim), v_cache.view(-1, head_dim)
    k_rows_flat, v_rows_flat = k_rows.reshape(-1, head_dim), v_rows.reshape(-1, head_dim)

    def ours():
        write_kv(k_cache, v_cache, k_new, v_new, slots)

    def index_put():
        k_cache[b_idx, :, pos] = k_rows
        v_cache[b_idx, :, pos] = v_rows

    def index_copy():
        k_flat.index_copy_(0, flat_rows, k_rows_flat)
        v_flat.index_copy_(0, flat_rows, v_rows_flat)

    # The three must agree (a cheap guard that the peers do the same work).
    ours()
    if not (torch.equal(k_cache[b_idx, :, pos], k_rows) and torch.equal(v_cache[b_idx, :, pos], v_rows)):
        raise AssertionError("write_kv did not store the new rows at their slots")
    ours_ms = timer(ours)
    peers = (("torch_index_put", index_put), ("torch_index_copy", index_copy))
    for name, fn in peers:
        peer_ms, status = attempt(lambda: timer(fn), allow_errors=True)
        results.add(BENCHMARK, params, "write_kv_time_ms", ours_ms, name, peer_ms, note=status)
    if torch.device(device).type == "cuda":  # CUDA graphs: GPU time without the launch
        ours_graph_ms, ours_status = attempt(lambda: graph_time_ms(ours, GRAPH_REPEATS, timer), allow_errors=True)
        for name, fn in peers:
            peer_ms, status = attempt(lambda: graph_time_ms(fn, GRAPH_REPEATS, timer), allow_errors=True)
            note = "; ".join(f"{who} {st}" for who, st in (("ours", ours_status), (name, status)) if st) or None
            results.add(BENCHMARK, params, "write_kv_graph_time_ms", ours_graph_ms, name, peer_ms, note=note)
    del k_cache, v_cache, k_flat, v_flat
    free_memory()


# ----------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------
def summary(results: Results | dict) -> str:
    """Compact text tables: decode time per point against both peers with our bandwidth, and
    the write times."""
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    t: dict[tuple, dict] = {}
    for r in select(data, BENCHMARK, "time_ms"):
        p = r["params"]
        key = (p["kv_heads"], p["batch"], p["context"])
        t.setdefault(key, {})["ours"] = r["ours"]
        t[key]["pinned" if r["peer"] != "sdpa_default" else "default"] = r["peer_value"]
    for r in select(data, BENCHMARK, "bandwidth_TBps"):
        p = r["params"]
        key = (p["kv_heads"], p["batch"], p["context"])
        t.setdefault(key, {}).update(bw=r["ours"], frac=r["fraction_of_ceiling"])
    for r in select(data, BENCHMARK, "oom"):
        p = r["params"]
        t.setdefault((p["kv_heads"], p["batch"], p["context"]), {})["oom"] = True

    def f(x, fmt="{:.3f}"):
        return "—" if x is None else fmt.format(x)

    def ratio(peer, ours):
        return f"{peer / ours:.2f}" if peer and ours else "—"

    lines = [f"{'Hkv':>4} {'B':>3} {'L':>6} {'ours ms':>9} {'dflt ms':>9} {'flash ms':>9} "
             f"{'dflt/ours':>9} {'flash/ours':>10} {'TB/s':>6} {'of copy':>7}"]
    for key in sorted(t):
        row = t[key]
        if row.get("oom"):
            lines.append(f"{key[0]:>4} {key[1]:>3} {key[2]:>6}  OOM (inputs)")
            continue
        o, d, p = row.get("ours"), row.get("default"), row.get("pinned")
        lines.append(f"{key[0]:>4} {key[1]:>3} {key[2]:>6} {f(o):>9} {f(d):>9} {f(p):>9} "
                     f"{ratio(d, o):>9} {ratio(p, o):>10} {f(row.get('bw'), '{:.2f}'):>6} "
                     f"{f(row.get('frac'), '{:.0%}'):>7}")

    w: dict[tuple, dict] = {}
    for metric, tag in (("write_kv_time_ms", ""), ("write_kv_graph_time_ms", "graph ")):
        for r in select(data, BENCHMARK, metric):
            p = r["params"]
            row = w.setdefault((p["kv_heads"], p["batch"]), {})
            row[tag + "ours"] = r["ours"]
            row[tag + r["peer"]] = r["peer_value"]
    if w:
        cols = [("ours", "write_kv"), ("torch_index_put", "index_put"), ("torch_index_copy", "index_copy")]
        lines.append("")
        lines.append("write of one token per sequence, us (eager call | per call in a CUDA graph)")
        lines.append(f"{'Hkv':>4} {'B':>3} " + " ".join(f"{label:>10} {'graph':>6}" for _, label in cols))
        us = lambda x: f(x * 1e3 if x is not None else None, "{:.1f}")  # noqa: E731
        for (hkv, b), row in sorted(w.items()):
            lines.append(f"{hkv:>4} {b:>3} " + " ".join(f"{us(row.get(key)):>10} {us(row.get('graph ' + key)):>6}"
                                                      for key, _ in cols))
    return "\n".join(lines)


if __name__ == "__main__":
    from bench.run import main

    raise SystemExit(main(["--only", BENCHMARK]))
