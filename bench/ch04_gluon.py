"""Chapter 4 benchmark, Gluon: FlashAttention-3's warp specialization written out, on an sm_90 GPU.

The forward points of ``bench/ch04_hopper.py`` (bf16, 16k tokens per point: batch · N =
16384, hidden 2048 = heads · head_dim, N from 1k to 16k, head dims 128 and 64, causal and not),
each timed with `triton.testing.do_bench` (median, L2 flushed) for:

- the Gluon kernels of `minillm.kernels.ch04_flash_attention_gluon`: ``pipelined`` (one kind
  of warp), ``ws`` (a loader warp and two consumer warpgroups; the module's default,
  `default_schedule`), the same kernel with each way of sharing out the tiles of `SCHEDULES`
  (``ws_grid``: one program per tile; ``ws_persistent``: one per SM, taking every P-th tile;
  ``ws_claimed``: claiming tiles from an atomic counter; under a causal mask ``ws_pairs`` and
  ``ws_claimed_pairs``: the same two with units of two tiles of equal total length), and
  ``ws_pingpong`` (the consumers take turns at the tensor cores);
- the peers, in the same process on the same inputs: SDPA pinned to cuDNN and to
  FlashAttention-2 (``sdpa_cudnn``, ``sdpa_flash``) and the Triton Hopper kernel of
  `minillm.kernels.ch04_flash_attention_hopper` with its default config (``triton_hopper``).

Rows (``params``: batch, heads, seq_len, head_dim, causal, dtype, kernel):

==============  ===========================================================================
``TFLOPs``      kernel ``ws`` (the default): one row per peer (sdpa_cudnn, sdpa_flash,
                triton_hopper), ratio > 1: ours faster; every other kernel: peer ``ws``
                (the ablations); fraction of the bf16 matmul rate measured in the run
``time_ms``     the same pairs in milliseconds
``rel_err``     ‖ours − SDPA cuDNN‖ / ‖SDPA cuDNN‖ for each Gluon kernel
==============  ===========================================================================

The bf16 kernel ``ws_tree`` is ``ws`` with the softmax's row max and sum as trees
(``tree_reductions=True``), an ablation against ``ws``.
FP8 (``dtype`` "fp8", the kernels of `FP8_KERNELS`: `flash_attention_gluon_fp8` on inputs
quantized beforehand, `prepare_gluon_fp8`, whose time is not included; ``fp8_ws`` and
``fp8_ws_pingpong`` as the module's defaults, P in registers and the reductions as trees;
``*_smem``: P through shared memory; ``fp8_ws_chain``: the reductions as chains): TFLOPs and
time_ms against peers ``ws`` and ``ws_pingpong`` (the bf16 Gluon kernels: ratio > 1 is FP8's
gain), ``triton_hopper`` and ``sdpa_cudnn``; rel_err against SDPA cuDNN's bf16 output.

The backward (``params["pass"] = "bwd"``; forward rows carry no ``pass``), at the same points:
`flash_attention_gluon_backward` on the Gluon forward's ``out`` and ``lse``, kernel ``bwd_tma``
(dQ added by TMA bulk reductions) against SDPA cuDNN's and FlashAttention-2's
backward (autograd through one saved forward) and the Triton Hopper backward
(`flash_attention_hopper_backward`, its default config, on the same ``out``/``lse``):
``TFLOPs`` (`minillm.costs.nominal_attention_flops` with ``backward=True``) and ``time_ms``;
the same for kernels ``bwd_atomic`` (dQ by element-wise atomics), ``bwd_tma_prefetch`` (the
rows of L and D loaded a step ahead; the module's default at head dim 64,
`default_prefetch_stats`) and, under a causal mask, ``bwd_tma_head_after_head`` (the key tiles
head after head instead of in groups of heads, `default_bwd_head_group`), which also have rows
against ``bwd_tma`` (the ablations);
and ``rel_err``, the largest of ‖dX − dX_cuDNN‖ / ‖dX_cuDNN‖ over dQ, dK and dV, for every
Gluon kernel and the Triton Hopper backward.

Every time is the median of ``MINILLM_CH04_GLUON_ROUNDS`` (default 3) `do_bench` medians in a
row: at 1-2k keys a causal kernel's time moved by as much as 23 % from one call of ``do_bench``
to the next on an H200 (which SM gets which tile differs from run to run), and one call
alone would let a single slow round decide a row. The forward sweep stops starting points
after ``MINILLM_CH04_GLUON_BUDGET_S`` seconds (default 150), the backward after
``MINILLM_CH04_GLUON_BWD_BUDGET_S`` (default 150).
The softmax part (``params["part"] = "softmax"``; N 2k, 4k and 16k, both head dims, causal and
not): two of FlashAttention-4's remedies for a softmax that the tensor cores outrun, in bf16 and
FP8, with and without ping-pong (`SOFTMAX_KERNELS`): one in eight of P's exponentials computed
by a polynomial on the FMA units (``*_fma8``) and a lazy running max (``*_lazy``); ``TFLOPs`` and
``time_ms`` of each against the same kernel without them (ratio > 1: the change pays), FP8
ones also against bf16 ``ws``. Budget ``MINILLM_CH04_GLUON_SOFTMAX_BUDGET_S`` (default 240).

The row-sum part (``params["part"] = "row_sum"``; the softmax part's points): the softmax's row
sums as a third matmul, P times a tile of ones, started with each P·V (``row_sum_mma=True``,
``*_row_sum`` in `ROW_SUM_KERNELS`), against the same kernel summing on the CUDA cores (and FP8's
with FMA exponentials or the lazy max on top against the kernel without them); FP8 ones
also against bf16 ``ws``, and those with three consumers or 256-key tiles against the FP8 kernel
as its defaults run it (``fp8_ws_row_sum``). Budget ``MINILLM_CH04_GLUON_ROW_SUM_BUDGET_S`` (default 200).

The pin part (``params["part"] = "pin"``; the softmax part's points): each block's softmax kept
in front of the wait for the P·V in flight in the machine code (``pin_softmax=True``, ``*_pin``
in `PIN_KERNELS`), which ptxas otherwise moves ahead of the exponentials, against the same
kernel without; bf16 and FP8 (row sums on the tensor cores, the default, and on the CUDA cores),
with and without ping-pong; FP8 ones also against bf16 ``ws``. Budget
``MINILLM_CH04_GLUON_PIN_BUDGET_S`` (default 200).

The wide part (``params["part"] = "wide"``; N 2k-16k, both head dims, causal and not): FP8 with
192-key blocks, each two tiles of 128 and 64 keys (``block_n=192``, `WIDE_KERNELS`;
FlashAttention-3's tile for e4m3 with V column-major, as our Vᵀ is), with the row sums on the
tensor cores (``*_row_sum``) and on the CUDA cores, with and without ping-pong, against the same
kernel summing on the CUDA cores, bf16 ``ws`` and the FP8 kernel as its defaults run it
(``fp8_ws_row_sum``, also timed, as is its ping-pong). Budget
``MINILLM_CH04_GLUON_WIDE_BUDGET_S`` (default 240).

The tiles part (``params["part"] = "tiles"``; N 2k-16k, both head dims, causal and not): FP8
with 256-key tiles of K and Vᵀ against the 128-key default (`TILE_KERNELS`: ws and ping-pong, P
in registers or through shared memory), each also against bf16 ``ws``. Budget
``MINILLM_CH04_GLUON_TILES_BUDGET_S`` (default 240).

The consumers part (``params["part"] = "consumers"``; both head dims without a mask, N 1k-16k):
three consumer warpgroups per program (192-row tiles, 160 registers a thread) against two
(128 rows, 240 registers), in bf16 and FP8, with and without ping-pong (`CONSUMER_KERNELS`):
``TFLOPs`` and ``time_ms`` of each against SDPA cuDNN and bf16 ``ws``, of each
three-consumer kernel against its two-consumer counterpart and of the ``_s4``/``_n128`` ones
against the kernel without that suffix; ``rel_err`` against cuDNN. Budget
``MINILLM_CH04_GLUON_CONSUMERS_BUDGET_S`` (default 240).

The dispatch part (``params["part"] = "dispatch"``, kernel ``fastest``; every forward point):
what a caller of `minillm.kernels.ch04_flash_attention_hopper.fastest_attention` gets, the
Gluon kernels with `fastest_forward`'s settings for the call (named in each row's note).
``TFLOPs`` and ``time_ms`` of the forward (`attention_forward`, no ``pass``) against SDPA
cuDNN's and against bf16 ``ws`` (the module's defaults); of the backward through autograd
(``pass`` "bwd", one saved forward) and of a whole training step's attention, forward and
backward (``pass`` "fwd_bwd"), against SDPA cuDNN's through autograd, the calls taking turns;
``host_ms``, the host's time per call of each of the three against cuDNN's (`host_ms`);
at N ≤ `GRAPH_MAX_SEQ`, where the host's time per step is close to the GPU's,
``graph_time_ms`` of the training step with `GRAPH_STEPS` steps captured in one CUDA graph
(the GPU's time alone, `graphed_step_ms`); ``rel_err`` of out and of the gradients against
cuDNN's. Budget
``MINILLM_CH04_GLUON_DISPATCH_BUDGET_S`` (default 240).

``MINILLM_CH04_GLUON_PARTS`` (default ``forward,backward,softmax,row_sum,pin,wide,tiles,consumers,
dispatch``) picks the parts to run; a re-run of some parts keeps the others' earlier rows in the
results file.
"""
from __future__ import annotations

