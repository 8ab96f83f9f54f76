"""The one helper every kernel test uses: compare a kernel with its NumPy reference.

What it checks, and why:

- **Fresh random inputs.** Each test run draws a new seed (printed in any failure message
  and fixed with ``MINILLM_SEED=<n>``), so the suite explores new inputs over time instead of
  passing on one lucky draw.
- **Poisoned outputs.** Output buffers are filled with NaN before the launch
  (`poisoned`), so an element the kernel forgot to write fails the comparison.
- **Dtype-aware tolerances** (`tolerance`): exact-ish for fp32 (dots use
  ``input_precision="ieee"``), looser for fp16 and bf16, whose inputs are already rounded.
- **Infinities compared exactly**: a masked score must be ``-inf``, not a large negative.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from minillm.kernels.base import interpreting  # noqa: F401  (tests define kernels: the switch first)

# The Triton interpreter has no bf16, so CPU runs test fp32 and fp16; bf16 runs on the GPU.
CPU_DTYPES = (torch.float32, torch.float16)
GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def default_device() -> torch.device:
    """CUDA when present, else CPU (where kernels run under ``TRITON_INTERPRET=1``)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def kernel_dtypes(device: torch.device | str | None = None) -> tuple[torch.dtype, ...]:
    """Dtypes kernels are tested in on ``device``."""
    device = torch.device(device or default_device())
    return GPU_DTYPES if device.type == "cuda" else CPU_DTYPES


def fresh_seed() -> int:
    """A new seed per call, unless ``MINILLM_SEED`` pins one to reproduce a failure."""
    pinned = os.environ.get("MINILLM_SEED")
    return int(pinned) if pinned else int.from_bytes(os.urandom(4), "little")


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for comparing a kernel computed in ``dtype`` with a float64 reference.

    fp16 keeps 11 significant bits (unit roundoff ~4.9e-4) and bf16 8 bits (~3.9e-3); outputs
    of attention are averages of rounded values, so a few ulps of slack suffice.
    """
    return {
        torch.float32: (1e-4, 1e-4),
        torch.float16: (4e-3, 4e-3),
        torch.bfloat16: (3e-2, 3e-2),
    }[dtype]


def random_tensor(shape, dtype: torch.dtype, device, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Standard-normal values (times ``scale``) drawn on the CPU from ``generator`` (so the
    same seed gives the same numbers on any device), then moved to ``device``/``dtype``."""
    return (scale * torch.randn(*shape, generator=generator, dtype=torch.float64)).to(device=device, dtype=dtype)


def poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer full of NaN: every element the kernel leaves unwritten stays NaN."""
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """float64 NumPy copy of a tensor on any device (bf16 included)."""
    return t.detach().to("cpu", torch.float64).numpy()


def assert_close(actual: torch.Tensor, expected: np.ndarray, dtype: torch.dtype, name: str = "output",
                 seed: int | None = None, atol: float | None = None, rtol: float | None = None) -> None:
    """Assert ``actual`` (a kernel's output) matches ``expected`` (the float64 reference).

    ``dtype`` is the dtype the kernel computed in (it picks the tolerance). Infinities must
    match exactly, NaN never matches (poisoned elements), and the error message reports the
    worst element, how many elements are off, and the seed to reproduce.
    """
    default_atol, default_rtol = tolerance(dtype)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    got = to_numpy(actual)
    want = np.asarray(expected, dtype=np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape} != reference shape {want.shape}")

    finite = np.isfinite(want)
    same_inf = ~finite & (got == want)  # -inf == -inf, +inf == +inf
    with np.errstate(invalid="ignore"):  # inf - inf where the reference is infinite
        err = np.where(finite, np.abs(got - want), 0.0)
    ok = np.where(finite, err <= atol + rtol * np.abs(want), same_inf)
    ok &= ~np.isnan(got)
    if ok.all():
        return
    bad = np.argwhere(~ok)
    first = tuple(int(i) for i in bad[0])
    with np.errstate(invalid="ignore"):
        worst_err = np.nanmax(np.where(finite & ~np.isnan(got), err, np.nan)) if (finite & ~np.isnan(got)).any() else float("nan")
    n_nan = int(np.isnan(got).sum())
    raise AssertionError(
        f"{name}: {len(bad)} of {want.size} elements differ from the reference "
        f"(dtype {dtype}, atol {atol:g}, rtol {rtol:g}); first at {first}: got {got[first]!r}, "
        f"expected {want[first]!r}; max abs error over finite elements {worst_err:.3g}; "
        f"{n_nan} NaN (unwritten/poisoned) elements"
        + (f"; reproduce with MINILLM_SEED={seed}" if seed is not None else "")
    )
