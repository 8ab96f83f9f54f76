#!/usr/bin/env bash
# Create .venv and install minillm (editable) with its dev extras.
#
# Why a script and not a bare `pip install -e .`: on a machine without an NVIDIA GPU the
# default Linux torch wheel drags in several GB of CUDA libraries that the CPU test suite
# never uses, so we install the CPU build of torch first. Idempotent: re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.minillm-installed"

if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then exit 0; fi

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "minillm needs Python >= 3.10"'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  if has_gpu; then
    pip install -q torch
  else
    echo "setup: no NVIDIA GPU found, installing the CPU build of torch"
    # --isolated: ignore pip config, whose extra indexes could serve the CUDA build instead.
    if ! pip --isolated install -q --retries 0 --timeout 20 torch --index-url https://download.pytorch.org/whl/cpu; then
      # The PyTorch CPU index is unreachable (an offline mirror, say): use a CPU wheel
      # from pip's configured find-links directories if one is there.
      wheel=""
      for d in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do
        cand=$(ls -1 "$d"/torch-*+cpu-cp"$("$VENV/bin/python" -c 'import sys;print(f"{sys.version_info[0]}{sys.version_info[1]}")')"-*.whl 2>/dev/null | sort -V | tail -n 1 || true)
        [ -n "$cand" ] && wheel=$cand && break
      done
      if [ -n "$wheel" ]; then
        echo "setup: PyTorch CPU index unreachable; using $wheel"
        pip install -q "$wheel"
      else
        echo "setup: no CPU torch wheel reachable; falling back to the default torch wheel" >&2
        pip install -q torch
      fi
    fi
  fi
fi
pip install -q -e ".[dev]"
touch "$stamp"
echo "setup: .venv ready ($("$VENV/bin/python" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'))"
