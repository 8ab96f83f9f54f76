"""Run the benchmarks on the GPU and save ``bench/results/<gpu-slug>.json`` and ``.md``.

    python -m bench.run                      # every registered benchmark
    python -m bench.run --only ch01          # those whose name starts with "ch01"
    python -m bench.run --list               # the registered names

The ceilings (copy bandwidth, bf16 matmul rate) are measured once at the start, on the same
machine and in the same process as the benchmarks. The results are saved after each
benchmark, merging into the existing file of this GPU (other benchmarks' rows are kept), and
also when the run is interrupted (SIGTERM from ``timeout``, Ctrl-C): the interrupted
benchmark's rows are then saved with status "partial".
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
import time
import traceback

#: (name, module) in run order. A module provides ``run(results, device)``; optionally
#: ``summary(results) -> str`` (printed after it runs) and ``NEEDS_CEILINGS = False``.
#: Later chapters append theirs here.
BENCHMARKS: list[tuple[str, str]] = [
    ("ch01_naive_attention", "bench.ch01_naive_attention"),
    ("ch01_traffic", "bench.ch01_traffic"),
    ("ch02_decode_attention", "bench.ch02_decode_attention"),
    ("ch02_generation", "bench.ch02_generation"),
    ("ch03_online_softmax", "bench.ch03_online_softmax"),
    ("ch04_flash_attention", "bench.ch04_flash_attention"),
    ("ch04_ablations", "bench.ch04_ablations"),
    ("ch04_hopper", "bench.ch04_hopper"),   # sm_90 (FA3's ideas, FP8)
    ("ch04_gluon", "bench.ch04_gluon"),     # sm_90 (warp specialization in Gluon)
    ("ch05_paged_attention", "bench.ch05_paged_attention"),
    ("ch06_sharing", "bench.ch06_sharing"),
    ("ch06_copy_on_write", "bench.ch06_copy_on_write"),
    ("ch07_flash_decoding", "bench.ch07_flash_decoding"),
    ("ch07_gluon", "bench.ch07_gluon"),     # sm_90 (a loader warp and bulk copies in Gluon)
    ("ch08_flat_gemm", "bench.ch08_flat_gemm"),
    ("ch09_engine", "bench.ch09_engine"),
    ("ch10_fused_decode", "bench.ch10_fused_decode"),
    ("ch10_host_overhead", "bench.ch10_host_overhead"),   # host time only: runs on any machine
    ("ch11_virtual_memory", "bench.ch11_virtual_memory"),   # needs cuda-bindings
    ("ch12_mla", "bench.ch12_mla"),
    ("ch13_tensor_parallel", "bench.ch13_tensor_parallel"),   # needs 2 GPUs; records nothing with one
]


def select(only: list[str] | None) -> list[tuple[str, str]]:
    """Registered benchmarks whose name equals or starts with one of ``only`` (all if None)."""
    if not only:
        return list(BENCHMARKS)
    return [(name, mod) for name, mod in BENCHMARKS if any(name == o or name.startswith(o) for o in only)]


def _interrupt(signum, frame):  # SIGTERM -> KeyboardInterrupt, so the finally blocks save
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run minillm's benchmarks on the GPU.")
    ap.add_argument("--only", action="append", help="benchmark name or prefix (repeatable)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--list", action="store_true", help="list the registered benchmarks and exit")
    args = ap.parse_args(argv)

    chosen = select(args.only)
    if args.list:
        for name, mod in BENCHMARKS:
            print(f"{name:24s} {mod}")
        return 0
    if not chosen:
        print(f"no benchmark matches {args.only}; registered: {[n for n, _ in BENCHMARKS]}", flush=True)
        return 2

    import torch

    from bench.common import Results, measure_ceilings

    if not torch.cuda.is_available():
        print("bench.run: no CUDA device; the benchmarks only run on a GPU (make gpu)", flush=True)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    print(f"bench.run: {name}; torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"benchmarks {[n for n, _ in chosen]}", flush=True)

    modules = [(n, importlib.import_module(m)) for n, m in chosen]
    ceilings = None
    if any(getattr(mod, "NEEDS_CEILINGS", True) for _, mod in modules):
        t0 = time.perf_counter()
        ceilings = measure_ceilings(device)
        print(f"bench.run: ceilings {', '.join(f'{k}={v:.3f}' for k, v in ceilings.items())} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    results = Results(name, ceilings)

    failed: list[str] = []
    for bench_name, mod in modules:
        t0 = time.perf_counter()
        print(f"bench.run: {bench_name} ...", flush=True)
        interrupted = False
        try:
            mod.run(results, device)
        except KeyboardInterrupt:
            interrupted = True
            results.set_status(bench_name, "partial: interrupted")
            print(f"bench.run: {bench_name} interrupted; saving what was measured", flush=True)
        except Exception as exc:  # noqa: BLE001 - one benchmark's failure must not stop the others
            traceback.print_exc()
            results.set_status(bench_name, f"failed: {type(exc).__name__}: {exc}"[:300])
            failed.append(bench_name)
        finally:
            json_path, md_path = results.save(args.out)
        n_rows = sum(1 for r in results.rows if r["benchmark"] == bench_name)
        print(f"bench.run: {bench_name}: {n_rows} rows, {time.perf_counter() - t0:.1f} s, "
              f"status {results.status.get(bench_name, 'no rows')} -> {json_path}", flush=True)
        if interrupted:
            return 130
        summary = getattr(mod, "summary", None)
        if summary and n_rows:
            try:
                print(summary(results), flush=True)
            except Exception:  # noqa: BLE001 - a summary is only for the log
                traceback.print_exc()
    if failed:
        print(f"bench.run: failed: {failed}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
