"""Chapter 8 benchmark: decode-time linear layers — GEMV, flat GEMM, cuBLAS — and the dispatch table.

For each weight shape ``[N, K]`` and batch size ``M``: `gemv` (for ``M <= GEMV_MAX_M``),
`flat_gemm` (autotuned on its first call for the shape; the config it chose is recorded) and
the peer, cuBLAS through ``torch.nn.functional.linear``, on the same random inputs, no bias.
Then, per shape, `find_inflection_points` turns the three curves into ``(M1, M2)`` and
`find_exceptions` adds the measured ``M`` where the thresholds' kernel is more than
`EXCEPTION_MARGIN` slower than the fastest; the
table of every shape swept is saved to ``bench/results/<gpu-slug>.flat_gemm.json``
(`DispatchTable`; merged with the shapes an earlier run saved, ``MINILLM_RESULTS_DIR``
overrides the folder; `minillm.engine.gemm_table`), the file the model's linear layers load at run time. Last,
the dispatcher `linear` itself is timed at every ``M`` with that table, against the best of
the three kernels at that ``M``: the heuristic dataflow should lose nothing (ratio >= 0.97).

Shapes (``[N, K]``, ``nn.Linear``'s ``[out_features, in_features]``): Llama-2-7B's fused QKV
``[12288, 4096]``, O ``[4096, 4096]``, up (= gate) ``[11008, 4096]`` and down ``[4096,
11008]`` (`minillm.costs.LLAMA2_7B`), and the bundled Shakespeare model's fused QKV, O, fused
gate+up and down (from its ``config.json``: ``[512, 256]``, ``[256, 256]``, ``[1376, 256]``,
``[256, 688]``; a few hundred KB each, so launch-bound on any GPU). ``M`` in `MS`, fp16
(the dtype of the peer numbers quoted in the chapter); then bf16 at `BF16_MS`. Where the
chosen split-K is > 1, at `SPLIT_ABLATION_MS` the same config is also timed without split.

Two timings of every kernel. **Eager** (``time_ms`` rows): medians of
`bench.common.time_ms` (``do_bench``: the L2 cache is flushed before every call, so the
weights come from HBM; the time is between CUDA events around one call, so it includes the
event overhead, the dirty lines the flush left in L2 being written back, and any host
overhead the GPU cannot hide). **Graph** (``graph_time_ms`` rows): `bench.common.graph_time_ms`,
the call captured ``GRAPH_REPEATS`` times in one CUDA graph that cycles over enough copies of
the weights (and of the output) that they cannot stay in L2 between two uses (``≥
GRAPH_FOOTPRINT`` bytes, at most ``MAX_COPIES`` copies: the small bundled model's weights are
L2-resident anyway), per call. An engine that captures its decode step in CUDA graphs (as
every serving engine does) pays the graph time: no launch overhead, back-to-back kernels,
and weights that the other layers evicted. So **the inflection points, and the dispatcher's
comparison, come from the graph times** (the eager ones are recorded beside them; on an H200
they are 25-35 % lower for every kernel, cuBLAS included, on these 10-40 µs calls). With a
stand-in timer (the CPU tests) the graph time is the stand-in's time of one call. The sweep stops starting points after
``MINILLM_CH08_BUDGET_S`` seconds (default 150; status "partial"), compile and tuning time
included: the first ``flat_gemm`` call of a shape and rows bucket times up to 7 candidate
tiles at up to 4 splits of K each, the first ``gemv`` call of a row count 3 (`minillm.kernels.ch08_flat_gemm.FLAT_GEMM_TILES`,
`GEMV_TILES`), each compiled once per dtype, row count and split-K variant (~1 s each; some
60 kernels in all, fewer when Triton's cache already holds them).

Rows. ``params``: shape (e.g. "Llama-2-7B.qkv"), n, k, m, dtype, kernel (and config, for
gemv/flat_gemm: `TileConfig.describe`, e.g. "16x64x128 w4 s4 k8" = BLOCK_M x BLOCK_N x
BLOCK_K, warps, stages, split-K):

===================  ========================================================================
``graph_time_ms``    as ``time_ms`` (peers ``cublas`` / ``best_of_three`` from graph times too),
                     per call replaying a CUDA graph (see above); no split ablation
``graph_bandwidth_TBps``  as ``bandwidth_TBps``, from the graph times
``time_ms``          kernel gemv / flat_gemm: ours, peer ``cublas`` (ratio > 1: faster than
                     cuBLAS). kernel cublas: its own time, no peer. kernel dispatch (params
                     also ``chosen``: the kernel `linear` picked): `linear`'s time, peer
                     ``best_of_three`` (the fastest of the three at this M in the sweep,
                     re-timed beside the dispatcher; ratio = best / dispatch, <= 1 up to
                     noise; the note names the fastest). Split-K rows:
                     kernel gemv / flat_gemm, peer ``no_split`` (the same tile with split_k=1;
                     ratio > 1: the split pays)
``bandwidth_TBps``   bytes (``(N·K + M·K + M·N)·e``, `minillm.costs.gemm_bytes`) / time, per
                     kernel (gemv, flat_gemm, cublas, dispatch); peer cublas for the others;
                     fraction of the copy bandwidth measured in the same run
``TFLOPs``           ``2·M·N·K`` / time per kernel, peer cublas; fraction of the measured bf16
                     matmul rate
``rel_err``          ‖ours − ref‖ / ‖ref‖ per kernel (cublas too), ref = ``F.linear`` in fp32
                     on the same (rounded) inputs
``m1``, ``m2``       per shape (params shape, n, k, dtype only): the inflection points found,
                     M1 (GEMV up to it; 0: never) and M2 (flat GEMM up to it)
===================  ========================================================================
"""
from __future__ import annotations

