"""What every benchmark shares: the measured ceilings, a timer, and the results collector.

Method: performance is reported as a ratio
against a peer measured in the same run, and as a fraction of ceilings measured in that same
run, never against datasheet numbers. Times are medians from ``triton.testing.do_bench``,
which flushes the L2 cache before every repetition (so every timing is cold-L2), on random
inputs (never zeros). Nothing here asserts a timing.

Triton is imported lazily, after the kernels' base module (`minillm.kernels.base`) has
decided whether kernels run in the interpreter.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any, Callable

from minillm.costs import gemm_flops
from minillm.results import gpu_slug, markdown_table, format_value

__all__ = ["measure_ceilings", "time_ms", "cpu_time_ms", "Results", "metric_direction", "gpu_slug",
           "environment", "is_oom", "DEFAULT_OUT", "rel_err", "TimeBudget", "fraction", "dtype_name", "time_sdpa",
           "shuffled_tables", "decode_error", "sequence_kv", "contiguous_cache", "paged_cache", "cuda_device",
           "sweep_start"]

#: Where ``Results.save`` writes by default (relative to the repository root).
DEFAULT_OUT = Path(__file__).resolve().parent / "results"

SCHEMA = 1

# Which way is better for a metric, read off its name (units live in metric names).
_LOWER_SUFFIXES = ("_ms", "_us", "_s", "_bytes", "rel_err")
_HIGHER_SUFFIXES = ("TFLOPs", "TBps", "GBps", "_per_s")


def metric_direction(metric: str) -> str | None:
    """``"lower"`` if smaller values of ``metric`` are better (times ``*_ms``, sizes
    ``*_bytes``, errors), ``"higher"`` for rates (``*TFLOPs``, ``*TBps``, ``*_per_s``),
    ``None`` if the name does not say."""
    if metric.endswith(_HIGHER_SUFFIXES):  # first: "tokens_per_s" must not read as "_s"
        return "higher"
    if metric.endswith(_LOWER_SUFFIXES):
        return "lower"
    return None


def compute_ratio(ours: Any, peer_value: Any, better: str | None) -> float | None:
    """``ratio`` of a row, oriented so that **> 1 means ours is better**.

    - lower-is-better metrics (times, bytes): ``peer_value / ours`` — e.g. our kernel at
      1 ms against a peer at 2 ms gives 2.0 ("2x faster");
    - higher-is-better metrics (TFLOP/s, TB/s): ``ours / peer_value``.

    ``None`` when either value is missing (did not run, out of memory), not a positive
    finite number, or ``better`` is unknown.
    """
    if better not in ("lower", "higher") or not _positive_number(ours) or not _positive_number(peer_value):
        return None
    return peer_value / ours if better == "lower" else ours / peer_value


def _positive_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


# ----------------------------------------------------------------------------------------
# Timing and ceilings (GPU only)
# ----------------------------------------------------------------------------------------
def time_ms(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds, from ``triton.testing.do_bench``.

    ``warmup`` and ``rep`` are milliseconds of warm-up and of timed repetitions (do_bench
    turns them into counts from a first estimate; at least one of each). do_bench clears
    the L2 cache before each timed call, so the result is a cold-cache time.
    """
    from triton.testing import do_bench

    try:
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    except TypeError:  # a Triton without return_mode: ask for the 0.5 quantile instead
        q = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5])
        return float(q[0] if isinstance(q, (list, tuple)) else q)


