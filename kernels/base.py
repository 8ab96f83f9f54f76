"""What every chapter's kernels share: the interpreter switch, and a launch with less host time.

Chapter modules import this one before they define a kernel, because ``@triton.jit`` reads
``TRITON_INTERPRET`` when it decorates: without a GPU the kernels run in Triton's interpreter
(NumPy on the CPU), and this is the one place that decides so.
"""
from __future__ import annotations

import inspect
import operator
import os

import torch

# Without a GPU, run every kernel in Triton's interpreter. Decided before Triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after the switch above)

__all__ = ["interpreting", "launch"]


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (``TRITON_INTERPRET`` set, as on a CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# ----------------------------------------------------------------------------------------
# Launching a Triton kernel with less host time: reuse the binary an earlier call found.
#
# ``kernel[grid](*args, **meta)`` costs about 30 µs of CPU per call in Triton 3.6 (measured on
# the H200 host, with the 48 arguments of Chapter 7's stage 1) before the launch itself: it
# binds the arguments to the signature, works out each one's specialization (the dtype and
# 16-byte alignment of pointers; whether an integer is 1, divisible by 16 or wider than 32
# bits), hashes the lot and looks the binary up. A decode step's kernels run 10-40 µs on the
# GPU, so without CUDA graphs that host time *is* the step's time.
#
# `launch` does that look-up once per distinct call. Its key holds every non-tensor argument
# *by value* and every tensor's dtype and alignment, which is finer than Triton's
# specialization: a hit is always the binary Triton itself would pick. A hit calls the
# compiled kernel's C launcher directly (about 7 µs on the same host). A miss, the
# interpreter, a launch hook (a profiler such as proton sets one) and autotuned kernels take
# Triton's normal path.
# ----------------------------------------------------------------------------------------
#: ``key -> (binary, constexpr values)``; emptied when it reaches `CACHE_SIZE` (the key holds
#: integer arguments by value, so an engine whose block tables widen adds one entry per width).
_BINARIES: dict[tuple, tuple] = {}
CACHE_SIZE = 4096
#: ``(kernel, argument types) -> (tensors getter, others getter)``: which arguments are tensors.
_LAYOUTS: dict[tuple, tuple] = {}


def _hooks_active() -> bool:
    """Whether Triton has a launch hook to call (None in 3.6; an empty HookChain in 3.9+)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return True  # an old Triton: no fast path
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel, grid: tuple, *args, **meta):
    """``kernel[grid](*args, **meta)`` with Triton's per-call binding skipped after the first
    call of each signature.

    ``kernel``: a ``@triton.jit`` function whose runtime arguments are all passed
    positionally in ``args`` and whose ``tl.constexpr`` parameters (those after them) come
    from ``meta`` or their defaults; ``meta`` may also hold launch options (``num_warps``,
    ``num_stages``). ``grid``: a tuple of 1-3 ints (not a callable)."""
    if _FAST and not _hooks_active():
        device = _driver.active.get_current_device()
        types = tuple(map(type, args))
        layout = _LAYOUTS.get((kernel, types))
        if layout is None:
            layout = _LAYOUTS[(kernel, types)] = _layout(types)
        tensors, others = layout
        # Tensors count by dtype and 16-byte alignment, everything else by value: `others`
        # holds the integers (and floats, None, bools) whose values Triton specializes on.
        key = (kernel, device, types, others(args), *meta.items(),
               *[(t.dtype, t.data_ptr() & 15 == 0) for t in tensors(args)])
        hit = _BINARIES.get(key)
        if hit is not None:
            binary, constexprs = hit
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            binary.run(grid[0], g1, g2, _driver.active.get_current_stream(device), binary.function,
                       binary.packed_metadata, None, None, None, *args, *constexprs)
            return binary
        binary = kernel[grid](*args, **meta)
        constexprs = _trailing_values(kernel, len(args), meta)
        if constexprs is not None and hasattr(binary, "packed_metadata"):
            if len(_BINARIES) >= CACHE_SIZE:
                _BINARIES.clear()
            _BINARIES[key] = (binary, constexprs)
        return binary
    return kernel[grid](*args, **meta)


def _layout(types: tuple) -> tuple:
    """Two functions of the argument tuple: its tensors, and its other arguments (tuples)."""
    def getter(positions):
        if len(positions) == 1:
            return lambda args, i=positions[0]: (args[i],)
        return operator.itemgetter(*positions) if positions else (lambda args: ())
    is_tensor = [issubclass(t, torch.Tensor) for t in types]
    return (getter([i for i, x in enumerate(is_tensor) if x]), getter([i for i, x in enumerate(is_tensor) if not x]))


def _trailing_values(kernel, n_args: int, meta: dict) -> tuple | None:
    """The values of ``kernel``'s parameters after its first ``n_args``, in signature order
    (from ``meta``, else the default), which the C launcher takes after the runtime
    arguments; None where the kernel is not a plain ``@triton.jit`` function or a value is
    missing (the call is then never cached)."""
    if not isinstance(kernel, triton.runtime.JITFunction):
        return None  # e.g. an Autotuner: its chosen config is not in the key
    values = []
    for name, param in list(inspect.signature(kernel.fn).parameters.items())[n_args:]:
        if name in meta:
            values.append(meta[name])
        elif param.default is not inspect.Parameter.empty:
            values.append(param.default)
        else:
            return None
    return tuple(values)


#: The fast path exists on a real GPU only: the interpreter has no binaries to reuse.
_FAST = not interpreting()
if _FAST:
    from triton.runtime import driver as _driver