import datetime as _dt
import math
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from minillm.kernels.ch08_flat_gemm import (
    DEFAULT_THRESHOLDS, EXCEPTION_MARGIN, DispatchTable, choose_kernel, find_exceptions, find_inflection_points,
    flat_gemm, gemv, linear, pick_config,
)
from minillm.costs import gemm_bytes, gemm_flops
from minillm.engine.gemm_table import load_table, save_table, table_path

from bench.common import (
    GRAPH_REPEATS, Results, cuda_device, dtype_name, fraction, free_memory, graph_time_ms, rel_err, sweep_start,
)

BENCHMARK = "ch08_flat_gemm"
#: Batch sizes of the fp16 sweep.
MS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
#: The GEMV is timed up to this M (past it, it re-reads the weights once per 16 rows).
GEMV_MAX_M = 16
#: The bf16 points (kernels only: the dispatch table is made from the fp16 sweep).
BF16_MS = (1, 8, 16)
#: Where a config with split-K > 1 is also timed without it.
SPLIT_ABLATION_MS = (1, 16)
#: find_inflection_points' tolerance: within 2 % of the best counts as a tie (timing noise).
TOLERANCE = 0.02
#: The dispatcher and the fastest kernel are each graph-timed this many times, alternately,
#: the first of the pair alternating too (a graph timed first in a round can find the GPU's
#: clocks lower: with three rounds and a fixed order, one point of 112 read the same cuBLAS
#: call 5 % apart on an H200; with five alternating rounds one still read it 4 % apart, the
#: Llama-2-7B down projection at M = 192, 2026-12-01).
DISPATCH_ROUNDS = 9
WARMUP_MS, REP_MS = 10, 50
#: Graph timing: cycle over copies of the weights until they take this many bytes (several
#: times the H200's 60 MB L2), but never more than this many copies.
GRAPH_FOOTPRINT, MAX_COPIES = 256_000_000, 8


def budget_s() -> float:
    """Seconds after which no new point is started: ``MINILLM_CH08_BUDGET_S`` (default 150)."""
    return float(os.environ.get("MINILLM_CH08_BUDGET_S", "150"))


def linear_shapes(shape, fused_gate_up: bool) -> list[tuple[str, int, int]]:
    """``[(name, N, K)]`` of a decoder layer's linear layers at decode time: the fused QKV
    projection, O, the MLP's up projection (``fused_gate_up``: gate and up as one ``[2I, D]``
    weight) and down. ``shape``: a `minillm.costs.ModelShape`."""
    up_name, up_n = ("gate_up", 2 * shape.intermediate) if fused_gate_up else ("up", shape.intermediate)
    return [(f"{shape.name}.qkv", shape.q_width + 2 * shape.kv_width, shape.hidden),
            (f"{shape.name}.o", shape.hidden, shape.q_width),
            (f"{shape.name}.{up_name}", up_n, shape.hidden),
            (f"{shape.name}.down", shape.hidden, shape.intermediate)]


