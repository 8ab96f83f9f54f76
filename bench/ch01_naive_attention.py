"""Chapter 1 benchmark: the three-kernel naive attention against PyTorch's SDPA.

Peers, measured in the same run on the same random inputs:

- ``sdpa_math``: ``F.scaled_dot_product_attention`` under ``SDPBackend.MATH``, PyTorch's
  composite "textbook" implementation (the fair peer: it also materialises the N×N scores;
  by default it computes bf16 inputs in fp32 internally, see ``MATH_NOTE``);
- ``sdpa_flash``: the same call under ``SDPBackend.FLASH_ATTENTION``, for context only
  (the fused algorithm of Chapters 3-4).

Points: bf16, batch 1, 16 heads, head_dim 128 and 64, causal and not, N = 512 … 16384 and
on (24576, 32768, 49152, 65536) until both our kernel and the math backend have run out of
memory (``torch.OutOfMemoryError`` is caught and recorded as an ``"oom"`` row).

Rows (``params``: batch, heads, seq_len, head_dim, causal, dtype; per-pass rows add ``pass``):

=====================  =========================================================================
``oom``                ours / peer_value: True if that side ran out of memory (peer: sdpa_math)
``time_ms``            median time; one row against sdpa_math, one against sdpa_flash
``TFLOPs``             4·B·H·N²·D / time, halved when causal (`minillm.costs.nominal_attention_flops`);
                       fraction of the bf16 matmul ceiling
``peak_memory_bytes``  ``max_memory_allocated`` during one call minus what was allocated before
``bandwidth_TBps``     counted bytes of all three passes / our time; fraction of copy bandwidth
``rel_err``            ‖ours − peer‖ / ‖peer‖ against the math output (flash if math OOMed)
``pass_time_ms``       one pass alone (scores, softmax, pv), outputs preallocated
``pass_bandwidth_TBps``  that pass's counted bytes (`minillm.costs.naive_attention_traffic`) / its time
=====================  =========================================================================

The FLOP count follows the usual convention (FlashAttention-2 paper): causal attention is
credited with half the work. Our naive kernels do **not** skip the masked half (the scores
pass computes every tile and writes -inf, softmax and P·V run over full rows), so their
causal TFLOP/s understates the work the GPU actually does by 2×; the convention keeps the
numbers comparable with every other causal kernel in the book.
"""
from __future__ import annotations

import gc
import os
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from minillm.costs import naive_attention_traffic, nominal_attention_flops, per_array_bytes, total_bytes
from minillm.kernels.ch01_naive_attention import (
    attention_scores,
    naive_attention,
    probs_times_values,
    row_softmax,
)

from bench.common import Results, attempt, cuda_device, fraction, rel_err, time_ms

BENCHMARK = "ch01_naive_attention"
BATCH, HEADS = 1, 16
HEAD_DIMS = (128, 64)
CAUSAL = (False, True)
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384, 24576, 32768, 49152, 65536)
DTYPE = torch.bfloat16
WARMUP_MS, REP_MS = 25, 100            # whole-attention timings
PASS_WARMUP_MS, PASS_REP_MS = 10, 50   # per-pass timings
#: Stop starting new points after this many seconds (the device call has a hard limit).
BUDGET_S = float(os.environ.get("MINILLM_CH01_BUDGET_S", "300"))

PEERS = ("sdpa_math", "sdpa_flash")


