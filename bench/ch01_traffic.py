"""Chapter 1: DRAM traffic of the three naive-attention passes, measured by Nsight Compute,
against the count of `minillm.costs.naive_attention_traffic`.

Three roles in one module:

``python -m bench.ch01_traffic --target --meta META.json``
    The program that ``ncu`` profiles: runs each pass (scores, softmax, pv) exactly once at
    one size (``PARAMS``: B=1, H=16, N=4096, D=128, bf16, not causal) on random inputs, and
    writes META.json (device name, sizes, the counted bytes). Prints only to stderr.

``python -m bench.ch01_traffic --parse NCU.csv --meta META.json [--out bench/results]``
    Pure parsing: reads ncu's CSV, adds rows to the results file of META's device (merging).

``run(results, device)`` (what ``python -m bench.run`` calls)
    Finds ``ncu``, runs it on ``--target`` in a subprocess (``ncu_command``), parses, adds rows.

Rows: benchmark ``ch01_traffic``, metric ``dram_read_bytes`` / ``dram_write_bytes``,
``params`` = ``PARAMS`` plus ``pass`` (``scores``, ``softmax``, ``pv``, and ``total`` when all
three were measured); ``ours`` = bytes ncu measured (``dram__bytes_read.sum`` /
``dram__bytes_write.sum``), ``peer`` = ``"count"``, ``peer_value`` = the counted bytes, so
``ratio`` = count / measured (> 1: less traffic than counted). ncu flushes the caches before
each profiled kernel (its default ``--cache-control all``), so these are cold-cache numbers.
Written data still in L2 when a kernel ends may not yet show as a DRAM write.

If ncu is missing or fails, nothing is recorded and the reason is printed: numbers are
never invented.
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BENCHMARK = "ch01_traffic"
PARAMS = {"batch": 1, "heads": 16, "seq_len": 4096, "head_dim": 128, "causal": False, "dtype": "bfloat16"}
#: pass name -> Triton kernel (function) name, as ncu reports it.
KERNELS = {"scores": "_scores_kernel", "softmax": "_softmax_kernel", "pv": "_pv_kernel"}
#: ncu metric -> (key in the traffic count, our metric name)
METRICS = {"dram__bytes_read.sum": ("read", "dram_read_bytes"),
           "dram__bytes_write.sum": ("write", "dram_write_bytes")}
#: bench.run need not measure the ceilings for this benchmark.
NEEDS_CEILINGS = False
NCU_TIMEOUT_S = float(os.environ.get("MINILLM_NCU_TIMEOUT_S", "240"))
REPO_ROOT = Path(__file__).resolve().parent.parent

_UNIT_SCALE = {"": 1, "byte": 1, "bytes": 1, "b": 1,
               "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
               "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


# ----------------------------------------------------------------------------------------
# ncu: finding it, the command line, parsing its CSV (pure Python)
# ----------------------------------------------------------------------------------------
def ncu_path() -> str | None:
    """The ``ncu`` executable: ``$NCU``, then PATH, then the usual install folders."""
    env = os.environ.get("NCU")
    if env and Path(env).is_file():
        return env
    found = shutil.which("ncu")
    if found:
        return found
    candidates = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)
    candidates += sorted(glob.glob("/usr/local/cuda*/bin/ncu"), reverse=True)
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


def ncu_command(ncu: str, python: str, meta_path: str | os.PathLike) -> list[str]:
    """The profiling command: the two DRAM byte counters of our three kernels, as CSV with
    values in base units (bytes), clocks left alone (``--clock-control none``), child
    processes included."""
    return [
        ncu,
        "--target-processes", "all",
        "--clock-control", "none",
        "--kernel-name-base", "function",
        "--kernel-name", "regex:" + "|".join(KERNELS.values()),
        "--metrics", ",".join(METRICS),
        "--csv",
        "--print-units", "base",
        python, "-m", "bench.ch01_traffic", "--target", "--meta", str(meta_path),
    ]


def to_number(text: str, unit: str) -> float:
    """A CSV cell in ``unit`` -> bytes. Thousands separators are removed; an unknown unit or
    a non-number raises ``ValueError`` (never guess)."""
    text = (text or "").strip().replace(",", "")
    scale = _UNIT_SCALE.get((unit or "").strip().lower())
    if scale is None:
        raise ValueError(f"unknown unit {unit!r}")
    return float(text) * scale


def parse_ncu_csv(text: str) -> list[dict]:
    """Records ``{"id", "kernel", "metric", "value"}`` (value in bytes) from ncu's ``--csv``
    output. Accepts the default "details" layout (one row per metric: ``Metric Name``,
    ``Metric Unit``, ``Metric Value``) and the ``--page raw`` layout (one row per kernel,
    a column per metric, an optional units row). Lines that are not CSV records (``==PROF==``
    messages, the program's own output) are skipped. Cells that cannot be read are skipped
    with a message on stderr."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    body = [line for line in lines[start:] if line.startswith('"')]
    reader = csv.DictReader(io.StringIO("\n".join(body)))
    fields = reader.fieldnames or []
    records: list[dict] = []

    def add(rid, kernel, metric, value, unit):
        try:
            records.append({"id": rid, "kernel": kernel, "metric": metric, "value": to_number(value, unit)})
        except ValueError as exc:
            print(f"ch01_traffic: skipping {metric} of {kernel}: {value!r} {unit!r} ({exc})", file=sys.stderr)

    if "Metric Name" in fields:
        for row in reader:
            if row.get("ID") == "ID":  # a repeated header
                continue
            add(row.get("ID"), row.get("Kernel Name", ""), row.get("Metric Name", ""),
                row.get("Metric Value", ""), row.get("Metric Unit", ""))
    else:
        rows = [r for r in reader if r.get("ID") != "ID"]
        units = rows.pop(0) if rows and not (rows[0].get("ID") or "").strip() else {}
        metric_cols = [f for f in fields if f in METRICS]
        for row in rows:
            for m in metric_cols:
                add(row.get("ID"), row.get("Kernel Name", ""), m, row.get(m, ""), units.get(m, ""))
    return records


def measured_by_pass(records: list[dict]) -> dict[str, dict[str, float]]:
    """``{pass: {ncu metric: bytes}}`` from parsed records (kernel names matched to passes
    by ``KERNELS``). If a kernel was profiled more than once, the first launch is used."""
    out: dict[str, dict[str, float]] = {}
    for rec in records:
        if rec["metric"] not in METRICS:
            continue
        for name, kernel in KERNELS.items():
            if kernel in rec["kernel"]:
                slot = out.setdefault(name, {})
                if rec["metric"] in slot:
                    print(f"ch01_traffic: {kernel} profiled more than once; using the first launch",
                          file=sys.stderr)
                else:
                    slot[rec["metric"]] = rec["value"]
    return out


def add_rows(results, measured: dict[str, dict[str, float]], meta: dict) -> int:
    """Add one row per (pass, metric) that ncu measured; returns how many were added."""
    counts = meta["counts"]
    params = dict(meta.get("params") or PARAMS)
    added = 0
    totals: dict[str, list[float]] = {}
    for name in KERNELS:
        for ncu_metric, (rw, metric) in METRICS.items():
            value = measured.get(name, {}).get(ncu_metric)
            if value is None:
                print(f"ch01_traffic: no {ncu_metric} for the {name} pass in ncu's output", file=sys.stderr)
                continue
            results.add(BENCHMARK, dict(params, **{"pass": name}), metric, int(round(value)),
                        "count", int(counts[name][rw]), better="lower",
                        note="ncu measured (cold caches) vs naive_attention_traffic count")
            totals.setdefault(metric, []).append((value, counts[name][rw]))
            added += 1
    for metric, pairs in totals.items():
        if len(pairs) == len(KERNELS):
            results.add(BENCHMARK, dict(params, **{"pass": "total"}), metric,
                        int(round(sum(p[0] for p in pairs))), "count", int(sum(p[1] for p in pairs)),
                        better="lower", note="sum of the three passes")
            added += 1
    return added


# ----------------------------------------------------------------------------------------
# The profiled program (GPU)
# ----------------------------------------------------------------------------------------
def profile_target(meta_path: str | os.PathLike) -> None:
    """Run each pass once at ``PARAMS`` on random inputs and write the meta file."""
    from minillm.costs import naive_attention_traffic
    from minillm.kernels.ch01_naive_attention import attention_scores, probs_times_values, row_softmax
    import torch

    from bench.common import environment

    p = PARAMS
    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    shape = (p["batch"], p["heads"], p["seq_len"], p["head_dim"])
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    torch.cuda.synchronize()
    scores = attention_scores(q, k, causal=p["causal"])
    probs, lse = row_softmax(scores, out_dtype=dtype)
    del scores
    out = probs_times_values(probs, v)
    torch.cuda.synchronize()
    if not torch.isfinite(out).all():
        raise RuntimeError("non-finite attention output in the profiled run")
    counts = naive_attention_traffic(p["batch"], p["heads"], p["heads"], p["seq_len"], p["seq_len"],
                                     p["head_dim"], torch.empty((), dtype=dtype).element_size())
    meta = {"device": torch.cuda.get_device_name(), "params": p, "counts": counts,
            "kernels": KERNELS, "env": environment()}
    Path(meta_path).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    print(f"ch01_traffic target: ran the three passes at {p}; wrote {meta_path}", file=sys.stderr)


# ----------------------------------------------------------------------------------------
# Orchestration
# ----------------------------------------------------------------------------------------
def parse_files(results, csv_path: str | os.PathLike, meta_path: str | os.PathLike) -> int:
    """Parse an ncu CSV with its meta file and add rows to ``results``; returns the count."""
    meta = json.loads(Path(meta_path).read_text(encoding="utf-8"))
    if results.device != meta.get("device"):
        print(f"ch01_traffic: warning: profiled on {meta.get('device')!r}, recording for {results.device!r}",
              file=sys.stderr)
    text = Path(csv_path).read_text(encoding="utf-8", errors="replace")
    return add_rows(results, measured_by_pass(parse_ncu_csv(text)), meta)


def run(results, device=None) -> None:
    """Profile the three passes with ncu in a subprocess and add the rows to ``results``.
    Records nothing (and says why) when ncu is missing or fails. ``device`` is unused (the
    subprocess uses the default CUDA device)."""
    ncu = ncu_path()
    if ncu is None:
        print(f"  [{BENCHMARK}] ncu not found (PATH, $NCU, /opt/nvidia/nsight-compute): nothing recorded",
              flush=True)
        return
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # leave the profiled process the memory
    except ImportError:
        pass
    artifacts = os.environ.get("MINILLM_ARTIFACTS")
    with tempfile.TemporaryDirectory() as tmp:
        meta, csv_path, err_path = Path(tmp, "ch01_traffic_meta.json"), Path(tmp, "ch01_traffic_ncu.csv"), \
            Path(tmp, "ch01_traffic_ncu.stderr")
        cmd = ncu_command(ncu, sys.executable, meta)
        print(f"  [{BENCHMARK}] {' '.join(cmd)}", flush=True)
        try:
            with open(csv_path, "w") as out, open(err_path, "w") as err:
                rc = subprocess.run(cmd, stdout=out, stderr=err, cwd=REPO_ROOT, timeout=NCU_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {NCU_TIMEOUT_S:.0f} s"
        if artifacts:
            for f in (csv_path, meta, err_path):
                if f.is_file():
                    shutil.copy(f, Path(artifacts) / f.name)
        if rc != 0 or not meta.is_file():
            tail = _diagnostics(csv_path, err_path)
            print(f"  [{BENCHMARK}] ncu failed (exit {rc}); nothing recorded. Last messages:\n{tail}", flush=True)
            return
        n = parse_files(results, csv_path, meta)
        if n == 0:
            print(f"  [{BENCHMARK}] no DRAM counters in ncu's output; nothing recorded:\n"
                  f"{_diagnostics(csv_path, err_path)}", flush=True)
        else:
            print(f"  [{BENCHMARK}] recorded {n} rows", flush=True)


def summary(results) -> str:
    """Measured / counted bytes per pass, as a short text table."""
    from minillm.results import rows as select

    data = results.to_dict() if hasattr(results, "to_dict") else results
    lines = [f"{'pass':>8} {'metric':>17} {'measured':>14} {'counted':>14} {'meas/count':>10}"]
    for r in select(data, BENCHMARK):
        ratio = f"{r['ours'] / r['peer_value']:.3f}" if r["ours"] and r["peer_value"] else "—"
        lines.append(f"{r['params'].get('pass', ''):>8} {r['metric']:>17} {r['ours']:>14} "
                     f"{r['peer_value']:>14} {ratio:>10}")
    return "\n".join(lines)


def _diagnostics(*paths: Path, lines: int = 15) -> str:
    out = []
    for p in paths:
        if p.is_file():
            text = p.read_text(errors="replace").splitlines()
            out += [f"    {p.name}: {line}" for line in text[-lines:]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="store_true", help="run the three passes once (under ncu)")
    ap.add_argument("--parse", metavar="NCU_CSV", help="parse ncu's CSV and add rows to the results file")
    ap.add_argument("--meta", metavar="META_JSON", help="the meta file written by --target")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)

    if args.target:
        profile_target(args.meta or "ch01_traffic_meta.json")
        return 0
    from bench.common import Results

    if args.parse:
        if not args.meta or not Path(args.meta).is_file():
            print("ch01_traffic: --parse needs the --meta file written by the profiled run; nothing recorded")
            return 1
        meta = json.loads(Path(args.meta).read_text(encoding="utf-8"))
        results = Results(meta["device"], ceilings=None, env=meta.get("env"))
        n = parse_files(results, args.parse, args.meta)
        if n == 0:
            print("ch01_traffic: no DRAM counters found in the CSV; nothing recorded")
            return 1
        paths = results.save(args.out)
        print(f"ch01_traffic: {n} rows -> {paths[0]}")
        return 0

    from bench.run import main as run_main

    return run_main(["--only", BENCHMARK] + (["--out", args.out] if args.out else []))


if __name__ == "__main__":
    raise SystemExit(main())
