"""Read the committed benchmark results (``bench/results/<gpu-slug>.json``).

The benchmark harness (``python -m bench.run``, run on a GPU machine by ``make gpu``) writes
one JSON file per GPU model; the notebooks read them through this module, so they can show
real measurements on a machine without a GPU. Pure Python (stdlib only): importing it needs
neither torch nor a GPU.

File layout (``schema`` 1)::

    {
      "schema": 1,
      "device": "NVIDIA H100 80GB HBM3",        # torch.cuda.get_device_name()
      "gpu_slug": "nvidia-h100-80gb-hbm3",      # the file's name without .json
      "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "python": "3.12.3",
      "date": "2026-11-20T12:00:00+00:00",      # ISO 8601, UTC, of the latest save
      "device_info": {"total_memory_bytes": ..., "multi_processor_count": ...},
      "ceilings": {"copy_TBps": 3.0, "bf16_matmul_TFLOPs": 790.0},   # measured in that run
      "runs": {"<benchmark>": {"date", "torch", "triton", "cuda", "ceilings", "status"}},
      "rows": [ {row}, ... ]
    }

Each row::

    {"benchmark": "ch01_naive_attention",       # which benchmark produced it
     "params": {"seq_len": 4096, "head_dim": 128, "causal": true, ...},   # the point measured
     "metric": "time_ms",                       # what was measured, with its unit in the name
     "ours": 1.23,                              # our implementation's value (None: did not run)
     "peer": "sdpa_math", "peer_value": 2.46,   # what we compare with, measured in the same run
     "ratio": 2.0,                              # > 1 means ours is better (see below)
     "better": "lower",                         # "lower" or "higher": which way is better
     "fraction_of_ceiling": 0.41,               # ours as a fraction of a measured ceiling
     "note": null, "device": "NVIDIA H100 80GB HBM3"}

``ratio`` is oriented so that **above 1 means ours is better**: for a lower-is-better metric
(times, bytes) it is ``peer_value / ours``; for a higher-is-better one (TFLOP/s, TB/s) it is
``ours / peer_value``. Units are in the metric names: ``_ms`` milliseconds, ``_bytes`` bytes,
``TFLOPs`` 10¹² floating-point operations per second, ``TBps`` 10¹² bytes per second.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
from pathlib import Path
from typing import Any, Iterable

#: Columns of `markdown_table` after the parameter columns.
VALUE_COLUMNS = ("metric", "ours", "peer", "peer_value", "ratio", "fraction_of_ceiling")


def results_dir() -> Path:
    """The folder of committed results: ``<repo>/bench/results`` (override with the
    environment variable ``MINILLM_RESULTS_DIR``)."""
    env = os.environ.get("MINILLM_RESULTS_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "bench" / "results"


def gpu_slug(device_name: str) -> str:
    """File-name form of a GPU's name: ``"NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return slug or "unknown-device"


def available(directory: str | os.PathLike | None = None) -> list[str]:
    """Slugs of the GPUs with a results file, sorted by name (``[]`` when there are none).

    A results file is ``<slug>.json``; other JSON files of the folder have a second suffix
    (``<slug>.flat_gemm.json``, Chapter 8's dispatch table) and are not results. Slugs never
    contain a dot (`gpu_slug`)."""
    d = Path(directory) if directory is not None else results_dir()
    if not d.is_dir():
        return []
    return sorted(p.stem for p in d.glob("*.json") if "." not in p.stem)


def load_results(slug: str | None = None, directory: str | os.PathLike | None = None) -> dict | None:
    """The results of one GPU as a dict (layout in the module docstring).

    ``slug=None`` picks the most recently saved file (by its ``date``; ties by name).
    Returns ``None`` when there is no such file (no results committed yet), so a notebook can
    print "no measurements yet" instead of failing.
    """
    d = Path(directory) if directory is not None else results_dir()
    if slug is not None:
        path = d / f"{slug}.json"
        return _read(path) if path.is_file() else None
    loaded = [r for r in (_read(d / f"{s}.json") for s in available(d)) if r is not None]
    if not loaded:
        return None
    return max(loaded, key=lambda r: (str(r.get("date") or ""), str(r.get("gpu_slug") or "")))


