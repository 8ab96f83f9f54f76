"""Triton kernels and their launchers, one module per chapter.

The package is ``minillm.kernels`` and not a top-level ``kernels``: a PyPI package named
``kernels`` exists, and ``transformers`` probes for it by import name, so a top-level folder
of that name on ``sys.path`` would be picked up by mistake.

Launchers are device-agnostic: on a CPU tensor they need ``TRITON_INTERPRET=1`` (set before
Triton is imported; ``minillm.testing`` and the notebooks do this when no GPU is present).
"""
import os as _os

import torch as _torch

# Without a GPU, run every kernel in Triton's interpreter (NumPy on the CPU). This must be
# decided before the kernel modules below are imported: @triton.jit reads it at decoration.
if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")
