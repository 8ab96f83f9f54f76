"""Chapter 3 benchmark: the online-softmax kernel on long rows, and FlashAttention-1's loop order.

Part 1, softmax of long rows. `minillm.kernels.ch03_online_softmax.online_softmax` against
``torch.softmax(x, dim=-1)`` on the same random ``[ROWS, cols]`` input, cols = 1k … 256k,
bf16 and fp32 (the output in the input's dtype, as torch gives it). Rows of up to
`MAX_ONE_TILE` elements stay in registers (read once); longer rows are streamed twice
(statistics, then output).

Part 2, attention. `minillm.kernels.ch03_online_softmax.tiled_attention` (FA1 order: K/V outer,
Q inner, one program per (batch, head), the running O/ℓ/m through HBM) against
``F.scaled_dot_product_attention`` pinned to ``SDPBackend.MATH`` (``sdpa_math``, the
materialising algorithm) and to ``SDPBackend.FLASH_ATTENTION`` (``sdpa_flash``, FlashAttention-2),
bf16, at a few sizes.

Rows (softmax ``params``: rows, cols, dtype, path = "registers" or "streamed"):

=========================  ==================================================================
``time_ms``                median time; peer torch_softmax
``bandwidth_TBps``         the bytes *our kernel moves* (`online_softmax_traffic`: 2 reads +
                           1 write of the row when streamed, 1 + 1 in registers, plus the
                           fp32 lse) / time; fraction of the measured copy bandwidth
``effective_bandwidth_TBps``  the *minimal* bytes of any softmax (read once, write once) / time,
                           ours and torch_softmax's; fraction of copy bandwidth. A streamed
                           row can reach at most ~2/3 of copy on this measure (3 row-sized
                           transfers for the copy's 2)
``rel_err``                ‖ours − torch.softmax(x.float())‖ / ‖…‖
=========================  ==================================================================

Attention ``params``: batch, heads, seq_len, head_dim, causal, dtype:

=========================  ==================================================================
``oom``                    True if our kernel's inputs or workspace did not fit
``time_ms``                median time; one row per peer (sdpa_math, sdpa_flash)
``TFLOPs``                 4·B·H·N²·D / time, halved when causal (Chapter 1's convention; our
                           kernel computes every tile, masked or not); fraction of the bf16
                           matmul ceiling
``bandwidth_TBps``         `tiled_attention_traffic` bytes / time; fraction of copy bandwidth
``hbm_bytes``              the bytes FA1 order moves (ours) against Chapter 1's eight matrix
                           accesses (peer ``naive_ch01``): ratio = naive / ours
``rel_err``                ‖ours − peer‖ / ‖peer‖ against sdpa_math (sdpa_flash if math failed)
=========================  ==================================================================

The sweep stops starting points after ``MINILLM_CH03_BUDGET_S`` seconds (default 120;
status "partial"). What to expect: softmax is memory bound, so bandwidth is the measure;
FA1 order with one program per head runs ``B·H`` programs (16 at batch 1) on a GPU of 132
SMs, and FlashAttention-2 (the flash peer) is the target of Chapter 4.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from minillm.costs import (
    naive_attention_traffic, nominal_attention_flops, online_softmax_traffic, tiled_attention_traffic, total_bytes,
)
from minillm.kernels.ch03_online_softmax import MAX_ONE_TILE, online_softmax
from minillm.kernels.ch03_online_softmax import FA1_BLOCK_N as ATTN_BLOCK_N
from minillm.kernels.ch03_online_softmax import tiled_attention

from bench.common import Results, attempt, cuda_device, dtype_name, fraction, free_memory, rel_err, sweep_start

BENCHMARK = "ch03_online_softmax"
ROWS = 4096
COLS = (1024, 4096, 16384, 65536, 262144)
SOFTMAX_DTYPES = (torch.bfloat16, torch.float32)
#: (batch, heads, seq_len, head_dim, causal), bf16.
ATTN_POINTS = (
    (1, 16, 1024, 64, False),
    (1, 16, 4096, 64, False),
    (1, 16, 4096, 64, True),
    (1, 16, 4096, 128, False),
    (8, 16, 2048, 64, False),    # 128 programs: about one per SM
)
ATTN_DTYPE = torch.bfloat16
#: Skip softmax points whose input is larger than this (bytes).
MAX_INPUT_BYTES = 8e9
WARMUP_MS, REP_MS = 25, 100
PEERS = ("sdpa_math", "sdpa_flash")


def budget_s() -> float:
    """Seconds after which no new point is started: ``MINILLM_CH03_BUDGET_S`` (default 120)."""
    return float(os.environ.get("MINILLM_CH03_BUDGET_S", "120"))


def _tbps(n_bytes: int, ms: float | None) -> float | None:
    return n_bytes / (ms * 1e-3) / 1e12 if ms else None


# ----------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------
def run(results: Results, device) -> None:
    """Run the Chapter 3 sweep on ``device`` (CUDA) and add its rows to ``results``.

    Needs ``results.ceilings`` (``copy_TBps``, ``bf16_matmul_TFLOPs``) for the fractions."""
    device = cuda_device(device, "the Chapter 3 benchmark")
    sweep(results, device)


def sweep(results: Results, device, rows: int = ROWS, cols_list=COLS, softmax_dtypes=SOFTMAX_DTYPES,
          attn_points=ATTN_POINTS, attn_dtype: torch.dtype = ATTN_DTYPE, block_n: int | None = None,
          timer: Callable[[Callable[[], Any]], float] | None = None) -> None:
    """The loops of `run`: the softmax points, then the attention points, until the time
    budget is spent. ``block_n`` is passed to `online_softmax` (None: its default).
    ``timer(fn) -> ms`` defaults to `bench.common.time_ms` (CUDA only); the CPU tests pass a
    stand-in to check the bookkeeping under the interpreter."""
    timer, gen, out_of_time = sweep_start(results, BENCHMARK, device, budget_s(), timer, WARMUP_MS, REP_MS)
    ceil = results.ceilings or {}
    copy_tbps, mm_tflops = ceil.get("copy_TBps"), ceil.get("bf16_matmul_TFLOPs")

    for dtype in softmax_dtypes:
        for cols in cols_list:
            if rows * cols * dtype.itemsize > MAX_INPUT_BYTES:
                continue
            if out_of_time():
                return
            t0 = time.perf_counter()
            _run_softmax_point(results, device, gen, rows, cols, dtype, block_n, copy_tbps, timer)
            free_memory()  # the point's tensors went with its frame
            print(f"  [{BENCHMARK}] softmax {dtype_name(dtype)} {rows}x{cols}: {time.perf_counter() - t0:.1f} s",
                  flush=True)

    for batch, heads, seq_len, head_dim, causal in attn_points:
        if out_of_time():
            return
        t0 = time.perf_counter()
        _run_attention_point(results, device, gen, batch, heads, seq_len, head_dim, causal, attn_dtype,
                             copy_tbps, mm_tflops, timer)
        free_memory()
        print(f"  [{BENCHMARK}] attention B={batch} H={heads} N={seq_len} D={head_dim} causal={causal}: "
              f"{time.perf_counter() - t0:.1f} s", flush=True)


def _run_softmax_point(results: Results, device, gen, rows: int, cols: int, dtype: torch.dtype,
                       block_n: int | None, copy_tbps, timer) -> None:
    traffic = online_softmax_traffic(rows, cols, dtype.itemsize, block_n=block_n)
    one_tile = cols <= (MAX_ONE_TILE if block_n is None else block_n)
    params = {"rows": rows, "cols": cols, "dtype": dtype_name(dtype), "path": "registers" if one_tile else "streamed"}
    add = lambda *a, **kw: results.add(BENCHMARK, params, *a, **kw)  # noqa: E731

    x = (4 * torch.randn(rows, cols, device=device, dtype=torch.float32, generator=gen)).to(dtype)
    y = torch.empty_like(x)
    lse = torch.empty(rows, device=device, dtype=torch.float32)

    def ours():
        return online_softmax(x, out=y, lse=lse, block_n=block_n)

    def peer():
        return torch.softmax(x, dim=-1)

    ours()
    ours_ms = timer(ours)
    peer_ms, status = attempt(lambda: timer(peer), allow_errors=True)
    counted = traffic["read"] + traffic["write"]
    minimal = traffic["minimal"] - rows * 4  # torch writes no lse: compare on the softmax alone
    add("time_ms", ours_ms, "torch_softmax", peer_ms, note=status)
    add("bandwidth_TBps", _tbps(counted, ours_ms), fraction_of_ceiling=fraction(_tbps(counted, ours_ms), copy_tbps),
        note=("1 read + 1 write" if one_tile else "2 reads + 1 write") + " of the row, + fp32 lse; counted / time")
    eff = _tbps(minimal, ours_ms)
    add("effective_bandwidth_TBps", eff, "torch_softmax", _tbps(minimal, peer_ms),
        fraction_of_ceiling=fraction(eff, copy_tbps), note="minimal bytes (read once, write once) / time")
    add("rel_err", rel_err(y, torch.softmax(x.float(), dim=-1)), "torch_softmax_fp32", None)


def _run_attention_point(results: Results, device, gen, batch: int, heads: int, seq_len: int, head_dim: int,
                         causal: bool, dtype: torch.dtype, copy_tbps, mm_tflops, timer) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    params = {"batch": batch, "heads": heads, "seq_len": seq_len, "head_dim": head_dim, "causal": causal,
              "dtype": dtype_name(dtype)}
    add = lambda *a, **kw: results.add(BENCHMARK, params, *a, **kw)  # noqa: E731

    def make():
        shape = (batch, heads, seq_len, head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, seq_len, device=device, dtype=torch.float32)
        ws = (torch.empty(batch * heads, seq_len, head_dim, device=device, dtype=torch.float32),
              torch.empty(batch * heads, seq_len, device=device, dtype=torch.float32),
              torch.empty(batch * heads, seq_len, device=device, dtype=torch.float32))
        return q, k, v, out, lse, ws

    inputs, status = attempt(make)
    if inputs is None:
        add("oom", True, note="inputs or workspace did not fit")
        return
    q, k, v, out, lse, ws = inputs

    def ours():
        return tiled_attention(q, k, v, causal=causal, out=out, lse=lse, workspace=ws)

    ours()
    ours_ms = timer(ours)

    peers: dict[str, tuple[Any, str | None]] = {}
    backends = {"sdpa_math": SDPBackend.MATH, "sdpa_flash": SDPBackend.FLASH_ATTENTION}
    for name in PEERS:
        def call(backend=backends[name]):
            with sdpa_kernel(backend):
                res = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                return timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), res
        peers[name] = attempt(call, allow_errors=True)

    flops = nominal_attention_flops(batch, heads, seq_len, seq_len, head_dim, causal)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    for name, (res, st) in peers.items():
        peer_ms = res[0] if res else None
        add("time_ms", ours_ms, name, peer_ms, note=st)
        add("TFLOPs", tflops(ours_ms), name, tflops(peer_ms), fraction_of_ceiling=fraction(tflops(ours_ms), mm_tflops),
            note=st)
    fa1_bytes = total_bytes(tiled_attention_traffic(batch, heads, seq_len, seq_len, head_dim, dtype.itemsize,
                                                    block_n=ATTN_BLOCK_N))
    naive_bytes = total_bytes(naive_attention_traffic(batch, heads, heads, seq_len, seq_len, head_dim, dtype.itemsize))
    bw = _tbps(fa1_bytes, ours_ms)
    add("bandwidth_TBps", bw, fraction_of_ceiling=fraction(bw, copy_tbps),
        note=f"tiled_attention_traffic (BLOCK_N={ATTN_BLOCK_N}) / time")
    add("hbm_bytes", fa1_bytes, "naive_ch01", naive_bytes, note="counted, not measured")
    ref_name = "sdpa_math" if peers["sdpa_math"][0] is not None else "sdpa_flash"
    ref = peers[ref_name][0]
    if ref is not None:
        add("rel_err", rel_err(out, ref[1]), ref_name, None)


# ----------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------
def summary(results: Results | dict) -> str:
    """Compact text tables: softmax time and bandwidth per point; attention time and TFLOP/s."""
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results

    def f(x, fmt="{:.3f}"):
        return "—" if x is None else fmt.format(x)

    s: dict[tuple, dict] = {}
    for metric in ("time_ms", "bandwidth_TBps", "effective_bandwidth_TBps"):
        for r in select(data, BENCHMARK, metric):
            p = r["params"]
            if "cols" not in p:
                continue
            row = s.setdefault((p["dtype"], p["cols"], p["path"]), {})
            row[metric] = r["ours"]
            row[metric + "_peer"] = r["peer_value"]
            row[metric + "_frac"] = r["fraction_of_ceiling"]
    lines = [f"{'dtype':>8} {'cols':>7} {'path':>9} {'ours ms':>9} {'torch ms':>9} {'torch/ours':>10} "
             f"{'TB/s':>6} {'of copy':>7} {'eff TB/s':>8} {'torch eff':>9}"]
    for (dt, cols, path), row in sorted(s.items()):
        o, p = row.get("time_ms"), row.get("time_ms_peer")
        lines.append(f"{dt:>8} {cols:>7} {path:>9} {f(o):>9} {f(p):>9} {f(p / o if o and p else None, '{:.2f}'):>10} "
                     f"{f(row.get('bandwidth_TBps'), '{:.2f}'):>6} {f(row.get('bandwidth_TBps_frac'), '{:.0%}'):>7} "
                     f"{f(row.get('effective_bandwidth_TBps'), '{:.2f}'):>8} "
                     f"{f(row.get('effective_bandwidth_TBps_peer'), '{:.2f}'):>9}")

    a: dict[tuple, dict] = {}
    for metric in ("time_ms", "TFLOPs", "oom", "hbm_bytes"):
        for r in select(data, BENCHMARK, metric):
            p = r["params"]
            if "seq_len" not in p:
                continue
            row = a.setdefault((p["batch"], p["heads"], p["seq_len"], p["head_dim"], p["causal"]), {})
            if metric == "oom":
                row["oom"] = True
            elif metric == "hbm_bytes":
                row["naive_over_ours"] = r["ratio"]
            else:
                row[metric] = r["ours"]
                row[f"{metric}:{r['peer']}"] = r["peer_value"]
    if a:
        lines += ["", f"{'B':>3} {'H':>3} {'N':>6} {'D':>4} {'causal':>6} {'ours ms':>9} {'math ms':>9} "
                      f"{'flash ms':>9} {'TFLOP/s':>8} {'flash TF':>8} {'naive/FA1 bytes':>15}"]
        for key, row in sorted(a.items()):
            if row.get("oom"):
                lines.append(f"{key[0]:>3} {key[1]:>3} {key[2]:>6} {key[3]:>4} {str(key[4]):>6}  OOM")
                continue
            lines.append(f"{key[0]:>3} {key[1]:>3} {key[2]:>6} {key[3]:>4} {str(key[4]):>6} {f(row.get('time_ms')):>9} "
                         f"{f(row.get('time_ms:sdpa_math')):>9} {f(row.get('time_ms:sdpa_flash')):>9} "
                         f"{f(row.get('TFLOPs'), '{:.1f}'):>8} {f(row.get('TFLOPs:sdpa_flash'), '{:.1f}'):>8} "
                         f"{f(row.get('naive_over_ours'), '{:.1f}'):>15}")
    return "\n".join(lines)


if __name__ == "__main__":
    from bench.run import main

    raise SystemExit(main(["--only", BENCHMARK]))