def measure(fn: Callable[[], Any], warmup: int = WARMUP_MS, rep: int = REP_MS) -> dict[str, Any]:
    """One call for peak memory (and the output, kept for the error check), then the median
    time. ``peak_bytes`` = ``max_memory_allocated`` during the call minus what was already
    allocated: the working memory of the call, output included."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    out = out[0] if isinstance(out, tuple) else out
    ms = time_ms(fn, warmup=warmup, rep=rep)
    return {"ms": ms, "peak_bytes": int(peak), "out": out}


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa_math": SDPBackend.MATH, "sdpa_flash": SDPBackend.FLASH_ATTENTION}[name]


def _math_note() -> str:
    try:
        reduced = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    except AttributeError:
        return "math backend precision: unknown for this torch"
    return ("math backend computes in bf16" if reduced
            else "math backend upcasts bf16 to fp32 internally (torch default)")


def run_peer(name: str, q, k, v, causal: bool):
    from torch.nn.attention import sdpa_kernel

    def call():
        with sdpa_kernel(_sdpa_backend(name)):
            return measure(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))

    return attempt(call, allow_errors=True)


def run_passes(q, k, v, causal: bool) -> dict[str, float]:
    """Median time of each pass alone, every output preallocated (so only the kernel is
    timed): ``{"scores": ms, "softmax": ms, "pv": ms}``. S and P hold real data from one
    run of the previous passes."""
    b, h, n, d = q.shape
    s = torch.empty(b, h, n, n, device=q.device, dtype=torch.float32)
    p = torch.empty(b, h, n, n, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, h, n, device=q.device, dtype=torch.float32)
    o = torch.empty_like(q)
    attention_scores(q, k, causal=causal, out=s)
    row_softmax(s, out_dtype=v.dtype, out=p, lse=lse)
    fns = {
        "scores": lambda: attention_scores(q, k, causal=causal, out=s),
        "softmax": lambda: row_softmax(s, out_dtype=v.dtype, out=p, lse=lse),
        "pv": lambda: probs_times_values(p, v, out=o),
    }
    return {name: time_ms(fn, warmup=PASS_WARMUP_MS, rep=PASS_REP_MS) for name, fn in fns.items()}


def run(results: Results, device) -> None:
    """Run the Chapter 1 sweep on ``device`` and add its rows to ``results``.

    Needs ``results.ceilings`` (``copy_TBps``, ``bf16_matmul_TFLOPs``) for the fractions.
    """
    device = cuda_device(device, "the Chapter 1 benchmark")
    sweep(results, device, HEAD_DIMS, CAUSAL, SEQ_LENS)


def sweep(results: Results, device, head_dims=HEAD_DIMS, causals=CAUSAL, seq_lens=SEQ_LENS) -> None:
    """The loop of `run`: for each (head_dim, causal), N grows through ``seq_lens``
    until both our kernel and the math backend are out of memory at some N."""
    ceil = results.ceilings or {}
    copy_tbps, mm_tflops = ceil.get("copy_TBps"), ceil.get("bf16_matmul_TFLOPs")
    math_note = _math_note()
    start = time.perf_counter()
    gen = torch.Generator(device=device)
    gen.manual_seed(0)

    for head_dim in head_dims:
        for causal in causals:
            for n in seq_lens:
                if time.perf_counter() - start > BUDGET_S:
                    print(f"  [{BENCHMARK}] time budget of {BUDGET_S:.0f} s spent: stopping early", flush=True)
                    results.set_status(BENCHMARK, f"partial: time budget {BUDGET_S:.0f} s spent")
                    return
                t0 = time.perf_counter()
                both_oom = _run_point(results, device, gen, n, head_dim, causal, copy_tbps, mm_tflops, math_note)
                print(f"  [{BENCHMARK}] D={head_dim} causal={causal} N={n}: {time.perf_counter() - t0:.1f} s",
                      flush=True)
                if both_oom:
                    break  # larger N can only need more memory


def _run_point(results: Results, device, gen, n: int, head_dim: int, causal: bool,
               copy_tbps, mm_tflops, math_note: str) -> bool:
    """Measure one point; returns True when both ours and the math backend ran out of memory."""
    params = {"batch": BATCH, "heads": HEADS, "seq_len": n, "head_dim": head_dim,
              "causal": causal, "dtype": "bfloat16"}
    shape = (BATCH, HEADS, n, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=DTYPE, generator=gen) for _ in range(3))
    add = lambda *a, **kw: results.add(BENCHMARK, *a, **kw)  # noqa: E731

    ours, ours_status = attempt(lambda: measure(lambda: naive_attention(q, k, v, causal=causal)))
    peers = {name: run_peer(name, q, k, v, causal) for name in PEERS}
    math_res, math_status = peers["sdpa_math"]

    notes = {}
    for name, (_, status) in peers.items():
        parts = [math_note] if name == "sdpa_math" else []
        if status and status != "oom":
            parts.append(f"{name} {status}")
        notes[name] = "; ".join(parts) or None
    add(params, "oom", ours_status == "oom", "sdpa_math", math_status == "oom",
        note=f"sdpa_flash: {peers['sdpa_flash'][1] or 'ran'}")

    flops = nominal_attention_flops(BATCH, HEADS, n, n, head_dim, causal)
    traffic = naive_attention_traffic(BATCH, HEADS, HEADS, n, n, head_dim, elem_bytes=2)
    counts = per_array_bytes(traffic)  # per pass
    ours_ms = ours["ms"] if ours else None
    ours_tflops = flops / (ours_ms * 1e-3) / 1e12 if ours_ms else None
    for name, (res, status) in peers.items():
        if ours is None and res is None:
            continue
        peer_ms = res["ms"] if res else None
        note = notes.get(name)
        add(params, "time_ms", ours_ms, name, peer_ms, note=note)
        add(params, "TFLOPs", ours_tflops, name, flops / (peer_ms * 1e-3) / 1e12 if peer_ms else None,
            fraction_of_ceiling=fraction(ours_tflops, mm_tflops), note=note)
        add(params, "peak_memory_bytes", ours["peak_bytes"] if ours else None, name,
            res["peak_bytes"] if res else None, note=note)

    if ours is not None:
        bw = total_bytes(traffic) / (ours_ms * 1e-3) / 1e12
        add(params, "bandwidth_TBps", bw, fraction_of_ceiling=fraction(bw, copy_tbps),
            note="counted bytes of the three passes (naive_attention_traffic) / time of the whole call")
        ref_name = "sdpa_math" if math_res is not None else "sdpa_flash"
        ref = peers[ref_name][0]
        if ref is not None:
            add(params, "rel_err", rel_err(ours["out"], ref["out"]), ref_name, None)

    # Drop the outputs before the per-pass run needs S and P again.
    ours = math_res = ref = None
    peers.clear()
    if ours_status is None:
        pass_ms, pass_status = attempt(lambda: run_passes(q, k, v, causal))
        for name in ("scores", "softmax", "pv"):
            pparams = dict(params, **{"pass": name})
            ms = pass_ms[name] if pass_ms else None
            bw = counts[name] / (ms * 1e-3) / 1e12 if ms else None
            add(pparams, "pass_time_ms", ms, note=pass_status)
            add(pparams, "pass_bandwidth_TBps", bw, fraction_of_ceiling=fraction(bw, copy_tbps), note=pass_status)
    del q, k, v
    gc.collect()
    torch.cuda.empty_cache()
    return ours_status == "oom" and math_status == "oom"


def summary(results: Results | dict) -> str:
    """A short text table of this benchmark's main rows (times, speed-up, memory, OOMs)."""
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    t = {}
    for r in select(data, BENCHMARK, "time_ms"):
        p = r["params"]
        key = (p["head_dim"], p["causal"], p["seq_len"])
        t.setdefault(key, {})["ours"] = r["ours"]
        t[key][r["peer"]] = r["peer_value"]
    mem = {}
    for r in select(data, BENCHMARK, "peak_memory_bytes"):
        if r["peer"] == "sdpa_math":
            p = r["params"]
            mem[(p["head_dim"], p["causal"], p["seq_len"])] = (r["ours"], r["peer_value"])

    def f(x, scale=1.0, fmt="{:.3f}"):
        return "OOM/—" if x is None else fmt.format(x * scale)

    lines = [f"{'D':>4} {'causal':>6} {'N':>6} {'ours ms':>10} {'math ms':>10} {'flash ms':>10} "
             f"{'math/ours':>9} {'ours GB':>8} {'math GB':>8}"]
    for key in sorted(t):
        d, c, n = key
        row = t[key]
        o, m, fl = row.get("ours"), row.get("sdpa_math"), row.get("sdpa_flash")
        mo, mm = mem.get(key, (None, None))
        speed = f"{m / o:.2f}" if o and m else "—"
        lines.append(f"{d:>4} {str(c):>6} {n:>6} {f(o):>10} {f(m):>10} {f(fl):>10} {speed:>9} "
                     f"{f(mo, 1e-9, '{:.2f}'):>8} {f(mm, 1e-9, '{:.2f}'):>8}")
    return "\n".join(lines)


if __name__ == "__main__":
    from bench.run import main

    raise SystemExit(main(["--only", BENCHMARK]))