import os
import statistics
from typing import Callable

import torch

from minillm.costs import nominal_attention_flops
from minillm.kernels.base import capture_calls
from minillm.kernels.ch04_flash_attention_gluon import (
    GLUON_VERSIONS, flash_attention_gluon, flash_attention_gluon_backward, flash_attention_gluon_fp8,
    default_schedule, default_tiles, fastest_forward, gluon_applies, prepare_gluon_fp8,
)
from minillm.kernels.ch04_flash_attention_hopper import (
    attention_forward, fastest_attention, flash_attention_hopper, flash_attention_hopper_backward,
)

from bench.ch04_hopper import (
    HEAD_DIMS, HIDDEN, REP_MS, SEQ_LENS, TOKENS, WARMUP_MS, autograd_backward, each_point, grads_and_ms, grads_err,
    sdpa_attention, timed_output,
)
from bench.common import (
    Results, attempt, cpu_time_ms, cuda_device, dtype_name, interleaved_times, rel_err, sweep_start,
)

BENCHMARK = "ch04_gluon"
DEFAULT_VARIANT = "ws"
PEERS = ("sdpa_cudnn", "sdpa_flash", "triton_hopper")
PARTS = ("forward", "backward", "softmax", "row_sum", "pin", "wide", "tiles", "consumers", "dispatch")
#: The backward's kernels, each setting spelled out (the module's default is ``bwd_tma`` at head
#: dim 128 and ``bwd_tma_prefetch`` at 64, `default_prefetch_stats`); the ablations are against
#: ``bwd_tma``.
BWD_KERNELS = {"bwd_tma": dict(dq_reduce="tma", prefetch_stats=False),
               "bwd_tma_prefetch": dict(dq_reduce="tma", prefetch_stats=True),
               "bwd_atomic": dict(dq_reduce="atomic", prefetch_stats=False),
               "bwd_tma_head_after_head": dict(dq_reduce="tma", prefetch_stats=False, head_group=1)}
#: Kernels that differ from ``bwd_tma`` only under a causal mask (the key tiles' order).
BWD_CAUSAL_ONLY = ("bwd_tma_head_after_head",)
BWD_BASE = "bwd_tma"
#: The FP8 kernels: (name, variant, P in "registers" or "smem", row max and sum as trees).
#: The first two are the module's defaults; the others each change one thing.
FP8_KERNELS = (("fp8_ws", "ws", "registers", True), ("fp8_ws_pingpong", "ws_pingpong", "registers", True),
               ("fp8_ws_smem", "ws", "smem", True), ("fp8_ws_pingpong_smem", "ws_pingpong", "smem", True),
               ("fp8_ws_chain", "ws", "registers", False))
