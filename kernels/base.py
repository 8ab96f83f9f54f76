"""What every chapter's kernels share.

- The interpreter switch (`interpreting`): without a GPU the kernels run in Triton's
  interpreter (NumPy on the CPU), and this is the one place that decides so. Triton reads
  ``TRITON_INTERPRET`` when it is imported (its own ``tl`` helpers are jitted then) and again at
  every ``@triton.jit``, so code that writes kernels takes ``triton`` and ``tl`` from here:
  ``from minillm.kernels.base import tl, triton``.
- Small helpers of the attention kernels: `LOG2E`/`LN2` (base-2 exponentials, Chapter 4),
  `block_d`, `dot_precision`, `scale_and_window`, `num_sms`, `head_dim_offsets`, and the
  online-softmax update itself (`online_softmax_update`, Chapter 3), which every attention
  kernel from Chapter 3 on calls once per tile of scores.
- `launch`: ``kernel[grid](...)`` with less host time (decode steps are launch-bound), and
  `recording`/`record_call`: launches recorded to be made again with other tensors.
"""
from __future__ import annotations

import functools
import inspect
import math
import operator
import os
import sys
import warnings
from types import BuiltinFunctionType

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Without a GPU, run every kernel in Triton's interpreter. Decided before Triton is imported.
_TRITON_WAS_IMPORTED = "triton" in sys.modules
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after the switch above)
import triton.language as tl  # noqa: E402

#: Triton's (major, minor): the version checks of the modules whose code depends on it.
TRITON_VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])