def ceilings(results: dict | None, benchmark: str | None = None) -> dict[str, float]:
    """The ceilings measured in the same run as ``benchmark``'s rows (each run of ``bench.run``
    measures its own, and a file holds rows of several runs), or, with ``benchmark=None``,
    in the run that saved the file last:
    ``{"copy_TBps": device-to-device copy, bytes read + written per second / 1e12,
    "bf16_matmul_TFLOPs": torch.matmul on random bf16 8192³}``; ``{}`` if unknown."""
    if not results:
        return {}
    if benchmark is not None:
        run = (results.get("runs") or {}).get(benchmark) or {}
        if run.get("ceilings"):
            return dict(run["ceilings"])
        # A run that measured none (a part that needs no ceiling) kept the rows of earlier
        # runs of the benchmark: their ceilings, the newest first, before the file's.
        for earlier in reversed((run.get("kept") or {}).get("runs") or []):
            if earlier.get("ceilings"):
                return dict(earlier["ceilings"])
    return dict(results.get("ceilings") or {})


def rows(results: dict | None, benchmark: str | None = None, metric: str | None = None,
         **param_filters: Any) -> list[dict]:
    """The rows of ``results`` that match every filter given.

    ``benchmark`` and ``metric`` match exactly. Each keyword ``name=value`` matches rows whose
    ``params[name] == value``; a list, tuple or set matches any of its values, and a callable
    is called with the parameter's value (e.g. ``seq_len=lambda n: n >= 4096``). A row without
    that parameter never matches. ``results=None`` gives ``[]``.
    """
    if not results:
        return []
    out = []
    for row in results.get("rows", []):
        if benchmark is not None and row.get("benchmark") != benchmark:
            continue
        if metric is not None and row.get("metric") != metric:
            continue
        params = row.get("params") or {}
        if all(_param_matches(params, k, v) for k, v in param_filters.items()):
            out.append(row)
    return out


def markdown_table(table_rows: Iterable[dict], columns: Iterable[str] | None = None) -> str:
    """A GitHub-markdown table of rows: one column per parameter (in first-seen order), then
    ``metric, ours, peer, peer_value, ratio, fraction_of_ceiling``. ``columns`` picks and
    orders the columns (parameter names or row keys). Numbers are shown with 4 significant
    digits, ``None`` as ``—``. Returns ``""`` for no rows."""
    table_rows = list(table_rows)
    if not table_rows:
        return ""
    if columns is None:
        param_keys: list[str] = []
        for r in table_rows:
            for k in (r.get("params") or {}):
                if k not in param_keys:
                    param_keys.append(k)
        columns = param_keys + list(VALUE_COLUMNS)
    columns = list(columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in table_rows:
        params = r.get("params") or {}
        cells = []
        for c in columns:
            value = r[c] if c in r and c != "params" else params.get(c)
            cells.append(format_value(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def format_value(value: Any) -> str:
    """How a cell is written in the markdown tables."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.4g}"
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value).replace("|", "\\|")


def _param_matches(params: dict, key: str, want: Any) -> bool:
    if key not in params:
        return False
    have = params[key]
    if callable(want):
        return bool(want(have))
    if isinstance(want, (list, tuple, set, frozenset)):
        return have in want
    return have == want


def _read(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``), without the
    "(R)", "(TM)", "CPU", "Processor" noise: e.g. ``"Intel Xeon @ 2.50GHz"``."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown"
    name = re.sub(r"\((R|TM|tm|r)\)|\bCPU\b|\bProcessor\b", " ", name)
    return re.sub(r"\s+", " ", name).strip()