#: The softmax part's kernels: name -> (dtype, variant, keyword arguments). Two of
#: FlashAttention-4's answers to a softmax that the tensor cores outrun, each against the same
#: variant without it: ``*_fma8``, one in eight of P's exponentials on the FMA units
#: (``fma_exp2=8``); ``*_lazy``, a running max that moves only by more than 8 and an
#: accumulator rescaled only when some row's does (``lazy_rescale=True``).
SOFTMAX_KERNELS = {
    "ws": ("bf16", "ws", {}), "ws_fma8": ("bf16", "ws", dict(fma_exp2=8)),
    "ws_lazy": ("bf16", "ws", dict(lazy_rescale=True)),
    "ws_pingpong": ("bf16", "ws_pingpong", {}), "ws_pingpong_fma8": ("bf16", "ws_pingpong", dict(fma_exp2=8)),
    "ws_pingpong_lazy": ("bf16", "ws_pingpong", dict(lazy_rescale=True)),
    "fp8_ws": ("fp8", "ws", {}), "fp8_ws_fma8": ("fp8", "ws", dict(fma_exp2=8)),
    "fp8_ws_lazy": ("fp8", "ws", dict(lazy_rescale=True)),
    "fp8_ws_pingpong": ("fp8", "ws_pingpong", {}), "fp8_ws_pingpong_fma8": ("fp8", "ws_pingpong", dict(fma_exp2=8)),
    "fp8_ws_pingpong_lazy": ("fp8", "ws_pingpong", dict(lazy_rescale=True)),
    "fp8_ws_pingpong_lazy_fma8": ("fp8", "ws_pingpong", dict(lazy_rescale=True, fma_exp2=8)),
}
#: The row-sum part's kernels (same form): each warp-specialized variant with the row sums of
#: P as a matmul ``P · 1`` (``row_sum_mma=True``) and without; in FP8 also with one in eight of
#: the exponentials on the FMA units (``*_fma8``) or the lazy running max (``*_lazy``) on top.
ROW_SUM_KERNELS = {
    "ws": ("bf16", "ws", {}), "ws_row_sum": ("bf16", "ws", dict(row_sum_mma=True)),
    "ws_pingpong": ("bf16", "ws_pingpong", {}),
    "ws_pingpong_row_sum": ("bf16", "ws_pingpong", dict(row_sum_mma=True)),
    # (FP8 sums on the tensor cores by default: the kernels without say so)
    "fp8_ws": ("fp8", "ws", dict(row_sum_mma=False)), "fp8_ws_row_sum": ("fp8", "ws", dict(row_sum_mma=True)),
    "fp8_ws_pingpong": ("fp8", "ws_pingpong", dict(row_sum_mma=False)),
    "fp8_ws_pingpong_row_sum": ("fp8", "ws_pingpong", dict(row_sum_mma=True)),
    "fp8_ws_row_sum_fma8": ("fp8", "ws", dict(row_sum_mma=True, fma_exp2=8)),
    "fp8_ws_pingpong_row_sum_fma8": ("fp8", "ws_pingpong", dict(row_sum_mma=True, fma_exp2=8)),
    "fp8_ws_row_sum_lazy": ("fp8", "ws", dict(row_sum_mma=True, lazy_rescale=True)),
    "fp8_ws_pingpong_row_sum_lazy": ("fp8", "ws_pingpong", dict(row_sum_mma=True, lazy_rescale=True)),
    # Where the sums are not on by default: three consumers (P through shared memory, 128-key
    # tiles in two stages: the consumers part's fastest three-consumer FP8 kernel) and 256-key
    # tiles (P through shared memory), each with and without.
    "fp8_ws_c3_smem_n128": ("fp8", "ws", dict(consumers=3, block_n=128, num_stages=2, p_in_registers=False,
                                               row_sum_mma=False)),
    "fp8_ws_c3_smem_n128_row_sum": ("fp8", "ws", dict(consumers=3, block_n=128, num_stages=2,
                                                       p_in_registers=False, row_sum_mma=True)),
    "fp8_ws_n256_smem": ("fp8", "ws", dict(block_n=256, p_in_registers=False, row_sum_mma=False)),
    "fp8_ws_n256_smem_row_sum": ("fp8", "ws", dict(block_n=256, p_in_registers=False, row_sum_mma=True)),
}
#: The pin part's kernels (same form): each with its softmax pinned ahead of the wait for P·V
#: (``pin_softmax=True``, ``*_pin``) and without; FP8 with its default row sums on the tensor cores
#: (``*_row_sum``) and with the sums on the CUDA cores.
PIN_KERNELS = {
    name + pin: (dtype, variant, dict(kw, pin_softmax=bool(pin)))
    for name, (dtype, variant, kw) in {
        "ws": ("bf16", "ws", {}), "ws_pingpong": ("bf16", "ws_pingpong", {}),
        "fp8_ws_row_sum": ("fp8", "ws", dict(row_sum_mma=True)),
        "fp8_ws_pingpong_row_sum": ("fp8", "ws_pingpong", dict(row_sum_mma=True)),
        "fp8_ws": ("fp8", "ws", dict(row_sum_mma=False)),
    }.items()
    for pin in ("", "_pin")
}
#: The FP8 kernel as `flash_attention_gluon_fp8`'s defaults run it (row sums on the tensor cores):
#: the row-sum part's kernels with other tiles or consumers are also timed against it.
FP8_DEFAULT = "fp8_ws_row_sum"
#: The wide part's kernels (same form): FP8 with 192-key blocks (``*_n192``), row sums on the
#: tensor cores (``*_row_sum``) or the CUDA cores, against bf16 ``ws`` and the FP8 defaults.
WIDE_KERNELS = {
    "ws": ("bf16", "ws", {}),
    FP8_DEFAULT: ("fp8", "ws", dict(row_sum_mma=True)),
    "fp8_ws_pingpong_row_sum": ("fp8", "ws_pingpong", dict(row_sum_mma=True)),
    **{f"fp8_{variant}_n192{suffix}": ("fp8", variant, dict(block_n=192, row_sum_mma=bool(suffix)))
       for variant in ("ws", "ws_pingpong") for suffix in ("", "_row_sum")},
}
#: The tiles part's FP8 kernels: name -> (variant, keys per tile, P in "registers" or "smem").
#: The 128-key ones are the forward part's ``fp8_ws`` and ``fp8_ws_pingpong``.
TILE_KERNELS = {
    "fp8_ws": ("ws", 128, "registers"), "fp8_ws_pingpong": ("ws_pingpong", 128, "registers"),
    "fp8_ws_n256": ("ws", 256, "registers"), "fp8_ws_pingpong_n256": ("ws_pingpong", 256, "registers"),
    "fp8_ws_n256_smem": ("ws", 256, "smem"), "fp8_ws_pingpong_n256_smem": ("ws_pingpong", 256, "smem"),
}
#: The consumers part's kernels: name -> (dtype, variant, P in "registers" or "smem" (FP8), consumer
#: warpgroups per program, {head dim: the other keyword arguments}; a kernel runs at the head dims
#: it names). The two-consumer ones are the forward part's defaults; the three-consumer ones take
#: `default_tiles` (at head dim 128: 64-key tiles, four stages) unless told.
EVERY_HEAD_DIM = {64: {}, 128: {}}
CONSUMER_KERNELS = {
    "ws": ("bf16", "ws", None, 2, EVERY_HEAD_DIM), "ws_c3": ("bf16", "ws", None, 3, EVERY_HEAD_DIM),
    "ws_pingpong": ("bf16", "ws_pingpong", None, 2, EVERY_HEAD_DIM),
    "ws_pingpong_c3": ("bf16", "ws_pingpong", None, 3, EVERY_HEAD_DIM),
    "fp8_ws": ("fp8", "ws", "registers", 2, EVERY_HEAD_DIM), "fp8_ws_c3": ("fp8", "ws", "registers", 3, EVERY_HEAD_DIM),
    "fp8_ws_c3_smem": ("fp8", "ws", "smem", 3, EVERY_HEAD_DIM),
    "fp8_ws_c3_smem_s4": ("fp8", "ws", "smem", 3, {64: dict(num_stages=4)}),
    "fp8_ws_c3_smem_n128": ("fp8", "ws", "smem", 3, {128: dict(block_n=128, num_stages=2)}),
    "fp8_ws_pingpong": ("fp8", "ws_pingpong", "registers", 2, EVERY_HEAD_DIM),
    "fp8_ws_pingpong_c3": ("fp8", "ws_pingpong", "registers", 3, EVERY_HEAD_DIM),
    "fp8_ws_pingpong_c3_smem": ("fp8", "ws_pingpong", "smem", 3, EVERY_HEAD_DIM),
    "fp8_ws_pingpong_c3_smem_s4": ("fp8", "ws_pingpong", "smem", 3, {64: dict(num_stages=4)}),
}
#: The consumers part's lengths (no mask).
CONSUMER_SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
#: The tiles part's lengths.
TILE_SEQ_LENS = (2048, 4096, 8192, 16384)
#: The softmax part's lengths (every head dim, causal or not).
SOFTMAX_SEQ_LENS = (2048, 4096, 16384)
#: Ways of sharing out the forward's tiles, each spelled out (`flash_attention_gluon`'s
#: ``persistent``, ``paired``, ``dynamic``, ``head_group``); the paired ones run under a causal
#: mask only.
SCHEDULES = {
    "ws_grid": dict(persistent=False, paired=False, dynamic=False, head_group=1),  # one program per tile
    "ws_persistent": dict(persistent=True, paired=False, dynamic=False, head_group=1),  # every P-th tile
    "ws_claimed": dict(persistent=True, paired=False, dynamic=True, head_group=8),  # tiles from a counter
    "ws_pairs": dict(persistent=True, paired=True, dynamic=False, head_group=8),  # every P-th pair
    "ws_claimed_pairs": dict(persistent=True, paired=True, dynamic=True, head_group=8),
}