__all__ = ["triton", "tl", "interpreting", "launch", "LOG2E", "LN2", "LOG2E_C", "LN2_C", "CPU_NUM_SMS", "block_d",
           "dot_precision", "scale_and_window", "num_sms", "device_capability", "power_of_2_at_least",
           "head_dim_offsets", "online_softmax_update", "capture_calls", "graph_ms_per_call", "l2_copies", "recording",
           "Recording", "record_call",
           "is_recording", "unrecorded", "TensorAddress", "cached_descriptor", "clear_descriptor_cache",
           "DESCRIPTOR_CACHE_SIZE", "expanded_arguments", "direct_plan", "DIRECT_LAUNCH_VERSIONS", "TRITON_VERSION",
           "TensorDescriptor", "fence_async_shared", "mbarrier", "tma", "warpgroup_mma", "warpgroup_mma_wait",
           "gluon_tma_load", "gluon_tma_store", "gluon_warps_barrier", "gluon_put_index", "gluon_get_index",
           "gluon_reinterpret"]


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (``TRITON_INTERPRET`` set, as on a CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


if _TRITON_WAS_IMPORTED and interpreting() and type(tl.standard.sum).__name__ == "JITFunction":
    # Triton was imported for compiled kernels; its jitted `tl` helpers cannot run in the
    # interpreter. Say so now rather than fail later inside a kernel.
    warnings.warn("Triton was imported before minillm on a machine without a GPU, so kernels cannot run in "
                  "its interpreter: import minillm (or `from minillm.kernels.base import triton, tl`) first, "
                  "or set TRITON_INTERPRET=1 before starting Python.", RuntimeWarning, stacklevel=2)


# ----------------------------------------------------------------------------------------
# Host-side helpers of the attention launchers
# ----------------------------------------------------------------------------------------
#: The kernels exponentiate in base 2 (the GPU's special-function unit computes ``2^x``;
#: ``exp(x)`` costs an extra multiply): launchers fold ``log2 e`` into the softmax scale
#: (``qk_scale = scale · LOG2E``) and kernels convert a log-sum-exp back with ``· LN2``.
LOG2E = 1.4426950408889634   # log2(e): exp(x) = exp2(x · log2 e)
LN2 = 0.6931471805599453     # ln(2):   log(x) = log2(x) · ln 2
#: The same as compile-time constants, for use inside ``@triton.jit`` code (a kernel may only
#: read globals that are ``tl.constexpr``).
LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(LN2)
#: What `num_sms` reports without a GPU: an H200's (and H100 SXM's) 132 SMs, so that the
#: heuristics pick under the interpreter what they would pick on the book's GPU.
CPU_NUM_SMS = 132


def block_d(head_dim: int) -> int:
    """Head dim padded to a power of two >= 16 (``tl.arange`` and ``tl.dot`` need it); the
    padding columns are masked on load and store."""
    return max(16, power_of_2_at_least(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of every ``tl.dot``: exact IEEE products for fp32 inputs (the
    interpreter and the tests need them; tf32 would round the inputs to 10 bits), and the
    default for fp16/bf16, which go to the tensor cores with fp32 accumulation anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


def scale_and_window(head_dim: int, scale: float | None, window: int | None) -> tuple[float, int | None]:
    """The softmax scale (default ``1/sqrt(head_dim)``, must be > 0) and the sliding window
    (``None``, or a width >= 1 in tokens), checked; raises ``ValueError`` otherwise."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not scale > 0:  # the kernels fold log2(e) into it and take row maxima of scaled scores
        raise ValueError(f"scale must be > 0, got {scale}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return scale, window


def num_sms(device) -> int:
    """Streaming multiprocessors of ``device``: the CUDA device's ``multi_processor_count``,
    or `CPU_NUM_SMS` for a CPU (the interpreter), so the heuristics behave as on an H200.
    Cached per device: it is asked on every decode call, and the answer never changes."""
    return _num_sms(device if isinstance(device, torch.device) else torch.device(device))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return CPU_NUM_SMS


@functools.lru_cache(maxsize=None)
def device_capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)`` (a CUDA device), cached per device: a launcher
    that checks it on every call paid about 2.4 µs of an H200 host's time for it each time."""
    return torch.cuda.get_device_capability(device)


def power_of_2_at_least(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (0 for 0), as `triton.next_power_of_2`
    gives it, in plain Python: Triton's is a constexpr function since 3.6, and its wrapper costs
    about 3 µs of host time per call (0.1 µs here), which a launcher pays on every call."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


# ----------------------------------------------------------------------------------------
# Helpers inside the kernels
# ----------------------------------------------------------------------------------------
def capture_calls(fns: list, calls: int) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``calls`` calls of the callables ``fns`` in turn (call ``i`` is
    ``fns[i % len(fns)]``). Each is called once on a side stream first, so that compilation,
    tuning and allocations happen outside the capture, as capture requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    return graph


def l2_copies(n_bytes: int, device, most: int) -> int:
    """How many copies of ``n_bytes`` of operands a graph timing should take turns over: enough
    that together they outsize the L2 cache twice (so each call reads its operands from HBM, as
    in a model whose other layers evict them), at least 1, at most ``most``."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(most, -(-2 * l2 // max(1, n_bytes))))


def graph_ms_per_call(fns: list, calls: int, replays: int = 10) -> float:
    """Milliseconds per call of ``fns`` captured ``calls`` times in one graph (`capture_calls`):
    the median of ``replays`` replays timed with CUDA events, after one warm-up replay."""
    graph = capture_calls(fns, calls)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] / calls


@triton.jit
def head_dim_offsets(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Column offsets for the addresses of a ``[rows, BLOCK_D]`` tile, and ``d_ok: [1, BLOCK_D]``,
    the mask of the real columns (``BLOCK_D`` is the head dim padded to a power of two).

    The padding columns are masked on every load and store, so they are never accessed; their
    addresses are nonetheless clamped to the last real column, so that every address the kernel
    forms lies inside the tensor. On an H200 (Triton 3.6) a masked-off padding column whose
    address pointed past the tensor made Chapter 4's forward fault with an illegal memory
    access when K's head dim was not its contiguous axis (``test_forward_follows_strides``);
    with the clamp it does not. When ``HEAD_DIM == BLOCK_D`` nothing is clamped (a
    compile-time branch)."""
    offs = tl.arange(0, BLOCK_D)
    d_ok = (offs < HEAD_DIM)[None, :]
    if HEAD_DIM < BLOCK_D:
        offs = tl.minimum(offs, HEAD_DIM - 1)
    return offs, d_ok


@triton.jit
def online_softmax_update(m_i, l_i, s, qk_scale, MASKED: tl.constexpr):
    """Fold one tile of scores into the running statistics of the online softmax (Chapter 3),
    in base 2.

    - ``m_i, l_i: [ROWS]`` fp32: the running max of the scores (log2 units) and the running
      sum of ``2^(x - m_i)``; ``-inf`` and 0 before the first tile;
    - ``s: [ROWS, COLS]`` fp32. With ``MASKED``: already scaled (``x = s``, log2 units), with
      ``-inf`` where a (row, key) pair is invisible; a row may have seen no visible key yet.
      Without it: the raw ``q·k`` (``x = s · qk_scale``), every pair visible, and the scale is
      folded into the exponent (one FMA + exp2 per score, no separate multiply).

    Returns ``(p, alpha, l_new, m_new)``: ``p = 2^(x - m_new)`` ``[ROWS, COLS]`` (the tile's
    weights, for ``P V``), ``alpha = 2^(m_i - m_new)`` ``[ROWS]`` (how much everything summed
    so far shrinks under the new max: the caller rescales its accumulator by it),
    ``l_new = l_i · alpha + Σ p`` and ``m_new`` ``[ROWS]``.
    """
    if MASKED:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead avoids
        # (-inf) - (-inf) = NaN, and 2^(-inf) = 0 gives it p = 0 and alpha = 0.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_sub = m_new
        p = tl.math.exp2(s * qk_scale - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_new, m_new


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
# compiled kernel's launcher directly. With Triton 3.6 it skips the launcher's Python wrapper
# as well (`direct_plan`), which walks every argument to expand the tensor descriptors: a hit
# of Chapter 7's Gluon decode launch (40 arguments, two descriptors) took 36 µs of an H200
# host's time through the wrapper and 29 µs without it (`bench/host_time.py`,
# ``bench/results/raw/nvidia-h200.host_time_direct_launch.log``). A miss, the interpreter, a
# launch hook (a profiler such as proton sets one) and autotuned kernels take Triton's normal
# path.
# ----------------------------------------------------------------------------------------
#: ``key -> (binary, constexpr values, direct plan or None)``; emptied when it reaches
#: `CACHE_SIZE` (the key holds integer arguments by value, so an engine whose block tables
#: widen adds one entry per width).
_BINARIES: dict[tuple, tuple] = {}
CACHE_SIZE = 4096
#: ``(kernel, argument types) -> (tensors getter, others getter)``: which arguments are tensors.
_LAYOUTS: dict[tuple, tuple] = {}


def launch_cache() -> dict[tuple, tuple]:
    """A snapshot (a new dict) of `launch`'s cache: ``key -> (binary, constexpr values, direct
    plan)``, one entry per specialization launched through the fast path (empty under the
    interpreter); the plan is `direct_plan`'s (None: hits go through ``binary.run``)."""
    return dict(_BINARIES)


def clear_launch_cache() -> None:
    """Empty `launch`'s cache (the next launch of each specialization takes Triton's path)."""
    _BINARIES.clear()


def _hooks_active() -> bool:
    """Whether Triton has a launch hook to call (None in 3.6; an empty HookChain in 3.9+)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return True  # an old Triton: no fast path
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel, grid: tuple, *args, **meta):
    """``kernel[grid](*args, **meta)`` with Triton's per-call binding skipped after the first
    call of each signature (and recorded where a `recording` is open).

    ``kernel``: a ``@triton.jit`` function whose runtime arguments (tensors, host tensor
    descriptors, scalars) are all passed positionally in ``args`` and whose ``tl.constexpr``
    parameters (those after them) come from ``meta`` or their defaults; ``meta`` may also hold launch options (``num_warps``,
    ``num_stages``). ``grid``: a tuple of 1-3 ints (not a callable)."""
    if not (_FAST and not _hooks_active()):
        if _RECORDING is None:
            return kernel[grid](*args, **meta)
        if _FAST:
            _RECORDING.refuse("a launch hook is set")
        else:  # the interpreter: a replay calls the kernel again
            _RECORDING.add(functools.partial(_interpreted, kernel, grid, meta), args)
        with _unwatched():
            return kernel[grid](*args, **meta)
    device = _driver.active.get_current_device()
    types = tuple(map(type, args))
    layout = _LAYOUTS.get((kernel, types))
    if layout is None:
        layout = _LAYOUTS[(kernel, types)] = _layout(types)
    tensors, others, descriptors = layout
    # Tensors count by dtype and address modulo 16 (Triton specializes on 16-byte alignment),
    # tensor descriptors by dtype and box (their address, shape and strides are encoded at
    # every launch), everything else by value: `others` holds the integers (and floats, None,
    # bools) Triton specializes on. (`map` over C functions: no Python loop per tensor.)
    ts = tensors(args)
    key = (kernel, device, types, others(args), tuple(meta), tuple(meta.values()), tuple(map(_DTYPE_OF, ts)),
           tuple(map(_MISALIGNMENT, map(_ADDRESS_OF, ts))),
           *[(d.base.dtype, tuple(d.block_shape)) for d in descriptors(args)])
    hit = _BINARIES.get(key)
    if hit is None:
        with _unwatched():  # Triton's own binding and compiling
            binary = kernel[grid](*args, **meta)
        constexprs = _trailing_values(kernel, len(args), meta)
        if constexprs is None or not hasattr(binary, "packed_metadata"):
            if _RECORDING is not None:
                _RECORDING.refuse(f"{getattr(kernel, '__name__', kernel)} is not launched through a cached binary")
            return binary
        if len(_BINARIES) >= CACHE_SIZE:
            _BINARIES.clear()
        _BINARIES[key] = (binary, constexprs, direct_plan(binary))
        if _RECORDING is not None:
            _record_binary(binary, _launcher_args(binary, grid, device, args, constexprs), descriptors(args))
        return binary
    binary, constexprs, direct = hit
    if direct is not None and _RECORDING is None:
        c_launch, cooperative, pdl, expansions = direct
        stream = _driver.active.get_current_stream(device)
        c_launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, binary.function,
                 cooperative, pdl, None, None, binary.packed_metadata, None, None, None,
                 *expanded_arguments(args, expansions), *constexprs)
        return binary
    launcher_args = _launcher_args(binary, grid, device, args, constexprs)
    if _RECORDING is not None:
        _record_binary(binary, launcher_args, descriptors(args))
    binary.run(*launcher_args)
    return binary


_DTYPE_OF = operator.attrgetter("dtype")
_ADDRESS_OF = torch.Tensor.data_ptr
_MISALIGNMENT = (15).__and__
#: Triton versions whose launcher `direct_plan` knows (its Python wrapper and the arguments
#: the C function takes before the kernel's own).
DIRECT_LAUNCH_VERSIONS = ((3, 6),)


def direct_plan(binary) -> tuple | None:
    """How `launch` calls ``binary``'s C launcher itself: ``(C function, cooperative, pdl,
    expansions)``, ``expansions`` the ``(position, metadata)`` pairs of the tensor-descriptor
    arguments that Triton's wrapper would expand (`expanded_arguments`). None where the
    wrapper does more than that (scratch memory to allocate), is not Triton 3.6's, or is not
    shaped as expected: the launch then goes through ``binary.run``."""
    if TRITON_VERSION not in DIRECT_LAUNCH_VERSIONS:
        return None
    run = binary.run
    if (type(run).__name__ != "CudaLauncher" or getattr(run, "global_scratch_size", 1)
            or getattr(run, "profile_scratch_size", 1) or not hasattr(run, "launch_pdl")):
        return None
    c_launch, expansions = run.launch, ()
    if not isinstance(c_launch, BuiltinFunctionType):  # the descriptors' wrapper around the C function
        code, cells = getattr(c_launch, "__code__", None), getattr(c_launch, "__closure__", None) or ()
        names = dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code else {}
        c_launch, indices, metas = names.get("launcher"), names.get("tensordesc_indices"), names.get("tensordesc_meta")
        if (not isinstance(c_launch, BuiltinFunctionType) or indices is None or metas is None
                or len(metas) != len(indices)):
            return None
        expansions = tuple(zip(sorted(indices), metas))
    return c_launch, run.launch_cooperative_grid, run.launch_pdl, expansions


def expanded_arguments(args: tuple, expansions: tuple, expand=None) -> tuple | list:
    """``args`` with the tensor descriptor at each position of ``expansions`` (``(position,
    metadata)`` pairs, positions ascending) replaced by ``expand(descriptor, metadata)``'s
    values (by default Triton's ``make_tensordesc_arg``: the encoded CUtensorMap, then the
    shape and strides), as Triton's launcher wrapper passes them to the C function."""
    if not expansions:
        return args
    if expand is None:
        from triton.backends.nvidia.driver import make_tensordesc_arg as expand
    out, start = [], 0
    for position, metadata in expansions:
        out += args[start:position]
        out += expand(args[position], metadata)
        start = position + 1
    out += args[start:]
    return out


def _launcher_args(binary, grid: tuple, device, args: tuple, constexprs: tuple) -> tuple:
    """What a compiled kernel's C launcher takes: the grid, the stream, the kernel and its
    metadata, no hooks, the runtime arguments, then the constexpr values."""
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    return (grid[0], g1, g2, _driver.active.get_current_stream(device), binary.function, binary.packed_metadata,
            None, None, None, *args, *constexprs)


def _record_binary(binary, launcher_args: tuple, descriptors: tuple) -> None:
    """Record a launch of a cached binary: its C launcher and everything it was called with."""
    if descriptors:  # a descriptor holds its tensor's address, which `Recording.bind` cannot see
        _RECORDING.refuse("a tensor descriptor was launched")
        return
    _RECORDING.add(binary.run, launcher_args, pointers=True)


def _interpreted(kernel, grid, meta, *args):
    """A recorded launch under the interpreter: the kernel called again."""
    kernel[grid](*args, **meta)


class TensorAddress:
    """What a host tensor descriptor needs of its tensor at launch time: the address and dtype.
    A descriptor kept for reuse holds this instead of the tensor, so keeping it does not keep
    the tensor's memory alive."""
    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


#: Host tensor descriptors kept for reuse (`cached_descriptor`), at most this many before the
#: store is emptied.
DESCRIPTOR_CACHE_SIZE = 64
_DESCRIPTORS: dict[tuple, object] = {}


def cached_descriptor(key: tuple, make):
    """``make()``, a host tensor descriptor, built once per ``key`` (its tensor's address,
    device, shape, strides, dtype and box) and reused: a decode loop asks for the same
    descriptors every step, and building one runs Python checks. Descriptors built on a
    `TensorAddress` do not keep their tensor's memory alive."""
    desc = _DESCRIPTORS.get(key)
    if desc is None:
        if len(_DESCRIPTORS) >= DESCRIPTOR_CACHE_SIZE:
            _DESCRIPTORS.clear()
        desc = _DESCRIPTORS[key] = make()
    return desc


def clear_descriptor_cache() -> None:
    """Empty `cached_descriptor`'s store (the next call of each key builds its descriptor)."""
    _DESCRIPTORS.clear()


def _layout(types: tuple) -> tuple:
    """Three functions of the argument tuple: its tensors, its tensor descriptors (Triton's
    or Gluon's) and its other arguments (tuples)."""
    from triton.tools.tensor_descriptor import TensorDescriptor as TritonDescriptor

    descriptor_types = tuple(t for t in (TritonDescriptor, TensorDescriptor) if t is not None)

    def getter(positions):
        if len(positions) == 1:
            return lambda args, i=positions[0]: (args[i],)
        return operator.itemgetter(*positions) if positions else (lambda args: ())
    kind = ["tensor" if issubclass(t, torch.Tensor) else "descriptor" if issubclass(t, descriptor_types) else "other"
            for t in types]
    return tuple(getter([i for i, k in enumerate(kind) if k == want]) for want in ("tensor", "other", "descriptor"))


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


# ----------------------------------------------------------------------------------------
# Recording launches to replay them with other tensors (Chapter 10's eager layers).
#
# A decoder layer of a decode step launches the same ten kernels with the same grids and
# integers as the layer before it; only the pointers to its weights and its slice of the KV
# cache differ. `recording` keeps, for every launch made inside it, what the C launcher was
# called with; `Recording.replay` calls the launchers again with some pointers swapped. The
# Python of the wrappers (checks, allocation, planning, `launch`'s key) runs once, and a
# replayed launch costs the C launcher alone. A CUDA graph does the same for the whole step,
# in the driver.
#
# A recording is only good if *everything* the recorded code did on the device went through
# `launch` or `record_call`: a torch operator in between (a cuBLAS GEMM, an add) would be left
# out of the replay. While recording, a dispatch mode watches for such operators and marks the
# recording unusable (`Recording.reason`); allocation and views are allowed (they queue no work).
# ----------------------------------------------------------------------------------------
#: aten operators that may run between recorded launches: they allocate or make views, and
#: queue no work on the device.
_NO_WORK_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view", "reshape",
    "_reshape_alias", "slice", "select", "as_strided", "t", "transpose", "unsqueeze", "squeeze", "permute",
    "expand", "alias", "detach", "split", "split_with_sizes", "narrow", "unbind", "view_as", "unflatten",
    "flatten", "contiguous", "lift_fresh", "resolve_conj", "resolve_neg"})
_RECORDING: "Recording | None" = None


class Recording:
    """The launches made inside a `recording` block, to be made again by `replay`.

    ``calls``: ``(launcher, arguments, pointers)`` triples (the compiled kernel's C launcher
    with its grid, stream and runtime arguments, ``pointers`` True: it takes tensors' addresses
    as plain integers; under the interpreter a call of the kernel, and `record_call`'s
    calls: False); ``reason``: None while every operation was recorded, else why the
    recording cannot be replayed (an operator that did device work outside `launch`, an
    autotuned kernel, a tensor descriptor, a launch hook)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.reason: str | None = None
        self._swaps: list[tuple] | None = None
        self._templates: list[list] = []

    def add(self, fn, args, pointers: bool = False) -> None:
        """Record ``fn(*args)``: a call whose device work depends on its arguments only."""
        self.calls.append((fn, args, pointers))

    def refuse(self, reason: str) -> None:
        """Mark the recording unusable (the first reason given is kept)."""
        if self.reason is None:
            self.reason = reason

    def bind(self, old: list[torch.Tensor]) -> bool:
        """Prepare `replay` to substitute the tensors ``old`` (by their address): every argument
        that starts where one of them starts is replaced. Returns False (and sets `reason`)
        where the recording cannot be replayed, or where an argument lies *inside* one of
        ``old`` without starting at its address (a view at an offset, which a substitute of
        the same address would not describe)."""
        if self.reason is not None:
            return False
        starts = {t.data_ptr(): j for j, t in enumerate(old)}
        spans = [_extent(t) for t in old]
        swaps, templates = [], []
        for c, (_, args, pointers) in enumerate(self.calls):
            template = list(args)
            for i, a in enumerate(args):
                if not isinstance(a, torch.Tensor):
                    continue
                p = a.data_ptr()
                if pointers:  # the C launcher reads the address: pass it, not the tensor
                    template[i] = p
                j = starts.get(p)
                if j is not None:
                    swaps.append((c, i, j, pointers))
                elif any(lo < p < hi for lo, hi in spans):
                    self.refuse(f"an argument of call {c} points inside a substituted tensor")
                    return False
            templates.append(template)
        self._swaps, self._templates = swaps, templates
        return True

    def replay(self, new: list[torch.Tensor]) -> None:
        """Make every recorded call again, with ``new[j]`` in place of `bind`'s ``old[j]``
        (same dtype, shape and 16-byte alignment: the compiled kernels were specialized on
        the old ones). The calls go to the stream they were recorded on."""
        if self._swaps is None:
            raise RuntimeError("bind the recording before replaying it")
        args = [t.copy() for t in self._templates]
        addresses = [t.data_ptr() for t in new]
        for c, i, j, pointers in self._swaps:
            args[c][i] = addresses[j] if pointers else new[j]
        for (fn, _, _), a in zip(self.calls, args):
            fn(*a)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """``(first, end)``: the byte addresses ``t``'s elements span."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else -1
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


class _WorkWatcher(TorchDispatchMode):
    """Marks ``recording`` unusable at the first aten operator that may queue device work
    (`_NO_WORK_OPS` excepted) outside a recorded call."""

    def __init__(self, recording: Recording):
        super().__init__()
        self.recording, self.paused = recording, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket.__name__ not in _NO_WORK_OPS:
            self.recording.refuse(f"{func} ran outside a recorded launch")
        return func(*args, **(kwargs or {}))


_WATCHER: _WorkWatcher | None = None


class recording:
    """``with recording() as rec:`` records every `launch` (and `record_call`) made inside the
    block into ``rec`` (a `Recording`), while running them as usual. Not nested, and one
    recording per process at a time: launches from another thread while it is open would be
    recorded too (an engine steps its model from one thread)."""

    def __enter__(self) -> Recording:
        global _RECORDING, _WATCHER
        if _RECORDING is not None:
            raise RuntimeError("recordings do not nest")
        _RECORDING = Recording()
        _WATCHER = _WorkWatcher(_RECORDING)
        _WATCHER.__enter__()
        return _RECORDING

    def __exit__(self, *exc) -> None:
        global _RECORDING, _WATCHER
        try:
            _WATCHER.__exit__(*exc)
        finally:
            _RECORDING, _WATCHER = None, None


class _unwatched:
    """``with _unwatched():`` the watcher of an open recording ignores the operators run
    inside (they belong to a recorded call, or to `unrecorded` work)."""

    def __enter__(self) -> None:
        if _WATCHER is not None:
            _WATCHER.paused += 1

    def __exit__(self, *exc) -> None:
        if _WATCHER is not None:
            _WATCHER.paused -= 1


class unrecorded(_unwatched):
    """``with unrecorded():`` device work that a replay must not repeat, launches included: a
    workspace made (and zeroed) once and kept for every later call, which the kernels leave
    as they found it; an autotuner timing its candidates before the first call of a shape."""

    def __enter__(self) -> None:
        global _RECORDING
        self.recording, _RECORDING = _RECORDING, None
        super().__enter__()

    def __exit__(self, *exc) -> None:
        global _RECORDING
        _RECORDING = self.recording
        super().__exit__(*exc)


def is_recording() -> bool:
    """Whether a `recording` is open."""
    return _RECORDING is not None


def record_call(fn, *args):
    """``fn(*args)``, recorded where a `recording` is open: for device work that is not a
    Triton launch (a cuBLAS GEMM into a given output). ``fn``'s work must depend on its
    arguments only, and it must write into tensors it is given (a replay reuses them)."""
    if _RECORDING is None:
        return fn(*args)
    _RECORDING.add(fn, args)
    with _unwatched():
        return fn(*args)


# ----------------------------------------------------------------------------------------
# Gluon on Hopper: the names the Gluon kernels use, bound once across Triton versions
# ----------------------------------------------------------------------------------------
# Gluon (``triton.experimental.gluon``) is experimental and renames things between releases:
# these are its sm_90 names under Triton 3.9, else 3.6 (torch 2.11's). A Triton without them
# leaves them None: the Gluon modules still import, their kernels do not compile.
try:
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402
    from triton.experimental import gluon as _gluon  # noqa: E402
    from triton.experimental.gluon import language as _gl  # noqa: E402
    from triton.experimental.gluon.language._core import builtin as _gl_builtin  # noqa: E402
except ImportError:
    fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = _gl = _gluon = None

#: A TMA copy global -> shared, shared -> global, and a barrier across one partition's warps.
gluon_tma_load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared", None)
gluon_tma_store = getattr(tma, "async_store", None) or getattr(tma, "async_copy_shared_to_global", None)
gluon_warps_barrier = getattr(_gl, "barrier", None) or getattr(_gl, "thread_barrier", None)

if _gluon is not None:
    # A loader warp telling its consumers which tile (or piece of work) sits in a ring slot.
    @_gluon.jit
    def gluon_put_index(slot, index):
        """The loader (one warp) leaves ``index`` in ``slot`` (one int32 of shared memory); its next
        arrival on the barrier that guards the slot releases it to the consumers."""
        slot.store(_gl.full([1], index, _gl.int32, _gl.BlockedLayout([1], [32], [1], [0])))

    @_gluon.jit
    def gluon_get_index(slot, NUM_WARPS: _gl.constexpr):
        """The index the loader left in ``slot`` (`gluon_put_index`), read by every thread of
        ``NUM_WARPS`` warps."""
        layout: _gl.constexpr = _gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        return _gl.max(slot.load(layout), axis=0)

    # A shared-memory buffer seen as another dtype: ``reinterpret`` in Triton 3.9, ``_reinterpret`` in 3.6.
    _REINTERPRET = "reinterpret" if hasattr(_gl.shared_memory_descriptor, "reinterpret") else "_reinterpret"

    @_gl_builtin
    def gluon_reinterpret(smem, dtype, shape, layout, _semantic=None):
        """``smem`` (a shared-memory descriptor) as a buffer of ``dtype``, ``shape``, ``layout``
        (the same bytes)."""
        return getattr(smem, _REINTERPRET)(dtype, shape, layout, _semantic=_semantic)
else:
    gluon_put_index = gluon_get_index = gluon_reinterpret = None