def default_shapes() -> list[tuple[str, int, int]]:
    """Llama-2-7B's four (up and gate separate, as in its checkpoint), then the bundled model's."""
    from minillm.cli import BUNDLED_MODEL
    from minillm.costs import LLAMA2_7B, ModelShape
    from minillm.model.config import ModelConfig

    bundled = ModelShape.from_config(ModelConfig.from_json(BUNDLED_MODEL), name=BUNDLED_MODEL.name)
    return linear_shapes(LLAMA2_7B, fused_gate_up=False) + linear_shapes(bundled, fused_gate_up=True)


# ----------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------
def run(results: Results, device) -> None:
    """Run the Chapter 8 sweep on ``device`` (CUDA), add its rows to ``results`` and save the
    dispatch table. Needs ``results.ceilings`` (copy_TBps, bf16_matmul_TFLOPs) for the fractions."""
    device = cuda_device(device, "the Chapter 8 benchmark")
    sweep(results, device)


def sweep(results: Results, device, shapes=None, ms=MS, gemv_max_m: int = GEMV_MAX_M, bf16_ms=BF16_MS,
          split_ablation_ms=SPLIT_ABLATION_MS, timer: Callable[[Callable[[], Any]], float] | None = None,
          table_dir=None) -> DispatchTable:
    """The loops of `run`: for each shape the fp16 sweep over ``ms``, its inflection points
    and the dispatcher's sweep; then bf16 at ``bf16_ms`` (none if empty); until the time
    budget is spent. ``timer(fn) -> ms`` defaults to `bench.common.time_ms` (CUDA only); the
    CPU tests pass a stand-in. Saves and returns the dispatch table (``table_dir``: where;
    default `minillm.engine.gemm_table.table_path`'s). Only shapes whose whole sweep ran enter the table."""
    if timer is None:
        graph_timer = lambda fns: graph_time_ms(fns, GRAPH_REPEATS)  # noqa: E731
    else:  # a stand-in (the CPU tests): one call of the first copy
        graph_timer = lambda fns: timer(fns[0])  # noqa: E731
    timer, gen, out_of_time = sweep_start(results, BENCHMARK, device, budget_s(), timer, WARMUP_MS, REP_MS)
    ceilings = results.ceilings or {}
    shapes = default_shapes() if shapes is None else list(shapes)
    path = table_path(results.device, table_dir)
    table = load_table(path) if path.is_file() else DispatchTable()  # keep the shapes it has
    table.info = {"device": results.device, "gpu_slug": results.slug, "dtype": "float16", "ms": list(ms),  # this run's
                  "tolerance": TOLERANCE, "exception_margin": EXCEPTION_MARGIN, "benchmark": BENCHMARK,
                  "torch": results.env.get("torch"),
                  "triton": results.env.get("triton"),
                  "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    point = dict(results=results, device=device, gen=gen, timer=timer, graph_timer=graph_timer, ceilings=ceilings,
                 split_ablation_ms=split_ablation_ms)

    for name, n, k in shapes:
        t0 = time.perf_counter()
        weight = _weights(n, k, torch.float16, device, gen)
        sweep_times: dict[str, list] = {kind: [] for kind in ("gemv", "flat_gemm", "cublas")}
        found = ""
        for m in ms:
            if out_of_time():
                break
            times = _kernels_point(name, weight, m, m <= gemv_max_m, **point)["graph"]
            for kind in sweep_times:
                sweep_times[kind].append(times.get(kind))
        else:  # the whole sweep ran: its inflection points, then the dispatcher with them
            m1, m2 = find_inflection_points(ms, sweep_times["gemv"], sweep_times["flat_gemm"],
                                            sweep_times["cublas"], tolerance=TOLERANCE)
            table.entries[(n, k)] = (m1, m2)
            exceptions = find_exceptions(ms, sweep_times["gemv"], sweep_times["flat_gemm"], sweep_times["cublas"],
                                         (m1, m2))
            if exceptions:
                table.exceptions[(n, k)] = exceptions
            else:
                table.exceptions.pop((n, k), None)
            save_table(table, path)
            found = f", M1={m1} M2={m2}" + (f", exceptions {exceptions}" if exceptions else "")
            shape_params = {"shape": name, "n": n, "k": k, "dtype": "float16"}
            note = f"find_inflection_points over M in {list(ms)} of the graph times, tolerance {TOLERANCE}"
            results.add(BENCHMARK, shape_params, "m1", m1, note=note)
            results.add(BENCHMARK, shape_params, "m2", m2, note=note)
            for i, m in enumerate(ms):
                if out_of_time():
                    break
                best = min((t, kind) for kind, ts in sweep_times.items() if (t := ts[i]) is not None)
                _dispatch_point(name, weight, m, table, best, **point)
        del weight
        free_memory()
        print(f"  [{BENCHMARK}] {name} [{n}, {k}] fp16: {time.perf_counter() - t0:.1f} s{found}", flush=True)
        if out_of_time():
            return table

    for name, n, k in shapes:
        if not bf16_ms or out_of_time():
            break
        t0 = time.perf_counter()
        weight = _weights(n, k, torch.bfloat16, device, gen)
        for m in bf16_ms:
            if out_of_time():
                break
            _kernels_point(name, weight, m, m <= gemv_max_m, **point)
        del weight
        free_memory()
        print(f"  [{BENCHMARK}] {name} [{n}, {k}] bf16: {time.perf_counter() - t0:.1f} s", flush=True)
    return table