def timing_rounds() -> int:
    """``do_bench`` calls per time (their median): ``MINILLM_CH04_GLUON_ROUNDS`` (default 3)."""
    return max(1, int(os.environ.get("MINILLM_CH04_GLUON_ROUNDS", "3")))


def median_of_rounds(timer: Callable, rounds: int) -> Callable:
    """A timer that returns the median of ``rounds`` calls of ``timer``."""
    return lambda fn: statistics.median(timer(fn) for _ in range(rounds))


def budget_s() -> float:
    """Seconds after which no new point is started: ``MINILLM_CH04_GLUON_BUDGET_S`` (default 150)."""
    return float(os.environ.get("MINILLM_CH04_GLUON_BUDGET_S", "150"))


def bwd_budget_s() -> float:
    """The backward's budget: ``MINILLM_CH04_GLUON_BWD_BUDGET_S`` (default 150)."""
    return float(os.environ.get("MINILLM_CH04_GLUON_BWD_BUDGET_S", "150"))


def tiles_budget_s() -> float:
    """The tiles part's budget: ``MINILLM_CH04_GLUON_TILES_BUDGET_S`` (default 240)."""
    return float(os.environ.get("MINILLM_CH04_GLUON_TILES_BUDGET_S", "240"))


def softmax_budget_s() -> float:
    """The softmax part's budget: ``MINILLM_CH04_GLUON_SOFTMAX_BUDGET_S`` (default 240)."""
    return float(os.environ.get("MINILLM_CH04_GLUON_SOFTMAX_BUDGET_S", "240"))


def row_sum_budget_s() -> float:
    """The row-sum part's budget: ``MINILLM_CH04_GLUON_ROW_SUM_BUDGET_S`` (default 200)."""
    return float(os.environ.get("MINILLM_CH04_GLUON_ROW_SUM_BUDGET_S", "200"))


def pin_budget_s() -> float:
    """The pin part's budget: ``MINILLM_CH04_GLUON_PIN_BUDGET_S`` (default 200)."""
    return float(os.environ.get("MINILLM_CH04_GLUON_PIN_BUDGET_S", "200"))


def wide_budget_s() -> float:
    """The wide part's budget: ``MINILLM_CH04_GLUON_WIDE_BUDGET_S`` (default 240)."""
    return float(os.environ.get("MINILLM_CH04_GLUON_WIDE_BUDGET_S", "240"))


def consumers_budget_s() -> float:
    """The consumers part's budget: ``MINILLM_CH04_GLUON_CONSUMERS_BUDGET_S`` (default 240)."""
    return float(os.environ.get("MINILLM_CH04_GLUON_CONSUMERS_BUDGET_S", "240"))


def dispatch_budget_s() -> float:
    """The dispatch part's budget: ``MINILLM_CH04_GLUON_DISPATCH_BUDGET_S`` (default 240)."""
    return float(os.environ.get("MINILLM_CH04_GLUON_DISPATCH_BUDGET_S", "240"))


def selected_parts() -> tuple[str, ...]:
    """The parts ``MINILLM_CH04_GLUON_PARTS`` names (default: all), in `PARTS` order."""
    names = {p.strip() for p in os.environ.get("MINILLM_CH04_GLUON_PARTS", ",".join(PARTS)).split(",")}
    unknown = names - set(PARTS) - {""}
    if unknown:
        raise ValueError(f"MINILLM_CH04_GLUON_PARTS: unknown part(s) {sorted(unknown)}; the parts are {PARTS}")
    return tuple(p for p in PARTS if p in names)


def row_part(row: dict) -> str:
    """The part that wrote a row of this benchmark."""
    params = row.get("params") or {}
    if params.get("part") in ("softmax", "row_sum", "pin", "wide", "tiles", "consumers", "dispatch"):
        return params["part"]
    return "backward" if params.get("pass") == "bwd" else "forward"


def run(results: Results, device) -> None:
    """Every point of the sweep on ``device`` (an sm_90 GPU), until the budget is spent; on
    another GPU, or with a Triton whose Gluon API the module does not know, nothing."""
    device = cuda_device(device, "the Chapter 4 Gluon benchmark")
    probe = torch.empty(1, 1, 128, 64, device=device, dtype=torch.bfloat16)
    if not gluon_applies(probe, probe, probe):
        print(f"  [{BENCHMARK}] needs an sm_90 GPU and Triton {GLUON_VERSIONS}: nothing measured", flush=True)
        return
    parts = selected_parts()
    if set(parts) != set(PARTS):
        results.keep_previous(BENCHMARK, lambda row: row_part(row) not in parts,
                              why=f"MINILLM_CH04_GLUON_PARTS={','.join(parts)}: the other parts' rows")
    if "forward" in parts:
        sweep(results, device)
    if "backward" in parts:
        backward_sweep(results, device)
    if "softmax" in parts:
        softmax_sweep(results, device)
    if "row_sum" in parts:
        row_sum_sweep(results, device)
    if "pin" in parts:
        pin_sweep(results, device)
    if "wide" in parts:
        wide_sweep(results, device)
    if "tiles" in parts:
        tiles_sweep(results, device)
    if "consumers" in parts:
        consumers_sweep(results, device)
    if "dispatch" in parts:
        dispatch_sweep(results, device)


def sweep(results: Results, device, head_dims=HEAD_DIMS, seq_lens=SEQ_LENS, tokens: int = TOKENS,
          hidden: int = HIDDEN, timer: Callable | None = None) -> None:
    timer, gen, out_of_time = sweep_start(results, BENCHMARK, device, budget_s(), timer, WARMUP_MS, REP_MS)
    timer = median_of_rounds(timer, timing_rounds())
    mm = (results.ceilings or {}).get("bf16_matmul_TFLOPs")
    each_point(BENCHMARK, head_dims, seq_lens, out_of_time,
               lambda head_dim, causal, n: _point(results, device, gen, n, head_dim, causal, mm, timer, tokens,
                                                  hidden))


