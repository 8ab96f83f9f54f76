"""Chapter 8's flat-GEMM dispatch tables on disk: ``bench/results/<gpu-slug>.flat_gemm.json``.

The kernels (`minillm.kernels.ch08_flat_gemm`) only take a `DispatchTable` value (their
default: `DEFAULT_THRESHOLDS` for every shape). Which table a GPU uses is decided here, at the
engine's level: `bench.ch08_flat_gemm` measures and saves one per GPU model (`save_table`), and
the model's linear layers (`minillm.model.torch_model.Linear`) run with the one of the GPU they
are on (`table_for_device`, read once per process).

File format (written by `save_table`; `DispatchTable.to_dict`)::

    {"schema": 1, "kind": "flat_gemm_dispatch",
     "rule": "M in a shape's exceptions: that kernel; else M <= m1: gemv; ...",
     "default": {"m1": 4, "m2": 64},
     "shapes": [{"n": 4096, "k": 4096, "m1": 1, "m2": 48, "exceptions": {"96": "flat_gemm"}}, ...],
     "info": {"device": "NVIDIA H200", "gpu_slug": "nvidia-h200", "dtype": "float16", ...}}

(No top-level ``date``: `minillm.results.load_results` takes the newest ``*.json`` of the
folder by that field, and must keep picking the benchmark results, not this table.)
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from minillm.kernels.ch08_flat_gemm import DispatchTable
from minillm.results import gpu_slug, results_dir

__all__ = ["SUFFIX", "table_path", "save_table", "load_table", "table_for_device"]

#: A dispatch table's file name is ``<gpu-slug>`` + this.
SUFFIX = ".flat_gemm.json"


def table_path(device_name: str, directory: str | os.PathLike | None = None) -> Path:
    """``<directory>/<gpu-slug>.flat_gemm.json``; the directory defaults to the committed
    results (`minillm.results.results_dir`, ``MINILLM_RESULTS_DIR`` overrides)."""
    return Path(directory if directory is not None else results_dir()) / f"{gpu_slug(device_name)}{SUFFIX}"


def save_table(table: DispatchTable, path: str | os.PathLike) -> Path:
    """Write ``table`` as JSON to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table.to_dict(), indent=1) + "\n", encoding="utf-8")
    return path


def load_table(path: str | os.PathLike) -> DispatchTable:
    """The table saved at ``path`` (`DispatchTable.from_dict` checks it)."""
    return DispatchTable.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


#: `table_for_device`'s cache: (device index, directory) -> table, and the asked arguments -> table.
_TABLES: dict[tuple, DispatchTable] = {}


def table_for_device(device: torch.device | str | int | None = None,
                     directory: str | os.PathLike | None = None) -> DispatchTable:
    """The table of the GPU ``device`` (default: the current CUDA device), read once per
    process and cached; an empty table (`DEFAULT_THRESHOLDS` everywhere) when that GPU has no
    file, or for a non-CUDA device."""
    asked = (device, directory)
    table = _TABLES.get(asked)  # asked on every linear layer's call, mostly with the same arguments
    if table is not None:
        return table
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    if device.type != "cuda":
        return DispatchTable()
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, None if directory is None else str(directory))
    if key not in _TABLES:  # read once per GPU
        path = table_path(torch.cuda.get_device_name(index), directory)
        _TABLES[key] = load_table(path) if path.is_file() else DispatchTable()
    if device.index is not None:  # "cuda" alone follows the current device: not cached by name
        _TABLES[asked] = _TABLES[key]
    return _TABLES[key]