def _weights(n: int, k: int, dtype: torch.dtype, device, gen) -> list[torch.Tensor]:
    """Random ``[n, k]`` weights scaled by ``1/sqrt(k)`` (outputs of order 1, as in a model):
    as many copies as the graph timing cycles over (`GRAPH_FOOTPRINT`, `MAX_COPIES`); the
    eager timings use the first."""
    w = (torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)).to(dtype)
    copies = min(MAX_COPIES, max(1, -(-GRAPH_FOOTPRINT // max(1, w.numel() * w.element_size()))))
    return [w] + [w.clone() for _ in range(copies - 1)]


def _kernels_point(name: str, weights: list[torch.Tensor], m: int, with_gemv: bool, results: Results, device, gen,
                   timer, graph_timer, ceilings: dict, split_ablation_ms) -> dict[str, dict[str, float]]:
    """Time cuBLAS, the flat GEMM and (``with_gemv``) the GEMV on one random ``x: [m, K]``,
    eagerly and as CUDA graphs; add their rows; return ``{"eager": {kernel: ms}, "graph":
    {kernel: ms}}``."""
    weight = weights[0]
    n, k = weight.shape
    dtype = weight.dtype
    x = torch.randn(m, k, device=device, generator=gen).to(dtype)
    outs = [torch.empty(m, n, device=device, dtype=dtype) for _ in weights]
    ref = F.linear(x.float(), weight.float())
    base = {"shape": name, "n": n, "k": k, "m": m, "dtype": dtype_name(dtype)}
    flops, nbytes = gemm_flops(m, n, k), gemm_bytes(m, n, k, dtype.itemsize)
    graph_note = f"per call, replaying a CUDA graph of {GRAPH_REPEATS} calls over {len(weights)} weight copies"

    def record(kind: str, ms: float, gms: float, out: torch.Tensor, cublas: tuple | None, extra=None) -> None:
        params = {**base, "kernel": kind, **(extra or {})}
        add = lambda *a, **kw: results.add(BENCHMARK, params, *a, **kw)  # noqa: E731
        peer = None if kind == "cublas" else "cublas"
        c_ms, c_gms = cublas if cublas else (None, None)
        add("time_ms", ms, peer, c_ms)
        add("graph_time_ms", gms, peer, c_gms, note=graph_note)
        add("bandwidth_TBps", nbytes / (ms * 1e-3) / 1e12, peer, _rate(nbytes, c_ms, peer),
            fraction_of_ceiling=fraction(nbytes / (ms * 1e-3) / 1e12, ceilings.get("copy_TBps")),
            note="(N·K + M·K + M·N)·elem_bytes / time")
        add("graph_bandwidth_TBps", nbytes / (gms * 1e-3) / 1e12, peer, _rate(nbytes, c_gms, peer),
            fraction_of_ceiling=fraction(nbytes / (gms * 1e-3) / 1e12, ceilings.get("copy_TBps")),
            note="(N·K + M·K + M·N)·elem_bytes / graph time")
        add("TFLOPs", flops / (ms * 1e-3) / 1e12, peer, _rate(flops, c_ms, peer),
            fraction_of_ceiling=fraction(flops / (ms * 1e-3) / 1e12, ceilings.get("bf16_matmul_TFLOPs")))
        add("rel_err", rel_err(out, ref), "F.linear fp32", None)

    eager: dict[str, float] = {}
    graph: dict[str, float] = {}
    cublas_out = F.linear(x, weight)
    eager["cublas"] = timer(lambda: F.linear(x, weight))
    graph["cublas"] = graph_timer([lambda w=w, o=o: torch.matmul(x, w.t(), out=o) for w, o in zip(weights, outs)])
    record("cublas", eager["cublas"], graph["cublas"], cublas_out, None)
    for kind, fn in (("flat_gemm", flat_gemm), ("gemv", gemv)):
        if kind == "gemv" and not with_gemv:
            continue
        cfg = pick_config(kind, x, weight)  # tunes on the first call of this shape and row bucket
        out = fn(x, weight, config=cfg)
        eager[kind] = timer(lambda fn=fn, cfg=cfg: fn(x, weight, config=cfg))
        graph[kind] = graph_timer([lambda fn=fn, cfg=cfg, w=w, o=o: fn(x, w, out=o, config=cfg)
                                   for w, o in zip(weights, outs)])
        record(kind, eager[kind], graph[kind], out, (eager["cublas"], graph["cublas"]), {"config": cfg.describe()})
        if cfg.split_k > 1 and m in split_ablation_ms:
            no_split_ms = timer(lambda fn=fn, cfg=cfg: fn(x, weight, config=cfg, split_k=1))
            results.add(BENCHMARK, {**base, "kernel": kind, "config": cfg.describe()}, "time_ms", eager[kind],
                        "no_split", no_split_ms, note=f"the same tile with split_k=1 instead of {cfg.split_k}")
    return {"eager": eager, "graph": graph}


def _dispatch_point(name: str, weights: list[torch.Tensor], m: int, table: DispatchTable, best: tuple[float, str],
                    results: Results, device, gen, timer, graph_timer, ceilings: dict, split_ablation_ms) -> None:
    """Time `linear` (the dispatcher, with ``table``) at one M, eagerly and as a CUDA graph,
    against ``best = (graph ms, kernel)``, the fastest kernel's graph time at this M (the
    eager row has no peer: the table was made from the graph times)."""
    weight = weights[0]
    n, k = weight.shape
    x = torch.randn(m, k, device=device, generator=gen).to(weight.dtype)
    chosen = choose_kernel(m, n, k, table)
    params = {"shape": name, "n": n, "k": k, "m": m, "dtype": dtype_name(weight.dtype), "kernel": "dispatch",
              "chosen": chosen}
    linear(x, weight, table=table)
    ms = timer(lambda: linear(x, weight, table=table))
    # The fastest kernel is the minimum of three noisy sweep times, which biases it low (by
    # several percent at the smallest shapes, whose calls last 2-3 µs). So the dispatcher is
    # compared with that kernel re-timed beside it: the same call form (output allocated per
    # call), graphs captured in alternation (the first of each pair alternating), the median of
    # DISPATCH_ROUNDS each.
    sweep_best_ms, best_kind = best
    best_call = {"cublas": F.linear, "flat_gemm": flat_gemm, "gemv": gemv}[best_kind]
    dispatch_fns = [lambda w=w: linear(x, w, table=table) for w in weights]
    best_fns = [lambda w=w: best_call(x, w) for w in weights]
    times = {"dispatch": [], "best": []}
    for i in range(DISPATCH_ROUNDS):
        for name in ("dispatch", "best")[::1 if i % 2 == 0 else -1]:
            times[name].append(graph_timer(dispatch_fns if name == "dispatch" else best_fns))
    gms, best_ms = statistics.median(times["dispatch"]), statistics.median(times["best"])
    nbytes = gemm_bytes(m, n, k, weight.element_size())
    results.add(BENCHMARK, params, "time_ms", ms, note=f"chose {chosen} (eager)")
    results.add(BENCHMARK, params, "graph_time_ms", gms, "best_of_three", best_ms,
                note=f"chose {chosen}; fastest in the sweep (graph times): {best_kind}, re-timed beside the "
                     f"dispatcher (median of {DISPATCH_ROUNDS} alternating captures, the order alternating; "
                     f"{sweep_best_ms * 1e3:.2f} µs in the sweep)")
    results.add(BENCHMARK, params, "bandwidth_TBps", nbytes / (ms * 1e-3) / 1e12,
                fraction_of_ceiling=fraction(nbytes / (ms * 1e-3) / 1e12, ceilings.get("copy_TBps")))
    results.add(BENCHMARK, params, "graph_bandwidth_TBps", nbytes / (gms * 1e-3) / 1e12, "best_of_three",
                nbytes / (best_ms * 1e-3) / 1e12,
                fraction_of_ceiling=fraction(nbytes / (gms * 1e-3) / 1e12, ceilings.get("copy_TBps")))


def _rate(amount: float, ms: float | None, peer: str | None) -> float | None:
    return amount / (ms * 1e-3) / 1e12 if ms and peer else None


# ----------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------
def summary(results: Results | dict) -> str:
    """Per shape: weight TB/s of each kernel by M, from the graph times and (after the
    slash) the eager ones, the flat GEMM and GEMV against cuBLAS (graph), the dispatcher
    against the best (graph), and the inflection points; then the bf16 points."""
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    bw: dict[tuple, dict] = {}
    for metric in ("graph_bandwidth_TBps", "bandwidth_TBps"):
        for r in select(data, BENCHMARK, metric):
            p = r["params"]
            bw.setdefault((p["dtype"], p["shape"], p["n"], p["k"]), {}).setdefault(p["m"], {})[
                (p["kernel"], metric)] = r["ours"]
    disp = {(r["params"]["shape"], r["params"]["m"]): r
            for r in select(data, BENCHMARK, "graph_time_ms", kernel="dispatch")}
    found = {(r["params"]["shape"], r["metric"]): r["ours"] for r in select(data, BENCHMARK)
             if r["metric"] in ("m1", "m2")}

    def f(x, fmt="{:.2f}"):
        return "—" if x is None else fmt.format(x)

    def ratio(a, b):
        return a / b if a and b else None

    lines = []
    for (dtype, shape, n, k), by_m in bw.items():
        m1, m2 = found.get((shape, "m1")), found.get((shape, "m2"))
        lines.append(f"{shape} [{n}, {k}] {dtype}" + (f": M1={m1}, M2={m2}" if m1 is not None else ""))
        lines.append(f"{'M':>5} {'gemv g/e':>11} {'flat g/e':>11} {'cublas g/e':>11} {'gemv/cub':>8} "
                     f"{'flat/cub':>8} {'chosen':>9} {'vs best':>7}   (TB/s of weights, graph/eager; "
                     "ratios and vs best = best_ms / dispatch_ms from graph times)")
        for m in sorted(by_m):
            row = by_m[m]
            g = {kind: row.get((kind, "graph_bandwidth_TBps")) for kind in ("gemv", "flat_gemm", "cublas")}
            e = {kind: row.get((kind, "bandwidth_TBps")) for kind in ("gemv", "flat_gemm", "cublas")}
            both = {kind: f"{f(g[kind])}/{f(e[kind])}" if e[kind] is not None else "—" for kind in g}
            d = disp.get((shape, m)) if dtype == "float16" else None
            lines.append(f"{m:>5} {both['gemv']:>11} {both['flat_gemm']:>11} {both['cublas']:>11} "
                         f"{f(ratio(g['gemv'], g['cublas'])):>8} {f(ratio(g['flat_gemm'], g['cublas'])):>8} "
                         f"{d['params']['chosen'] if d else '—':>9} {f(d['ratio'] if d else None):>7}")
        lines.append("")
    if found:
        lines.append(f"(shapes the table lacks take the nearest measured one; with none: M1={DEFAULT_THRESHOLDS[0]}, "
                     f"M2={DEFAULT_THRESHOLDS[1]})")
    return "\n".join(lines)


if __name__ == "__main__":
    from bench.run import main

    raise SystemExit(main(["--only", BENCHMARK]))