def interleaved_times(calls: dict[str, Callable[[], Any]], timer: Callable[[Callable[[], Any]], float],
                      rounds: int = 3) -> dict[str, float]:
    """``{name: ms}``, the median over ``rounds`` rounds of ``timer(fn)``, the calls taking
    turns within each round. Two kernels a few percent apart are then compared under the same
    drift of clocks and temperature, instead of one measured minutes after the other."""
    for fn in calls.values():  # compile and warm up every call first
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(timer(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


#: Calls captured per CUDA graph by `graph_time_ms` (its timings are per call).
GRAPH_REPEATS = 20


def graph_time_ms(fn, repeats: int = GRAPH_REPEATS, timer: Callable[[Callable[[], Any]], float] | None = None
                  ) -> float:
    """Milliseconds per call of ``fn`` when ``repeats`` calls are captured in one CUDA graph
    and the graph is replayed: the GPU's time without the host's launch overhead, which is
    what an engine that captures its decode step in a graph pays.

    ``fn`` is a callable, or a sequence of callables captured in turn (call ``i`` is
    ``fn[i % len(fn)]``; ``repeats`` is rounded up to a multiple of the length): give one
    per copy of the operands when one call's operands fit in the L2 cache, so each call
    reads them from HBM as it would in a model whose other layers evict them.

    ``timer(f) -> ms`` times the replay; by default median CUDA-event timings of 10
    replays after one warm-up replay (no L2 flush: with the copies, there is nothing to
    flush, and a flush would not reach inside the graph anyway). Each callable is called
    once on a side stream first (compilation, tuning, allocation happen outside the capture,
    as capture requires)."""
    from minillm.kernels.base import capture_calls, graph_ms_per_call

    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    calls = -(-repeats // len(fns)) * len(fns)
    if timer is None:
        return graph_ms_per_call(fns, calls)
    return timer(capture_calls(fns, calls).replay) / calls


def cpu_time_ms(fn: Callable[[], Any], warmup: int = 2, min_reps: int = 5, min_time_s: float = 0.25,
                max_reps: int = 1000) -> float:
    """Median wall time of ``fn()`` in milliseconds on the CPU (``time_ms`` needs CUDA).

    ``warmup`` untimed calls, then timed calls (``time.perf_counter`` around each) until at
    least ``min_reps`` calls and ``min_time_s`` seconds are done, or ``max_reps`` calls. No
    cache is flushed: the CPU's caches stay warm between repetitions.
    """
    import time

    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < min_time_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    mid = len(times) // 2
    median = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
    return median * 1e3


def measure_ceilings(device, copy_bytes: int = 1 << 30, matmul_n: int = 8192) -> dict[str, float]:
    """The two ceilings every fraction is taken of, measured now on ``device``.

    - ``copy_TBps``: ``dst.copy_(src)`` of ``copy_bytes`` (default 1 GiB, far larger than
      L2) of random data, counting bytes read **plus** bytes written, in 10¹² B/s.
    - ``bf16_matmul_TFLOPs``: ``torch.matmul`` of two random ``matmul_n``² bf16 matrices
      (default 8192³), ``2·n³`` FLOPs, in 10¹² FLOP/s.
    """
    import torch

    device = torch.device(device)
    n_elems = copy_bytes // 4
    src = torch.randn(n_elems, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    copy_tbps = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12
    del src, dst

    a = torch.randn(matmul_n, matmul_n, device=device, dtype=torch.bfloat16)
    b = torch.randn(matmul_n, matmul_n, device=device, dtype=torch.bfloat16)
    c = torch.empty(matmul_n, matmul_n, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.matmul(a, b, out=c))
    matmul_tflops = gemm_flops(matmul_n, matmul_n, matmul_n) / (ms * 1e-3) / 1e12
    del a, b, c
    torch.cuda.empty_cache()
    return {"copy_TBps": copy_tbps, "bf16_matmul_TFLOPs": matmul_tflops}


def is_oom(exc: BaseException) -> bool:
    """Whether an exception means the GPU ran out of memory (torch's OutOfMemoryError, or a
    library error that says so, e.g. cuBLAS failing to allocate its workspace)."""
    import torch

    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    if isinstance(exc, oom_type):
        return True
    msg = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in msg.lower() or "ALLOC_FAILED" in msg)


def free_memory() -> None:
    """Drop unreachable tensors and return the caching allocator's free blocks to the GPU,
    so the next benchmark point starts from an empty device."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def free_device_bytes(device) -> float:
    """Bytes the driver reports free on a CUDA ``device`` (what a new tensor can take beyond the
    caching allocator's own free blocks); unbounded on a CPU, where a dry run has no limit."""
    import torch

    device = torch.device(device)
    return float(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else math.inf


def attempt(fn: Callable[[], Any], allow_errors: bool = False) -> tuple[Any, str | None]:
    """Run ``fn()``; returns ``(value, None)``, or ``(None, "oom")`` if the GPU ran out of
    memory (the memory is then freed). With ``allow_errors`` any other exception gives
    ``(None, "error: …")`` (a peer that does not support this point); otherwise it
    propagates (a failure of our own kernel must be loud)."""
    status = None
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - sorted below
        if is_oom(exc):
            status = "oom"
        elif allow_errors:
            first = str(exc).splitlines()[0][:200] if str(exc) else ""
            status = f"error: {type(exc).__name__}: {first}"
        else:
            raise
    # Out of the except block, the traceback (and the tensors its frames hold) is gone.
    free_memory()
    return None, status


def environment() -> dict[str, Any]:
    """Versions and device facts recorded with the results (torch imported lazily; fields
    that cannot be read are ``None``)."""
    env: dict[str, Any] = {"torch": None, "triton": None, "cuda": None,
                           "python": platform.python_version(), "device_info": {}}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(torch.cuda.current_device())
            env["device_info"] = {"total_memory_bytes": int(p.total_memory),
                                  "multi_processor_count": int(p.multi_processor_count),
                                  "capability": f"{p.major}.{p.minor}"}
    except Exception:  # noqa: BLE001 - recording versions must never stop a benchmark
        pass
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    return env


# ----------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------
class Results:
    """Collects rows for one GPU and saves them to ``<out>/<gpu-slug>.json`` and ``.md``.

    ``ceilings`` are those measured in this run (``None`` when this run measured none, e.g.
    the traffic step; the saved file then keeps the ones already there). ``env`` overrides
    `environment` (tests use this).

    Saving merges with an existing file for the same GPU: the rows of every benchmark that
    has rows in this collector replace that benchmark's old rows; other benchmarks' rows are
    kept, so re-running one chapter never erases another's measurements. A benchmark that
    re-runs only some of its parts says which old rows to keep with `keep_previous`.
    """

    def __init__(self, device_name: str, ceilings: dict[str, float] | None = None,
                 env: dict[str, Any] | None = None):
        self.device = device_name
        self.slug = gpu_slug(device_name)
        self.ceilings = dict(ceilings) if ceilings else None
        self.env = environment() if env is None else dict(env)
        self.rows: list[dict] = []
        self.status: dict[str, str] = {}  # benchmark -> "complete" / "partial" / "failed: ..."
        self.keep: dict[str, tuple[Callable[[dict], bool], str]] = {}  # benchmark -> (old row -> keep?, why)

    def keep_previous(self, benchmark: str, keep: Callable[[dict], bool], why: str = "") -> None:
        """On saving, keep the old rows of ``benchmark`` for which ``keep(row)`` is true, next to
        this collector's (a partial re-run: the parts not re-run keep their earlier rows). The
        file's ``runs[benchmark]["kept"]`` then says how many rows are older, from which run."""
        self.keep[benchmark] = (keep, why)

    def add(self, benchmark: str, params: dict, metric: str, ours: Any,
            peer: str | None = None, peer_value: Any = None,
            fraction_of_ceiling: float | None = None, better: str | None = None,
            note: str | None = None) -> dict:
        """Record one measurement and return its row.

        ``ours``/``peer_value``: numbers (``None`` when that side did not run, e.g. out of
        memory; booleans for flag metrics such as ``"oom"``). ``better`` (``"lower"`` or
        ``"higher"``) defaults to `metric_direction` of the name; a row with a
        numeric peer value must know its direction, else ``ValueError``. ``ratio`` is
        computed by `compute_ratio` (> 1 means ours is better).
        """
        if better is None:
            better = metric_direction(metric)
        elif better not in ("lower", "higher"):
            raise ValueError(f"better must be 'lower' or 'higher', got {better!r}")
        if better is None and _positive_number(peer_value):
            raise ValueError(f"metric {metric!r}: say whether lower or higher is better (better=...)")
        row = {
            "benchmark": benchmark,
            "params": dict(params),
            "metric": metric,
            "ours": _clean(ours),
            "peer": peer,
            "peer_value": _clean(peer_value),
            "ratio": _clean(compute_ratio(ours, peer_value, better)),
            "better": better,
            "fraction_of_ceiling": _clean(fraction_of_ceiling),
            "note": note,
            "device": self.device,
        }
        self.rows.append(row)
        self.status.setdefault(benchmark, "complete")
        return row

    def set_status(self, benchmark: str, status: str) -> None:
        """Mark a benchmark ``"complete"``, ``"partial"`` (interrupted) or ``"failed: why"``."""
        self.status[benchmark] = status

    def benchmarks(self) -> list[str]:
        """Benchmarks with rows in this collector, in first-seen order."""
        return list(dict.fromkeys(r["benchmark"] for r in self.rows))

    def to_dict(self, existing: dict | None = None) -> dict:
        """The file's content: this collector merged into ``existing`` (an old file's dict)."""
        existing = existing or {}
        date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        new_benches = self.benchmarks()
        old_rows = [r for r in existing.get("rows", []) if isinstance(r, dict)]
        order = list(dict.fromkeys([r.get("benchmark") for r in old_rows] + new_benches))
        merged: list[dict] = []
        kept: dict[str, int] = {}
        for bench in order:
            if bench in new_benches and bench in self.keep:
                old = [r for r in old_rows if r.get("benchmark") == bench and self.keep[bench][0](r)]
                kept[bench] = len(old)
                merged.extend(old)
            source = self.rows if bench in new_benches else old_rows
            merged.extend(r for r in source if r.get("benchmark") == bench)

        runs = dict(existing.get("runs") or {})
        for bench in new_benches:
            previous = runs.get(bench) or {}
            runs[bench] = {"date": date, "torch": self.env.get("torch"), "triton": self.env.get("triton"),
                           "cuda": self.env.get("cuda"), "ceilings": self.ceilings,
                           "status": self.status.get(bench, "complete")}
            if kept.get(bench):
                earlier = previous.get("kept", {}).get("runs", []) + [
                    {k: previous.get(k) for k in ("date", "torch", "triton", "cuda", "ceilings", "status")}]
                runs[bench]["kept"] = {"rows": kept[bench], "why": self.keep[bench][1], "runs": earlier}
        return {
            "schema": SCHEMA,
            "device": self.device,
            "gpu_slug": self.slug,
            "torch": self.env.get("torch"),
            "triton": self.env.get("triton"),
            "cuda": self.env.get("cuda"),
            "python": self.env.get("python"),
            "date": date,
            "device_info": self.env.get("device_info") or existing.get("device_info") or {},
            "ceilings": self.ceilings if self.ceilings else (existing.get("ceilings") or {}),
            "runs": runs,
            "rows": merged,
        }

    def save(self, out_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
        """Write (merging) ``<out_dir>/<slug>.json`` and ``<out_dir>/<slug>.md``; returns
        both paths. Does nothing to the files when this collector has no rows."""
        out = Path(out_dir) if out_dir is not None else DEFAULT_OUT
        out.mkdir(parents=True, exist_ok=True)
        json_path, md_path = out / f"{self.slug}.json", out / f"{self.slug}.md"
        if not self.rows:
            return json_path, md_path
        existing = None
        if json_path.is_file():
            try:
                existing = json.loads(json_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                existing = None  # a broken file is replaced rather than merged
        data = self.to_dict(existing)
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(dumps(data), encoding="utf-8")
        tmp.replace(json_path)
        md_path.write_text(render_markdown(data), encoding="utf-8")
        return json_path, md_path


def dumps(data: dict) -> str:
    """The file's text: strict JSON (no NaN), one row per line so diffs stay readable."""
    head = json.dumps({k: v for k, v in data.items() if k != "rows"}, indent=1, allow_nan=False)
    rows = [json.dumps(r, allow_nan=False) for r in data.get("rows", [])]
    body = "[\n" + ",\n".join("  " + r for r in rows) + "\n ]" if rows else "[]"
    return head[:-2] + ',\n "rows": ' + body + "\n}\n"


def render_markdown(data: dict) -> str:
    """The ``.md`` companion of a results file: header, ceilings, one table per benchmark."""
    lines = [f"# Benchmark results: {data.get('device')}", ""]
    lines.append(f"Saved {data.get('date')} with torch {data.get('torch')}, triton {data.get('triton')}, "
                 f"CUDA {data.get('cuda')}. Generated by `python -m bench.run`; do not edit by hand.")
    lines.append("")
    ceil = data.get("ceilings") or {}
    if ceil:
        lines.append("Ceilings measured in the same run: "
                     + ", ".join(f"{k} = {format_value(v)}" for k, v in ceil.items())
                     + " (copy counts bytes read + written; matmul is torch.matmul, bf16, 8192³, random data).")
        lines.append("")
    lines.append("`ratio` > 1 means ours is better (peer/ours for times and bytes, ours/peer for rates); "
                 "`fraction_of_ceiling` is ours over the matching measured ceiling.")
    lines.append("")
    runs = data.get("runs") or {}
    by_bench: dict[str, list[dict]] = {}
    for r in data.get("rows", []):
        by_bench.setdefault(r.get("benchmark"), []).append(r)
    for bench, brows in by_bench.items():
        run = runs.get(bench) or {}
        lines.append(f"## {bench}")
        lines.append("")
        if run:
            lines.append(f"Run {run.get('date')}, status {run.get('status')}, torch {run.get('torch')}, "
                         f"triton {run.get('triton')}.")
            kept = run.get("kept") or {}
            if kept.get("rows"):
                lines[-1] += (f" {kept['rows']} rows kept from the earlier run of "
                              f"{(kept.get('runs') or [{}])[-1].get('date')} "
                              f"({kept.get('why') or 'parts not re-run'}).")
            lines.append("")
        lines.append(markdown_table(brows))
    return "\n".join(lines)


def _clean(x: Any) -> Any:
    """JSON-safe value: non-finite floats become None; numpy/torch scalars become Python."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if hasattr(x, "item") and not isinstance(x, (int, float)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def rel_err(ours, ref) -> float:
    """‖ours − ref‖ / ‖ref‖ of two tensors, in fp32."""
    ref = ref.float()
    return float((ours.float() - ref).norm() / ref.norm())


class TimeBudget:
    """A sweep's time budget: after ``seconds``, `spent` says so (once, in the log and in
    the benchmark's status, "partial") and the sweep starts no new point."""

    def __init__(self, results: "Results", benchmark: str, seconds: float):
        import time

        self._clock = time.perf_counter
        self.results, self.benchmark, self.seconds = results, benchmark, float(seconds)
        self.start = self._clock()

    def spent(self) -> bool:
        if self._clock() - self.start <= self.seconds:
            return False
        if not str(self.results.status.get(self.benchmark, "")).startswith("partial"):
            print(f"  [{self.benchmark}] time budget of {self.seconds:.0f} s spent: stopping early", flush=True)
            self.results.set_status(self.benchmark, f"partial: time budget {self.seconds:.0f} s spent")
        return True


# ----------------------------------------------------------------------------------------
# Small helpers of the attention benchmarks (torch is imported inside each function)
# ----------------------------------------------------------------------------------------
def cuda_device(device, what: str):
    """``torch.device(device)``, which must be a CUDA device; else ``RuntimeError("<what>
    needs a CUDA device")`` (``what``: e.g. ``"the Chapter 2 benchmark"``)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError(f"{what} needs a CUDA device")
    return device


def sweep_start(results: "Results", benchmark: str, device, seconds: float,
                timer: Callable[[Callable[[], Any]], float] | None, warmup_ms: int, rep_ms: int):
    """What a sweep sets up first: ``(timer, gen, out_of_time)``. ``timer(fn) -> ms`` is the
    given one, or `time_ms` with ``warmup_ms``/``rep_ms`` of warm-up and repetitions (in ms of
    GPU time); ``gen``: a torch generator on ``device`` seeded with 0 (the inputs); and
    ``out_of_time()``: `TimeBudget.spent` of a budget of ``seconds`` for ``benchmark``."""
    import torch

    timer = timer or (lambda fn: time_ms(fn, warmup=warmup_ms, rep=rep_ms))
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    return timer, gen, TimeBudget(results, benchmark, seconds).spent


def fraction(value: float | None, ceiling: float | None) -> float | None:
    """``value / ceiling``, both in the same unit (e.g. TB/s over the measured copy TB/s), as
    a dimensionless fraction; None when the value is missing or the ceiling is missing or 0."""
    return value / ceiling if value is not None and ceiling else None


def dtype_name(dtype) -> str:
    """A torch dtype as the results name it: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def time_sdpa(q, k, v, backend, timer: Callable):
    """``(median ms, out [B, H, D])`` of SDPA with a length-1 query (``q: [B, H, D]``) over
    the whole cache (``k, v: [B, H_kv, L, D]``; GQA when the head counts differ).
    ``backend`` is an ``SDPBackend`` to pin, or None for PyTorch's own choice; ``timer``
    times a callable in ms (e.g. `time_ms`). The backend context is entered once around the
    timing, so its (CPU) cost is not timed."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    q4 = q[:, :, None]  # [B, H, 1, D]
    gqa = q.shape[1] != k.shape[1]

    def call():
        return F.scaled_dot_product_attention(q4, k, v, enable_gqa=gqa)

    if backend is None:
        out = call()
        return timer(call), out[:, :, 0]
    with sdpa_kernel(backend):
        out = call()
        return timer(call), out[:, :, 0]


def shuffled_tables(batch: int, blocks_per_seq: int, device, gen):
    """Block tables, int32 ``[batch, blocks_per_seq]``: a random permutation (drawn from the
    torch generator ``gen``) of all ``batch·blocks_per_seq`` block ids of the pool (the worst
    case for locality)."""
    import torch

    perm = torch.randperm(batch * blocks_per_seq, device=device, generator=gen)
    return perm.to(torch.int32).view(batch, blocks_per_seq)


def decode_error(q, k_pool, v_pool, tables, context: int, out) -> float:
    """`rel_err` (dimensionless) of sequence 0's paged decode output ``out[:1]`` against SDPA
    in fp32 on its K/V gathered from the pool (``k_pool, v_pool: [num_blocks, block_size,
    kv_heads, head_dim]``) through ``tables[0]``, over ``context`` tokens."""
    import torch
    import torch.nn.functional as F

    block_size = k_pool.shape[1]
    rows = (tables[0].long()[:, None] * block_size + torch.arange(block_size, device=q.device)).reshape(-1)[:context]
    k0 = k_pool.reshape(-1, *k_pool.shape[2:])[rows].transpose(0, 1)[None].float()  # [1, Hkv, L, D]
    v0 = v_pool.reshape(-1, *v_pool.shape[2:])[rows].transpose(0, 1)[None].float()
    q0 = q[:1, :, None].float()                                                       # [1, Hq, 1, D]
    ref = F.scaled_dot_product_attention(q0, k0, v0, enable_gqa=q.shape[1] != k0.shape[1])[:, :, 0]
    return rel_err(out[:1], ref)


def sequence_kv(b: int, seed: int, context: int, kv_heads: int, head_dim: int, dtype, device):
    """Sequence ``b``'s keys and values ``[context, kv_heads, head_dim]`` (``context`` tokens),
    drawn from a generator seeded by ``(seed, b)``: the same values every time they are asked for."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 100_003 + b)
    k = torch.randn(context, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(context, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    return k, v


def contiguous_cache(seed: int, batch: int, kv_heads: int, context: int, head_dim: int, dtype, device):
    """``(k, v)`` ``[batch, kv_heads, context, head_dim]`` (SDPA's layout) of `sequence_kv`'s
    values, filled one sequence at a time."""
    import torch

    k = torch.empty(batch, kv_heads, context, head_dim, device=device, dtype=dtype)
    v = torch.empty_like(k)
    for b in range(batch):
        kb, vb = sequence_kv(b, seed, context, kv_heads, head_dim, dtype, device)
        k[b].copy_(kb.transpose(0, 1))
        v[b].copy_(vb.transpose(0, 1))
    return k, v


def paged_cache(seed: int, batch: int, kv_heads: int, context: int, head_dim: int, block_size: int, dtype, device,
                tables_gen):
    """``(k_pool, v_pool, tables)``: the same tokens as `contiguous_cache` in a pool of
    ``batch · context / block_size`` blocks of ``block_size`` tokens, each sequence's blocks a
    random permutation (`shuffled_tables` drawn from ``tables_gen``)."""
    import torch

    blocks = context // block_size
    tables = shuffled_tables(batch, blocks, device, tables_gen)
    k_pool = torch.empty(batch * blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    v_pool = torch.empty_like(k_pool)
    pos = torch.arange(context, device=device)
    for b in range(batch):
        kb, vb = sequence_kv(b, seed, context, kv_heads, head_dim, dtype, device)
        slots = tables[b].long()[pos // block_size] * block_size + pos % block_size
        k_pool.view(-1, kv_heads, head_dim)[slots] = kb
        v_pool.view(-1, kv_heads, head_dim)[slots] = vb
    return k_pool, v_pool, tables