def _point(results: Results, device, gen, n: int, head_dim: int, causal: bool, mm, timer, tokens: int,
           hidden: int) -> None:
    batch, heads = max(1, tokens // n), hidden // head_dim
    q, k, v = (torch.randn((batch, heads, n, head_dim), device=device, dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    flops = nominal_attention_flops(batch, heads, n, n, head_dim, causal)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    base = {"batch": batch, "heads": heads, "seq_len": n, "head_dim": head_dim, "causal": causal,
            "dtype": dtype_name(q.dtype)}

    peers = {"sdpa_cudnn": sdpa_attention("sdpa_cudnn", causal), "sdpa_flash": sdpa_attention("sdpa_flash", causal),
             "triton_hopper": lambda q, k, v: flash_attention_hopper(q, k, v, causal=causal)}
    peer_ms, cudnn_out = {}, None
    for name, fn in peers.items():
        res, status = attempt(lambda: timed_output(lambda: fn(q, k, v), timer), allow_errors=True)
        peer_ms[name] = (res[0] if res else None, status)
        if name == "sdpa_cudnn" and res:
            cudnn_out = res[1]

    # The kernels: the three steps, and the warp-specialized one with each way of sharing out
    # the tiles (`SCHEDULES`; "ws" is the module's default, `default_schedule`).
    kernels = {"ws": dict(variant="ws"), "pipelined": dict(variant="pipelined"),
               "ws_pingpong": dict(variant="ws_pingpong"), "ws_tree": dict(variant="ws", tree_reductions=True)}
    kernels.update({name: dict(variant="ws", **kw) for name, kw in SCHEDULES.items() if causal or not kw["paired"]})
    ours = {}
    for name, kw in kernels.items():
        ms, (out, _) = timed_output(lambda: flash_attention_gluon(q, k, v, causal=causal, **kw), timer)
        ours[name] = ms
        if cudnn_out is not None:
            results.add(BENCHMARK, {**base, "kernel": name}, "rel_err", rel_err(out, cudnn_out), "sdpa_cudnn",
                        note="‖ours − cuDNN‖ / ‖cuDNN‖")

    def add(kernel, ms, peer, p_ms, note):
        params = {**base, "kernel": kernel}
        results.add(BENCHMARK, params, "time_ms", ms, peer, p_ms, note=note)
        results.add(BENCHMARK, params, "TFLOPs", tflops(ms), peer, tflops(p_ms),
                    fraction_of_ceiling=tflops(ms) / mm if mm else None, note=note)

    for name, (p_ms, status) in peer_ms.items():
        add(DEFAULT_VARIANT, ours[DEFAULT_VARIANT], name, p_ms, status or None)
    for name in kernels:
        if name != DEFAULT_VARIANT:
            add(name, ours[name], DEFAULT_VARIANT, ours[DEFAULT_VARIANT],
                f"ablation against the default ({default_schedule(causal, n)})")
    fp8 = {}
    prepared = {where: prepare_gluon_fp8(q, k, v, p_in_registers=where == "registers")
                for where in ("registers", "smem")}
    for kernel, variant, where, tree in FP8_KERNELS:
        ms, (out, _) = timed_output(lambda: flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant,
                                                                      prepared=prepared[where],
                                                                      tree_reductions=tree), timer)
        fp8[kernel] = ms
        fp8_params = {**base, "dtype": "fp8", "kernel": kernel}
        note = ("e4m3 Q/K/V, scales per 64 rows of Q, per 128 keys of K, per head of V; quantization not included; "
                f"P {'in registers' if where == 'registers' else 'through shared memory'}; row max and sum as "
                f"{'trees' if tree else 'chains'}")
        if cudnn_out is not None:
            results.add(BENCHMARK, fp8_params, "rel_err", rel_err(out, cudnn_out), "sdpa_cudnn",
                        note="‖ours − cuDNN (bf16)‖ / ‖cuDNN‖")
        for peer, p_ms in (("ws", ours["ws"]), ("ws_pingpong", ours["ws_pingpong"]),
                           ("triton_hopper", peer_ms["triton_hopper"][0]), ("sdpa_cudnn", peer_ms["sdpa_cudnn"][0])):
            results.add(BENCHMARK, fp8_params, "time_ms", ms, peer, p_ms, note=note)
            results.add(BENCHMARK, fp8_params, "TFLOPs", tflops(ms), peer, tflops(p_ms),
                        fraction_of_ceiling=tflops(ms) / mm if mm else None, note=note)
    print(f"  [{BENCHMARK}] D={head_dim} causal={causal} N={n}: "
          + ", ".join(f"{v} {tflops(ms):.0f}" for v, ms in {**ours, **fp8}.items()) + "; "
          + ", ".join(f"{p} {tflops(ms) or 0:.0f}" for p, (ms, _) in peer_ms.items()) + " TFLOP/s", flush=True)


# ----------------------------------------------------------------------------------------
# The backward
# ----------------------------------------------------------------------------------------
def backward_sweep(results: Results, device, head_dims=HEAD_DIMS, seq_lens=SEQ_LENS, tokens: int = TOKENS,
                   hidden: int = HIDDEN, timer: Callable | None = None) -> None:
    """The backward rows (see the module's docstring) at every point, until `bwd_budget_s`."""
    timer, gen, out_of_time = sweep_start(results, BENCHMARK, device, bwd_budget_s(), timer, WARMUP_MS, REP_MS)
    timer = median_of_rounds(timer, timing_rounds())
    mm = (results.ceilings or {}).get("bf16_matmul_TFLOPs")
    each_point(BENCHMARK + " backward", head_dims, seq_lens, out_of_time,
               lambda head_dim, causal, n: _bwd_point(results, device, gen, n, head_dim, causal, mm, timer, tokens,
                                                      hidden))


def _bwd_point(results: Results, device, gen, n: int, head_dim: int, causal: bool, mm, timer, tokens: int,
               hidden: int) -> None:
    batch, heads = max(1, tokens // n), hidden // head_dim
    q, k, v, dout = (torch.randn((batch, heads, n, head_dim), device=device, dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))
    flops = nominal_attention_flops(batch, heads, n, n, head_dim, causal, backward=True)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    base = {"batch": batch, "heads": heads, "seq_len": n, "head_dim": head_dim, "causal": causal,
            "dtype": dtype_name(q.dtype), "pass": "bwd"}
    with torch.no_grad():
        out, lse = flash_attention_gluon(q, k, v, causal=causal)

    ours, grads = {}, {}
    for name, kw in BWD_KERNELS.items():  # an ablation that fails is recorded as missing; bwd_tma raises
        if name in BWD_CAUSAL_ONLY and not causal:
            continue
        res, _ = attempt(lambda kw=kw: grads_and_ms(
            lambda: flash_attention_gluon_backward(dout, q, k, v, out, lse, causal=causal, **kw), timer),
            allow_errors=name != BWD_BASE)
        ours[name] = res[1] if res else None
        if res:
            grads[name] = res[0]
    # Each peer's callable is built inside `attempt`: SDPA's forward itself may refuse.
    peers = {name: (lambda name=name: autograd_backward(sdpa_attention(name, causal), q, k, v, dout))
             for name in ("sdpa_cudnn", "sdpa_flash")}
    peers["triton_hopper"] = lambda: (lambda: flash_attention_hopper_backward(dout, q, k, v, out, lse, causal=causal))
    peer_ms = {}
    for name, make in peers.items():
        res, status = attempt(lambda: grads_and_ms(make(), timer), allow_errors=True)
        peer_ms[name] = res[1] if res else None
        if res:
            grads[name] = res[0]
        for kernel, ms in ours.items():
            params = {**base, "kernel": kernel}
            results.add(BENCHMARK, params, "time_ms", ms, name, peer_ms[name], note=status)
            results.add(BENCHMARK, params, "TFLOPs", tflops(ms), name, tflops(peer_ms[name]),
                        fraction_of_ceiling=tflops(ms) / mm if mm and ms else None, note=status)
    for kernel, ms in ours.items():
        if kernel != BWD_BASE:
            note = f"ablation against {BWD_BASE}"
            results.add(BENCHMARK, {**base, "kernel": kernel}, "time_ms", ms, BWD_BASE, ours[BWD_BASE], note=note)
            results.add(BENCHMARK, {**base, "kernel": kernel}, "TFLOPs", tflops(ms), BWD_BASE, tflops(ours[BWD_BASE]),
                        note=note)
    if "sdpa_cudnn" in grads:
        for name in (*ours, "triton_hopper"):
            if name in grads:
                results.add(BENCHMARK, {**base, "kernel": name}, "rel_err", grads_err(grads[name], grads["sdpa_cudnn"]),
                            "sdpa_cudnn", note="max over dQ, dK, dV of ‖ours − cuDNN‖ / ‖cuDNN‖")
    print(f"  [{BENCHMARK}] backward D={head_dim} causal={causal} N={n}: "
          + ", ".join(f"{name} {tflops(ms) or 0:.0f}" for name, ms in ours.items()) + "; "
          + ", ".join(f"{name} {tflops(ms) or 0:.0f}" for name, ms in peer_ms.items()) + " TFLOP/s", flush=True)


# ----------------------------------------------------------------------------------------
# The parts timed point by point (softmax, tiles)
# ----------------------------------------------------------------------------------------
def part_sweep(results: Results, device, part: str, budget: float, point: Callable, head_dims, seq_lens,
               tokens: int, hidden: int, timer: Callable | None, masks=(False, True)) -> None:
    """``point(results, device, gen, n, head_dim, causal, timer, tokens, hidden)`` at every point
    of one part (head dims, ``masks``, ``seq_lens``), until ``budget`` seconds are spent."""
    timer, gen, out_of_time = sweep_start(results, BENCHMARK, device, budget, timer, WARMUP_MS, REP_MS)
    timer = median_of_rounds(timer, timing_rounds())
    each_point(f"{BENCHMARK} {part}", head_dims, seq_lens, out_of_time,
               lambda head_dim, causal, n: point(results, device, gen, n, head_dim, causal, timer, tokens, hidden),
               masks)


# ----------------------------------------------------------------------------------------
# The softmax part: FlashAttention-4's exponentials on the FMA units and lazy rescaling
# ----------------------------------------------------------------------------------------
def softmax_sweep(results: Results, device, head_dims=HEAD_DIMS, seq_lens=SOFTMAX_SEQ_LENS, tokens: int = TOKENS,
                  hidden: int = HIDDEN, timer: Callable | None = None) -> None:
    """The softmax rows (`SOFTMAX_KERNELS`) at every point, until `softmax_budget_s`."""
    part_sweep(results, device, "softmax", softmax_budget_s(), _softmax_point, head_dims, seq_lens, tokens, hidden,
               timer)


def row_sum_sweep(results: Results, device, head_dims=HEAD_DIMS, seq_lens=SOFTMAX_SEQ_LENS, tokens: int = TOKENS,
                  hidden: int = HIDDEN, timer: Callable | None = None) -> None:
    """The row-sum rows (`ROW_SUM_KERNELS`) at the softmax part's points, until `row_sum_budget_s`."""
    point = lambda *args: _softmax_point(*args, kernels=ROW_SUM_KERNELS, part="row_sum")  # noqa: E731
    part_sweep(results, device, "row_sum", row_sum_budget_s(), point, head_dims, seq_lens, tokens, hidden, timer)


def pin_sweep(results: Results, device, head_dims=HEAD_DIMS, seq_lens=SOFTMAX_SEQ_LENS, tokens: int = TOKENS,
              hidden: int = HIDDEN, timer: Callable | None = None) -> None:
    """The pin rows (`PIN_KERNELS`) at the softmax part's points, until `pin_budget_s`."""
    point = lambda *args: _softmax_point(*args, kernels=PIN_KERNELS, part="pin")  # noqa: E731
    part_sweep(results, device, "pin", pin_budget_s(), point, head_dims, seq_lens, tokens, hidden, timer)


def wide_sweep(results: Results, device, head_dims=HEAD_DIMS, seq_lens=TILE_SEQ_LENS, tokens: int = TOKENS,
               hidden: int = HIDDEN, timer: Callable | None = None) -> None:
    """The wide rows (`WIDE_KERNELS`) at the tiles part's points, until `wide_budget_s`."""
    point = lambda *args: _softmax_point(*args, kernels=WIDE_KERNELS, part="wide")  # noqa: E731
    part_sweep(results, device, "wide", wide_budget_s(), point, head_dims, seq_lens, tokens, hidden, timer)


def _softmax_point(results: Results, device, gen, n: int, head_dim: int, causal: bool, timer, tokens: int,
                   hidden: int, kernels: dict = SOFTMAX_KERNELS, part: str = "softmax") -> None:
    """Every kernel of ``kernels`` (`SOFTMAX_KERNELS`) at one point: ``TFLOPs`` and ``time_ms``
    against the same variant and dtype without the change (``ws``, ``ws_pingpong``, ``fp8_ws``,
    ``fp8_ws_pingpong``: ratio > 1, the change pays), FP8 kernels also against bf16 ``ws``;
    rows of ``part``."""
    batch, heads = max(1, tokens // n), hidden // head_dim
    q, k, v = (torch.randn((batch, heads, n, head_dim), device=device, dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    flops = nominal_attention_flops(batch, heads, n, n, head_dim, causal)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    prepared = {}  # (keys per tile, P in registers) -> the quantized inputs
    ms = {}
    if causal:  # three consumers take no mask
        kernels = {name: kernel for name, kernel in kernels.items() if kernel[2].get("consumers", 2) != 3}
    for name, (dtype, variant, kw) in kernels.items():
        if dtype == "fp8":
            kw = dict(kw)
            where = (kw.get("block_n") or 128, kw.pop("p_in_registers", True))
            if where not in prepared:
                prepared[where] = prepare_gluon_fp8(q, k, v, where[0], p_in_registers=where[1])
            fn = lambda: flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant,  # noqa: E731
                                                   prepared=prepared[where], **kw)
        else:
            fn = lambda: flash_attention_gluon(q, k, v, causal=causal, variant=variant, **kw)  # noqa: E731
        ms[name], _ = timed_output(fn, timer)
    for name, (dtype, variant, kw) in kernels.items():
        params = {"batch": batch, "heads": heads, "seq_len": n, "head_dim": head_dim, "causal": causal,
                  "dtype": dtype, "kernel": name, "part": part}
        plain = ("fp8_" if dtype == "fp8" else "") + variant
        # the same kernel without its last change (summing on the CUDA cores, no FMA exponentials,
        # no lazy max, no pin), else the plain variant
        without = next((name.removesuffix(s) for s in ("_row_sum", "_fma8", "_lazy", "_pin")
                        if name.endswith(s) and name.removesuffix(s) in kernels), None)
        peers = [without] if without else [plain] if kw and plain != name and plain in kernels else []
        peers += (["ws"] if dtype == "fp8" else []) + ([FP8_DEFAULT] if {"block_n", "consumers"} & set(kw) else [])
        for peer in peers or [None]:
            p_ms = ms[peer] if peer else None
            results.add(BENCHMARK, params, "time_ms", ms[name], peer, p_ms, note=str(kw or "as the defaults"))
            results.add(BENCHMARK, params, "TFLOPs", tflops(ms[name]), peer, tflops(p_ms) if p_ms else None,
                        note=str(kw or "as the defaults"))
    print(f"  [{BENCHMARK} {part}] D={head_dim} causal={causal} N={n}: "
          + ", ".join(f"{name} {tflops(t):.0f}" for name, t in ms.items()) + " TFLOP/s", flush=True)


# ----------------------------------------------------------------------------------------
# FP8's tiles
# ----------------------------------------------------------------------------------------
def tiles_sweep(results: Results, device, head_dims=HEAD_DIMS, seq_lens=TILE_SEQ_LENS, tokens: int = TOKENS,
                hidden: int = HIDDEN, timer: Callable | None = None) -> None:
    """The tiles rows (`TILE_KERNELS`) at every point, until `tiles_budget_s`."""
    part_sweep(results, device, "tiles", tiles_budget_s(), _tiles_point, head_dims, seq_lens, tokens, hidden, timer)


def _tiles_point(results: Results, device, gen, n: int, head_dim: int, causal: bool, timer, tokens: int,
                 hidden: int) -> None:
    """The bf16 kernels ``ws`` and ``ws_pingpong`` and every FP8 kernel of `TILE_KERNELS` at one
    point: ``TFLOPs`` and ``time_ms`` of each FP8 kernel against bf16 ``ws`` (FP8's gain over
    our bf16 forward) and against the 128-key FP8 kernel of its variant (what the wider tile
    buys); ``rel_err`` against SDPA cuDNN's bf16 output."""
    batch, heads = max(1, tokens // n), hidden // head_dim
    q, k, v = (torch.randn((batch, heads, n, head_dim), device=device, dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    flops = nominal_attention_flops(batch, heads, n, n, head_dim, causal)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    cudnn_out = sdpa_attention("sdpa_cudnn", causal)(q, k, v)
    ms = {name: timed_output(lambda: flash_attention_gluon(q, k, v, causal=causal, variant=name), timer)[0]
          for name in ("ws", "ws_pingpong")}
    errs = {}
    for name, (variant, block_n, where) in TILE_KERNELS.items():
        prepared = prepare_gluon_fp8(q, k, v, block_n, p_in_registers=where == "registers")
        ms[name], (out, _) = timed_output(lambda: flash_attention_gluon_fp8(
            q, k, v, causal=causal, variant=variant, prepared=prepared, block_n=block_n), timer)
        errs[name] = rel_err(out, cudnn_out)
    for name, (variant, block_n, where) in TILE_KERNELS.items():
        params = {"batch": batch, "heads": heads, "seq_len": n, "head_dim": head_dim, "causal": causal,
                  "dtype": "fp8", "kernel": name, "part": "tiles"}
        note = f"{block_n}-key tiles of K and Vᵀ (K's scale per {block_n} keys), P in {where}"
        results.add(BENCHMARK, params, "rel_err", errs[name], "sdpa_cudnn",
                    note="‖ours − cuDNN (bf16)‖ / ‖cuDNN‖")
        for peer in ("ws", "fp8_" + variant):
            if peer != name:
                results.add(BENCHMARK, params, "time_ms", ms[name], peer, ms[peer], note=note)
                results.add(BENCHMARK, params, "TFLOPs", tflops(ms[name]), peer, tflops(ms[peer]), note=note)
    print(f"  [{BENCHMARK} tiles] D={head_dim} causal={causal} N={n}: "
          + ", ".join(f"{name} {tflops(t):.0f}" for name, t in ms.items()) + " TFLOP/s", flush=True)


# ----------------------------------------------------------------------------------------
# Three consumer warpgroups
# ----------------------------------------------------------------------------------------
def consumers_sweep(results: Results, device, seq_lens=CONSUMER_SEQ_LENS, tokens: int = TOKENS,
                    hidden: int = HIDDEN, timer: Callable | None = None) -> None:
    """The consumers rows (`CONSUMER_KERNELS`, no mask) at every point, until
    `consumers_budget_s`."""
    part_sweep(results, device, "consumers", consumers_budget_s(), _consumers_point, HEAD_DIMS, seq_lens, tokens,
               hidden, timer, masks=(False,))


def _consumers_point(results: Results, device, gen, n: int, head_dim: int, causal: bool, timer, tokens: int,
                     hidden: int) -> None:
    """Every kernel of `CONSUMER_KERNELS` and SDPA cuDNN at one point: ``TFLOPs`` and ``time_ms``
    of each kernel against cuDNN and bf16 ``ws`` and, with three consumers, against the same
    kernel with two (ratio > 1: the third consumer pays); ``rel_err`` against cuDNN."""
    batch, heads = max(1, tokens // n), hidden // head_dim
    q, k, v = (torch.randn((batch, heads, n, head_dim), device=device, dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    flops = nominal_attention_flops(batch, heads, n, n, head_dim, causal)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    ms = {}
    ms["sdpa_cudnn"], cudnn_out = timed_output(lambda: sdpa_attention("sdpa_cudnn", causal)(q, k, v), timer)
    kernels = {name: (dtype, variant, where, consumers, settings[head_dim])
               for name, (dtype, variant, where, consumers, settings) in CONSUMER_KERNELS.items()
               if head_dim in settings}
    prepared, errs = {}, {}
    for name, (dtype, variant, where, consumers, kw) in kernels.items():
        if dtype == "fp8":
            block_n = kw.get("block_n") or default_tiles(head_dim, True, consumers)[0]
            if (where, block_n) not in prepared:
                prepared[where, block_n] = prepare_gluon_fp8(q, k, v, block_n, p_in_registers=where == "registers")
            fn = lambda: flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant,  # noqa: E731
                                                   prepared=prepared[where, block_n], consumers=consumers, **kw)
        else:
            fn = lambda: flash_attention_gluon(q, k, v, causal=causal, variant=variant,  # noqa: E731
                                               consumers=consumers, **kw)
        ms[name], (out, _) = timed_output(fn, timer)
        errs[name] = rel_err(out, cudnn_out)
    for name, (dtype, variant, where, consumers, kw) in kernels.items():
        params = {"batch": batch, "heads": heads, "seq_len": n, "head_dim": head_dim, "causal": causal,
                  "dtype": dtype, "kernel": name, "part": "consumers"}
        tiles = {**dict(zip(("block_n", "num_stages"), default_tiles(head_dim, dtype == "fp8", consumers))), **kw}
        note = (f"{consumers} consumer warpgroups ({64 * consumers}-row tiles), {tiles['block_n']}-key tiles, "
                f"{tiles['num_stages']} stages" + (f", P in {where}" if where else ""))
        results.add(BENCHMARK, params, "rel_err", errs[name], "sdpa_cudnn",
                    note="‖ours − cuDNN (bf16)‖ / ‖cuDNN‖")
        two = ("fp8_" if dtype == "fp8" else "") + variant
        variant_of = name.rsplit("_", 1)[0] if name.endswith(("_s4", "_n128")) else None
        for peer in ("sdpa_cudnn", "ws") + ((two,) if consumers == 3 else ()) + ((variant_of,) if variant_of else ()):
            if peer != name:
                results.add(BENCHMARK, params, "time_ms", ms[name], peer, ms[peer], note=note)
                results.add(BENCHMARK, params, "TFLOPs", tflops(ms[name]), peer, tflops(ms[peer]), note=note)
    print(f"  [{BENCHMARK} consumers] D={head_dim} N={n}: "
          + ", ".join(f"{name} {tflops(t):.0f}" for name, t in ms.items()) + " TFLOP/s", flush=True)


# ----------------------------------------------------------------------------------------
# The dispatch: what `fastest_attention` gives a caller
# ----------------------------------------------------------------------------------------
def dispatch_sweep(results: Results, device, head_dims=HEAD_DIMS, seq_lens=SEQ_LENS, tokens: int = TOKENS,
                   hidden: int = HIDDEN, timer: Callable | None = None) -> None:
    """The dispatch rows (see the module's docstring) at every forward point, until
    `dispatch_budget_s`. Each point's calls take turns within each of `timing_rounds` rounds
    (`interleaved_times`). Timed one after the other instead, on an H200, the forward's second
    name came out 1-6 % slower than the first at every point where both run the same kernel
    (``bench/results/raw/nvidia-h200.bench_ch04_gluon_dispatch_back_to_back.log``)."""
    timer, gen, out_of_time = sweep_start(results, BENCHMARK, device, dispatch_budget_s(), timer, WARMUP_MS, REP_MS)
    each_point(f"{BENCHMARK} dispatch", head_dims, seq_lens, out_of_time,
               lambda head_dim, causal, n: _dispatch_point(results, device, gen, n, head_dim, causal, timer, tokens,
                                                           hidden))


def forward_and_backward(attn: Callable, q, k, v, dout) -> Callable:
    """A callable that runs ``attn(q, k, v)`` and its backward for ``dout``: a training step's
    attention."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    return lambda: torch.autograd.grad(attn(qg, kg, vg), (qg, kg, vg), dout)


#: Calls per host-time measurement: few enough that the launch queue never fills (a full
#: queue would make the host wait for the GPU, and the host time read as the GPU's).
HOST_CALLS = 20


def host_ms(fn: Callable) -> float:
    """Milliseconds of host time per call of ``fn`` (Python, the launches), median over
    `HOST_CALLS` calls that are not waited for; then the GPU catches up."""
    ms = cpu_time_ms(fn, warmup=2, min_reps=HOST_CALLS, min_time_s=0.0, max_reps=HOST_CALLS)
    torch.cuda.synchronize()
    return ms


#: The longest sequence whose training step is also timed inside a CUDA graph, and the steps
#: captured per graph (each keeps its own gradients in the graph's memory pool).
GRAPH_MAX_SEQ = 2048
GRAPH_STEPS = 10


def graphed_step_ms(steps: dict[str, Callable], timer: Callable) -> dict[str, float]:
    """``{name: ms}`` per call of each of ``steps`` with `GRAPH_STEPS` calls captured in one
    CUDA graph, the graphs' replays taking turns (`interleaved_times`): what the step costs
    once the host's Python and launches are out of the way, as in a training loop that
    captures its step."""
    graphs = {name: capture_calls([fn], GRAPH_STEPS) for name, fn in steps.items()}
    ms = interleaved_times({name: graph.replay for name, graph in graphs.items()}, timer, timing_rounds())
    return {name: t / GRAPH_STEPS for name, t in ms.items()}


def _dispatch_point(results: Results, device, gen, n: int, head_dim: int, causal: bool, timer, tokens: int,
                    hidden: int) -> None:
    batch, heads = max(1, tokens // n), hidden // head_dim
    q, k, v, dout = (torch.randn((batch, heads, n, head_dim), device=device, dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))
    fwd_flops = nominal_attention_flops(batch, heads, n, n, head_dim, causal)
    bwd_flops = nominal_attention_flops(batch, heads, n, n, head_dim, causal, backward=True)
    flops = {"fwd": fwd_flops, "bwd": bwd_flops, "fwd_bwd": fwd_flops + bwd_flops}
    cudnn = sdpa_attention("sdpa_cudnn", causal)
    ours = lambda q, k, v: fastest_attention(q, k, v, causal=causal)  # noqa: E731
    with torch.no_grad():
        cudnn_out = cudnn(q, k, v)
        out, _ = attention_forward(q, k, v, causal)
    grads = {"sdpa_cudnn": autograd_backward(cudnn, q, k, v, dout), "fastest": autograd_backward(ours, q, k, v, dout)}
    calls = {("fwd", "sdpa_cudnn"): lambda: cudnn(q, k, v),
             ("fwd", "ws"): lambda: flash_attention_gluon(q, k, v, causal=causal),
             ("fwd", "fastest"): lambda: attention_forward(q, k, v, causal)}
    for name, attn in (("sdpa_cudnn", cudnn), ("fastest", ours)):
        calls["bwd", name] = grads[name]
        calls["fwd_bwd", name] = forward_and_backward(attn, q, k, v, dout)
    ms = interleaved_times(calls, timer, timing_rounds())
    host = {key: host_ms(fn) for key, fn in calls.items() if key[1] != "ws"}
    graphed = graphed_step_ms({name: calls["fwd_bwd", name] for name in ("sdpa_cudnn", "fastest")}, timer) \
        if n <= GRAPH_MAX_SEQ else None
    errs = {"fwd": rel_err(out, cudnn_out)}
    errs["bwd"] = errs["fwd_bwd"] = grads_err(grads["fastest"](), grads["sdpa_cudnn"]())
    settings = fastest_forward(head_dim, causal, n)
    note = f"fastest_forward: {settings}; schedule {default_schedule(causal, n)}"
    base = {"batch": batch, "heads": heads, "seq_len": n, "head_dim": head_dim, "causal": causal,
            "dtype": dtype_name(q.dtype), "kernel": "fastest", "part": "dispatch"}
    for step, peers in (("fwd", ("sdpa_cudnn", "ws")), ("bwd", ("sdpa_cudnn",)), ("fwd_bwd", ("sdpa_cudnn",))):
        params = base if step == "fwd" else {**base, "pass": step}
        tflops = lambda t, step=step: flops[step] / (t * 1e-3) / 1e12  # noqa: E731
        results.add(BENCHMARK, params, "rel_err", errs[step], "sdpa_cudnn",
                    note="‖ours − cuDNN‖ / ‖cuDNN‖" + (" (max over dQ, dK, dV)" if step != "fwd" else ""))
        results.add(BENCHMARK, params, "host_ms", host[step, "fastest"], "sdpa_cudnn", host[step, "sdpa_cudnn"],
                    note=f"host time per call, {HOST_CALLS} calls not waited for")
        if step == "fwd_bwd" and graphed:
            results.add(BENCHMARK, params, "graph_time_ms", graphed["fastest"], "sdpa_cudnn", graphed["sdpa_cudnn"],
                        note=f"{GRAPH_STEPS} steps captured in one CUDA graph; {note}")
        for peer in peers:
            results.add(BENCHMARK, params, "time_ms", ms[step, "fastest"], peer, ms[step, peer], note=note)
            results.add(BENCHMARK, params, "TFLOPs", tflops(ms[step, "fastest"]), peer, tflops(ms[step, peer]),
                        note=note)
    print(f"  [{BENCHMARK} dispatch] D={head_dim} causal={causal} N={n} {settings}: "
          + ", ".join(f"{step} {ms[step, 'sdpa_cudnn'] / ms[step, 'fastest']:.3f}" for step in flops)
          + f" of cuDNN (fwd {ms['fwd', 'ws'] / ms['fwd', 'fastest']:.3f} of ws); host ms ours/cuDNN "
          + ", ".join(f"{step} {host[step, 'fastest']:.3f}/{host[step, 'sdpa_cudnn']:.3f}" for step in flops)
          + (f"; step in a graph {graphed['sdpa_cudnn'] / graphed['fastest']:.3f} of cuDNN" if graphed else ""),
          flush=True)
