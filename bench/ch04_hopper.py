"""Chapter 4 benchmark, on Hopper: the FA3-style forward (`flash_attention_hopper`) and its FP8
variant against PyTorch's SDPA and our FlashAttention-2, with an ablation of every switch.

Peers, measured in the same run on the same random inputs (bf16):

- ``sdpa_flash``: SDPA pinned to ``SDPBackend.FLASH_ATTENTION`` (FlashAttention-2's CUDA code);
- ``sdpa_cudnn``: SDPA pinned to ``SDPBackend.CUDNN_ATTENTION`` (cuDNN's fused attention, which
  uses Hopper's wgmma/TMA hardware);
- ``fa2``: our FlashAttention-2 forward (`minillm.kernels.ch04_flash_attention.flash_attention`,
  autotuned, its TMA path on Hopper).

Points as in ``bench/ch04_flash_attention.py``: 16k tokens per batch (``batch = 16384 // N``),
model width 2048 (``heads = 2048 // head_dim``), head_dim 128 and 64, causal and not, N = 1k …
16k. The sweep stops starting new points after ``MINILLM_CH04_HOPPER_BUDGET_S`` seconds
(default 240; status "partial").

Rows (``params``: batch, heads, seq_len, head_dim, causal, dtype; extra keys below):

================  ==========================================================================
``TFLOPs``        `minillm.costs.nominal_attention_flops` / median time. ``ours`` is the Hopper
                  kernel (bf16, `default_config`), one row per peer, with the fraction of the
                  measured bf16 matmul ceiling. ``dtype = "fp8"`` rows: ours is the FP8 kernel
                  (attention only; the quantization is timed separately in ``quantize_ms``),
                  peers ``hopper_bf16``, ``sdpa_cudnn`` and ``fa2``
``time_ms``       the same times
``quantize_ms``   the host-side quantization of Q, K, V (torch ops; a model would fuse it into
                  the projection that produces them), without and with the rotation
``rel_err``       ‖out − ref‖ / ‖ref‖ against fp32 attention of the same (bf16) inputs, at N =
                  4k, on one sequence (batch 1): FP8 without (ours) and with (peer
                  ``fp8_rotated``) incoherent processing, V's scale per head and per block
                  (``v_scale``), for Gaussian inputs and for inputs with outliers (``inputs``);
                  the bf16 Hopper kernel with peer sdpa_cudnn
``ablation``      ``TFLOPs`` with ``params["ablation"]``: ours = the default config, peer = the
                  same with one switch flipped (`ABLATIONS`; ``block_n_64`` / ``block_n_128``:
                  the other key-block width; ``static_scheduler``: round robin instead of the
                  dynamic tile counter, when the default is persistent; FP8 ``v_scale_block``:
                  one V scale per block of keys); ratio > 1 means the default is faster. At
                  N = 4k and 16k
================  ==========================================================================

The ``backward`` part (``params["pass"] = "bwd"``; the forward rows carry no ``pass``): the
Hopper backward (`flash_attention_hopper_backward`, `bwd_default_config`) against
``sdpa_flash`` and ``sdpa_cudnn`` (``torch.autograd.grad`` of a saved forward) and ``fa2``
(our FlashAttention-2 backward, `flash_attention_backward`, on the same ``out``/``lse``), at
the same points, with its own budget ``MINILLM_CH04_HOPPER_BWD_BUDGET_S`` (default 240):

================  ==========================================================================
``TFLOPs``        `minillm.costs.nominal_attention_flops` with ``backward=True`` (2.5x the
                  forward, FA2's convention) / median time (preprocess, kernels and dQ's
                  conversion included); one row per peer
``time_ms``       the same times
``rel_err``       the largest of ‖dX − dX_cudnn‖ / ‖dX_cudnn‖ over dQ, dK, dV (peer: fa2's)
``ablation``      ``TFLOPs`` with ``params["ablation"]``: the default config and the same with
                  one switch flipped (`BWD_ABLATIONS`), at N = 4k and 16k
================  ==========================================================================

``MINILLM_CH04_HOPPER_PARTS`` (default ``forward,backward``) picks the parts to run.

How the defaults (`DEFAULT_CONFIGS`) were chosen, printing only (no results file; the H100
output is in ``bench/results/raw/nvidia-h100.bench_ch04_hopper.log``):
``python -m bench.ch04_hopper --sweep`` (tiles x switches at N = 4k), ``--ws-sweep`` (warp
specialization on the tile loop vs the key loop) and ``--candidates`` (schedulers, FP8 V scales).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from minillm.costs import nominal_attention_flops
from minillm.kernels.ch04_flash_attention import flash_attention, flash_attention_backward
from minillm.kernels.ch04_flash_attention_hopper import (
    ABLATIONS, BWD_ABLATIONS, HopperBwdConfig, HopperConfig, ablated, bwd_ablated, bwd_default_config,
    default_config, flash_attention_fp8, flash_attention_hopper, flash_attention_hopper_backward, prepare_fp8,
)

from bench.common import Results, attempt, cuda_device, dtype_name, free_memory, rel_err, sweep_start

BENCHMARK = "ch04_hopper"
TOKENS = 16384
HIDDEN = 2048
HEAD_DIMS = (128, 64)
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
CAUSAL = (False, True)
ABLATION_SEQ_LENS = (4096, 16384)
ERROR_SEQ_LEN = 4096
PEERS = ("sdpa_flash", "sdpa_cudnn", "fa2")
WARMUP_MS, REP_MS = 25, 100
#: Outlier inputs for the FP8 error rows, as in FA3's experiment: N(0, 1) with a fraction of
#: the entries drawn from N(0, OUTLIER_STD²) instead.
OUTLIER_FRACTION, OUTLIER_STD = 0.001, 10.0


def budget_s() -> float:
    """Seconds after which no new point is started: ``MINILLM_CH04_HOPPER_BUDGET_S`` (default 240)."""
    return float(os.environ.get("MINILLM_CH04_HOPPER_BUDGET_S", "240"))


def bwd_budget_s() -> float:
    """The backward part's budget: ``MINILLM_CH04_HOPPER_BWD_BUDGET_S`` (default 240)."""
    return float(os.environ.get("MINILLM_CH04_HOPPER_BWD_BUDGET_S", "240"))


def parts() -> list[str]:
    """The parts to run: ``MINILLM_CH04_HOPPER_PARTS``, comma-separated (default both)."""
    return [p.strip() for p in os.environ.get("MINILLM_CH04_HOPPER_PARTS", "forward,backward").split(",") if p.strip()]


def sdpa_attention(backend_name: str, causal: bool) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]

    def attn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return attn


def _peers(causal: bool) -> dict[str, Callable]:
    return {"sdpa_flash": sdpa_attention("sdpa_flash", causal), "sdpa_cudnn": sdpa_attention("sdpa_cudnn", causal),
            "fa2": lambda q, k, v: flash_attention(q, k, v, causal=causal)}


def timed_output(fn: Callable, timer: Callable) -> tuple[float, Any]:
    """``(median ms, one untimed output)`` of ``fn()``."""
    with torch.no_grad():
        out = fn()
        return timer(fn), out


def run(results: Results, device) -> None:
    """The FP8 errors, then the sweep with its ablations, then the backward part, on
    ``device`` (CUDA); `parts` picks which."""
    device = cuda_device(device, "the Chapter 4 Hopper benchmark")
    if "forward" in parts():
        sweep_points(results, device)
    if "backward" in parts():
        backward_points(results, device)


def sweep_points(results: Results, device, head_dims=HEAD_DIMS, seq_lens=SEQ_LENS, tokens: int = TOKENS,
                 hidden: int = HIDDEN, dtype=torch.bfloat16, ablation_seq_lens=ABLATION_SEQ_LENS,
                 error_seq_len: int = ERROR_SEQ_LEN, timer: Callable | None = None) -> None:
    """The loops of `run`. ``timer(fn) -> ms`` defaults to `bench.common.time_ms`; the CPU
    test passes a stand-in (and fp16, tiny sizes) to check the bookkeeping in the interpreter."""
    timer, gen, out_of_time = sweep_start(results, BENCHMARK, device, budget_s(), timer, WARMUP_MS, REP_MS)
    mm = (results.ceilings or {}).get("bf16_matmul_TFLOPs")
    for head_dim in head_dims:  # first: cheap, and the accuracy half of the FP8 claim
        _errors(results, device, gen, head_dim, error_seq_len, hidden, dtype)
        free_memory()
    each_point(BENCHMARK, head_dims, seq_lens, out_of_time,
               lambda head_dim, causal, n: _point(results, device, gen, n, head_dim, causal, mm, timer,
                                                  n in ablation_seq_lens, tokens, hidden, dtype))


def each_point(benchmark: str, head_dims, seq_lens, out_of_time: Callable[[], bool],
               run_point: Callable[[int, bool, int], None], masks=CAUSAL) -> None:
    """``run_point(head_dim, causal, n)`` at every forward point (head dim outermost, then the
    mask, then N; ``masks``: the values of ``causal``), each followed by freeing memory and a
    line with its time, until ``out_of_time()``."""
    for head_dim in head_dims:
        for causal in masks:
            for n in seq_lens:
                if out_of_time():
                    return
                t0 = time.perf_counter()
                run_point(head_dim, causal, n)
                free_memory()
                print(f"  [{benchmark}] D={head_dim} causal={causal} N={n}: {time.perf_counter() - t0:.1f} s",
                      flush=True)


def _params(batch, heads, n, head_dim, causal, dtype: str, **extra) -> dict:
    return {"batch": batch, "heads": heads, "seq_len": n, "head_dim": head_dim, "causal": causal, "dtype": dtype,
            **extra}


def _point(results: Results, device, gen, n: int, head_dim: int, causal: bool, mm, timer, ablations: bool,
           tokens: int, hidden: int, dtype) -> None:
    batch, heads = max(1, tokens // n), hidden // head_dim
    shape = (batch, heads, n, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(3))
    flops = nominal_attention_flops(batch, heads, n, n, head_dim, causal)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    frac = lambda ms: tflops(ms) / mm if ms and mm else None  # noqa: E731
    params = _params(batch, heads, n, head_dim, causal, dtype_name(dtype))
    config = default_config(head_dim)
    note = f"ours: {config.describe()}"

    ours_ms, ours_out = timed_output(lambda: flash_attention_hopper(q, k, v, causal=causal, config=config), timer)
    for name, fn in _peers(causal).items():
        res, status = attempt(lambda: timed_output(lambda: fn(q, k, v), timer), allow_errors=True)
        peer_ms = res[0] if res else None
        row_note = note + (f"; max rel. difference {rel_err(ours_out, res[1]):.1e}" if res else f"; {status}")
        results.add(BENCHMARK, params, "time_ms", ours_ms, name, peer_ms, note=row_note)
        results.add(BENCHMARK, params, "TFLOPs", tflops(ours_ms), name, tflops(peer_ms),
                    fraction_of_ceiling=frac(ours_ms), note=row_note)
        if name == "sdpa_cudnn":
            cudnn_ms = peer_ms
        if name == "fa2":
            fa2_ms = peer_ms

    # FP8: the attention kernel alone (inputs quantized beforehand), then the quantization.
    fp8_config = default_config(head_dim, fp8=True)
    prepared = prepare_fp8(q, k, v, fp8_config)
    fp8_ms, _ = timed_output(
        lambda: flash_attention_fp8(q, k, v, causal=causal, config=fp8_config, prepared=prepared), timer)
    fp8_params = _params(batch, heads, n, head_dim, causal, "fp8")
    fp8_note = (f"e4m3 Q/K/V; scales per block of Q and K, per {fp8_config.v_scale} of V; {fp8_config.describe()}; "
                "quantization not included")
    for name, peer_ms in (("hopper_bf16", ours_ms), ("sdpa_cudnn", cudnn_ms), ("fa2", fa2_ms)):
        results.add(BENCHMARK, fp8_params, "TFLOPs", tflops(fp8_ms), name, tflops(peer_ms),
                    fraction_of_ceiling=frac(fp8_ms), note=fp8_note)
        results.add(BENCHMARK, fp8_params, "time_ms", fp8_ms, name, peer_ms, note=fp8_note)
    quant_ms = timer(lambda: prepare_fp8(q, k, v, fp8_config))
    quant_rot_ms = timer(lambda: prepare_fp8(q, k, v, fp8_config, rotate=True))
    results.add(BENCHMARK, fp8_params, "quantize_ms", quant_ms, "with_rotation", quant_rot_ms,
                note="torch ops on the host side of the kernel (not fused)")
    print(f"  [{BENCHMARK}] D={head_dim} causal={causal} N={n}: hopper {tflops(ours_ms):.0f}, "
          f"cudnn {tflops(cudnn_ms) or 0:.0f}, fa2 {tflops(fa2_ms) or 0:.0f}, fp8 {tflops(fp8_ms):.0f} TFLOP/s",
          flush=True)

    if not ablations:
        return
    variants = {name: ablated(config, name) for name in ABLATIONS}
    # The tile: the other key-block width (128 keys fit in shared memory with 2 stages only).
    other_n = 128 if config.block_n == 64 else 64
    variants[f"block_n_{other_n}"] = dataclasses.replace(config, block_n=other_n,
                                                         num_stages=2 if other_n == 128 else max(config.num_stages, 3))
    if config.persistent and config.scheduler == "dynamic":  # the tile scheduler: round robin instead
        variants["static_scheduler"] = dataclasses.replace(config, scheduler="static")
    for name, variant in variants.items():
        res, status = attempt(lambda: timed_output(
            lambda: flash_attention_hopper(q, k, v, causal=causal, config=variant), timer), allow_errors=True)
        peer_ms = res[0] if res else None
        row_note = f"ours: {config.describe()}; peer: {variant.describe()}" + (f"; {status}" if status else "")
        results.add(BENCHMARK, {**params, "ablation": name}, "TFLOPs", tflops(ours_ms), name, tflops(peer_ms),
                    note=row_note)
        print(f"  [{BENCHMARK}]   ablation {name}: {tflops(peer_ms) or 0:.0f} TFLOP/s"
              + (f" ({status})" if status else ""), flush=True)
    # FP8 with one V scale per block of keys instead of per head (P·V can no longer accumulate
    # in place: each block's product is scaled, then added).
    block_config = dataclasses.replace(fp8_config, v_scale="block")
    block_prepared = prepare_fp8(q, k, v, block_config)
    res, status = attempt(lambda: timed_output(lambda: flash_attention_fp8(
        q, k, v, causal=causal, config=block_config, prepared=block_prepared), timer), allow_errors=True)
    results.add(BENCHMARK, {**fp8_params, "ablation": "v_scale_block"}, "TFLOPs", tflops(fp8_ms), "v_scale_block",
                tflops(res[0]) if res else None, note=f"ours: {fp8_config.describe()}, V scale per head; peer: V scale "
                f"per block of {block_config.block_n} keys" + (f"; {status}" if status else ""))


# ----------------------------------------------------------------------------------------
# The backward part
# ----------------------------------------------------------------------------------------
def autograd_backward(attn: Callable, q, k, v, dout) -> Callable:
    """A callable that runs the backward of ``attn(q, k, v)`` (one saved forward) for ``dout``."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn(qg, kg, vg)
    return lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)


def grads_and_ms(fn: Callable, timer: Callable) -> tuple[Any, float]:
    """``(one untimed result of fn(), median ms of fn)``."""
    return fn(), timer(fn)


def grads_err(grads, ref) -> float:
    """The largest relative error of ``(dq, dk, dv)`` against ``ref``'s."""
    return max(rel_err(g, r) for g, r in zip(grads, ref))


def backward_points(results: Results, device, head_dims=HEAD_DIMS, seq_lens=SEQ_LENS, tokens: int = TOKENS,
                    hidden: int = HIDDEN, dtype=torch.bfloat16, ablation_seq_lens=ABLATION_SEQ_LENS,
                    timer: Callable | None = None) -> None:
    """The backward rows (see the module's docstring), most important points first, until
    `bwd_budget_s` is spent. ``timer`` as in `sweep_points`."""
    timer, gen, out_of_time = sweep_start(results, BENCHMARK, device, bwd_budget_s(), timer, WARMUP_MS, REP_MS)
    for head_dim in head_dims:
        for causal in CAUSAL:
            for n in seq_lens:
                if out_of_time():
                    return
                t0 = time.perf_counter()
                _bwd_point(results, device, gen, n, head_dim, causal, timer, n in ablation_seq_lens, tokens, hidden,
                           dtype)
                free_memory()
                print(f"  [{BENCHMARK}] backward D={head_dim} causal={causal} N={n}: "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)


def _bwd_point(results: Results, device, gen, n: int, head_dim: int, causal: bool, timer, ablations: bool,
               tokens: int, hidden: int, dtype) -> None:
    batch, heads = max(1, tokens // n), hidden // head_dim
    shape = (batch, heads, n, head_dim)
    q, k, v, dout = (torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4))
    flops = nominal_attention_flops(batch, heads, n, n, head_dim, causal, backward=True)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    params = _params(batch, heads, n, head_dim, causal, dtype_name(dtype), **{"pass": "bwd"})
    config = bwd_default_config(head_dim, causal)
    with torch.no_grad():
        out, lse = flash_attention_hopper(q, k, v, causal=causal, return_lse=True)
    ours = lambda cfg: lambda: flash_attention_hopper_backward(dout, q, k, v, out, lse, causal=causal,  # noqa: E731
                                                               config=cfg)
    ours_grads = ours(config)()
    ours_ms = timer(ours(config))
    # Each peer's backward callable is built inside `attempt`: SDPA's forward itself may refuse.
    peers = {name: (lambda name=name: autograd_backward(sdpa_attention(name, causal), q, k, v, dout))
             for name in ("sdpa_flash", "sdpa_cudnn")}
    peers["fa2"] = lambda: (lambda: flash_attention_backward(dout, q, k, v, out, lse, causal=causal))
    peer_grads, peer_tflops = {}, {}
    for name, make in peers.items():
        res, status = attempt(lambda: grads_and_ms(make(), timer), allow_errors=True)
        peer_ms = res[1] if res else None
        if res:
            peer_grads[name] = res[0]
        peer_tflops[name] = tflops(peer_ms)
        row_note = f"ours: {config.describe()}" + (f"; {status}" if status else "")
        results.add(BENCHMARK, params, "time_ms", ours_ms, name, peer_ms, note=row_note)
        results.add(BENCHMARK, params, "TFLOPs", tflops(ours_ms), name, tflops(peer_ms), note=row_note)
    ref = peer_grads.get("sdpa_cudnn") or peer_grads.get("sdpa_flash")
    if ref is not None:
        results.add(BENCHMARK, params, "rel_err", grads_err(ours_grads, ref), "fa2",
                    grads_err(peer_grads["fa2"], ref) if "fa2" in peer_grads else None,
                    note="max over dQ, dK, dV of ‖ours − ref‖/‖ref‖; ref: "
                         + ("sdpa_cudnn" if "sdpa_cudnn" in peer_grads else "sdpa_flash"))
    print(f"  [{BENCHMARK}] backward D={head_dim} causal={causal} N={n}: hopper {tflops(ours_ms):.0f}, "
          + ", ".join(f"{k_} {v_ or 0:.0f}" for k_, v_ in peer_tflops.items()) + " TFLOP/s", flush=True)
    if not ablations:
        return
    for switch in BWD_ABLATIONS:
        variant = bwd_ablated(config, switch)
        if variant.dq == "separate" and switch in ("tma_reduce", "fuse_preprocess"):
            continue  # these act on the atomic dQ only (the "dq" row flips a separate default to atomic)
        res, status = attempt(lambda: timer(ours(variant)), allow_errors=True)
        row_note = f"ours: {config.describe()}; peer: {variant.describe()}" + (f"; {status}" if status else "")
        results.add(BENCHMARK, {**params, "ablation": switch}, "TFLOPs", tflops(ours_ms), switch, tflops(res),
                    note=row_note)
        print(f"  [{BENCHMARK}]   backward ablation {switch}: {tflops(res) or 0:.0f} TFLOP/s"
              + (f" ({status})" if status else ""), flush=True)


def outlier_inputs(shape, device, gen) -> torch.Tensor:
    """N(0, 1) with a fraction `OUTLIER_FRACTION` of the entries N(0, `OUTLIER_STD`²) instead."""
    x = torch.randn(shape, device=device, generator=gen)
    big = torch.rand(shape, device=device, generator=gen) < OUTLIER_FRACTION
    return torch.where(big, x * OUTLIER_STD, x)


def _errors(results: Results, device, gen, head_dim: int, n: int, hidden: int, dtype) -> None:
    """FP8's error with and without rotation, against fp32 attention of the same bf16 inputs."""
    heads = hidden // head_dim
    shape = (1, heads, n, head_dim)  # one sequence: the fp32 reference is then cheap
    for inputs in ("gaussian", "outliers"):
        for causal in CAUSAL:
            if inputs == "gaussian":
                q, k, v = (torch.randn(shape, device=device, generator=gen).to(dtype) for _ in range(3))
            else:
                q, k, v = (outlier_inputs(shape, device, gen).to(dtype) for _ in range(3))
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.MATH):  # fp32 reference, S materialised (one sequence)
                ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            for v_scale in ("head", "block"):
                config = dataclasses.replace(default_config(head_dim, fp8=True), v_scale=v_scale)
                plain = rel_err(flash_attention_fp8(q, k, v, causal=causal, config=config), ref)
                rotated = rel_err(flash_attention_fp8(q, k, v, causal=causal, rotate=True, config=config), ref)
                params = _params(1, heads, n, head_dim, causal, "fp8", inputs=inputs, v_scale=v_scale)
                results.add(BENCHMARK, params, "rel_err", plain, "fp8_rotated", rotated,
                            note="vs fp32 attention of the same inputs; rotation: random Hadamard on Q and K")
            bf16 = rel_err(flash_attention_hopper(q, k, v, causal=causal), ref)
            cudnn_out, status = attempt(lambda: sdpa_attention("sdpa_cudnn", causal)(q, k, v), allow_errors=True)
            cudnn = rel_err(cudnn_out, ref) if cudnn_out is not None else None
            results.add(BENCHMARK, _params(1, heads, n, head_dim, causal, dtype_name(dtype), inputs=inputs),
                        "rel_err", bf16, "sdpa_cudnn", cudnn,
                        note="16-bit kernels vs fp32 attention of the same inputs" + (f"; {status}" if status else ""))
            print(f"  [{BENCHMARK}] rel_err D={head_dim} causal={causal} {inputs}: fp8 {plain:.2e}, "
                  f"fp8+rotation {rotated:.2e} (V per block), 16-bit {bf16:.2e}, cudnn {cudnn}", flush=True)


# ----------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------
def _whole(x) -> str:
    """A summary cell: ``x`` rounded to a whole number, or a dash."""
    return "—" if x is None else f"{x:.0f}"


def _ratio(a, b) -> str:
    """A summary cell: ``a / b`` to two decimals, or a dash when either is missing."""
    return f"{a / b:.2f}" if a and b else "—"


#: The columns both summary tables start with (`_peer_cells`).
_PEERS_HEADER = (f"{'D':>4} {'causal':>6} {'N':>6} {'hopper':>6} {'cudnn':>6} {'flash':>6} {'fa2':>6} {'/cudnn':>6} "
                 f"{'/fa2':>5}")


def _peer_cells(key: tuple, row: dict) -> str:
    """A point ``(head_dim, causal, n)`` and its TFLOP/s: ours, cuDNN, SDPA flash, FA2, and our
    ratios to cuDNN and FA2 (the columns of `_PEERS_HEADER`)."""
    o = row.get("ours")
    return (f"{key[0]:>4} {str(key[1]):>6} {key[2]:>6} {_whole(o):>6} {_whole(row.get('sdpa_cudnn')):>6} "
            f"{_whole(row.get('sdpa_flash')):>6} {_whole(row.get('fa2')):>6} {_ratio(o, row.get('sdpa_cudnn')):>6} "
            f"{_ratio(o, row.get('fa2')):>5}")


def summary(results: Results | dict) -> str:
    """Per point: Hopper, cuDNN, flash, FA2 and FP8 TFLOP/s and the ratios; then the ablations
    and the errors."""
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    t: dict[tuple, dict] = {}
    ablation_lines, error_lines = [], []
    for r in select(data, BENCHMARK, "TFLOPs"):
        p = r["params"]
        if p.get("pass") == "bwd":
            continue  # `backward_summary`
        key = (p["head_dim"], p["causal"], p["seq_len"])
        if "ablation" in p:
            ratio = "—" if r.get("ratio") is None else f"{r['ratio']:.2f}"
            peer = "—" if r["peer_value"] is None else f"{r['peer_value']:.0f}"
            ablation_lines.append(f"{p['head_dim']:>4} {str(p['causal']):>6} {p['seq_len']:>6} "
                                  f"{('fp8 ' if p['dtype'] == 'fp8' else '') + p['ablation']:>20} "
                                  f"{r['ours']:>6.0f} {peer:>7} {ratio:>6}")
            continue
        row = t.setdefault(key, {})
        if p["dtype"] == "fp8":
            row["fp8"] = r["ours"]
        else:
            row["ours"] = r["ours"]
            row[r["peer"]] = r["peer_value"]
            row["frac"] = r["fraction_of_ceiling"]
    for r in select(data, BENCHMARK, "rel_err"):
        p = r["params"]
        if p.get("pass") == "bwd":
            continue
        error_lines.append(f"{p['head_dim']:>4} {str(p['causal']):>6} {p['dtype']:>9} {p.get('inputs', ''):>9} "
                           f"{'V/' + p['v_scale'] if 'v_scale' in p else '':>8} "
                           f"{r['ours']:.2e} ({r['peer']} "
                           f"{'—' if r['peer_value'] is None else format(r['peer_value'], '.2e')})")

    lines = [f"{_PEERS_HEADER} {'of mm':>5} {'fp8':>6} {'fp8/h':>5}"]
    for key in sorted(t, key=lambda k: (-k[0], k[1], k[2])):
        row = t[key]
        frac = row.get("frac")
        lines.append(f"{_peer_cells(key, row)} {'—' if frac is None else format(frac, '.0%'):>5} "
                     f"{_whole(row.get('fp8')):>6} {_ratio(row.get('fp8'), row.get('ours')):>5}")
    if ablation_lines:
        lines += ["", f"{'D':>4} {'causal':>6} {'N':>6} {'ablation':>20} {'ours':>6} {'without':>7} {'gain':>6}"]
        lines += ablation_lines
    if error_lines:
        lines += ["", "rel. error vs fp32 (D causal dtype inputs V-scale: ours (peer))"] + error_lines
    forward = "\n".join(lines) if t or ablation_lines or error_lines else ""
    backward = backward_summary(data)
    return "\n\n".join(part for part in (forward, "backward\n" + backward if backward else "") if part)


def backward_summary(data: dict) -> str:
    """The backward rows: per point Hopper, cuDNN, flash and FA2 TFLOP/s, the ratios and the
    gradient error; then the ablations. Empty when there are none."""
    from minillm.results import rows as select

    t: dict[tuple, dict] = {}
    ablation_lines = []
    for r in select(data, BENCHMARK, "TFLOPs"):
        p = r["params"]
        if p.get("pass") != "bwd":
            continue
        key = (p["head_dim"], p["causal"], p["seq_len"])
        if "ablation" in p:
            peer = "—" if r["peer_value"] is None else f"{r['peer_value']:.0f}"
            gain = f"{r['ours'] / r['peer_value']:.2f}" if r["peer_value"] else "—"
            ablation_lines.append(f"{p['head_dim']:>4} {str(p['causal']):>6} {p['seq_len']:>6} {p['ablation']:>16} "
                                  f"{r['ours']:>6.0f} {peer:>7} {gain:>6}")
            continue
        row = t.setdefault(key, {})
        row["ours"] = r["ours"]
        row[r["peer"]] = r["peer_value"]
    for r in select(data, BENCHMARK, "rel_err"):
        p = r["params"]
        if p.get("pass") == "bwd":
            t.setdefault((p["head_dim"], p["causal"], p["seq_len"]), {})["err"] = r["ours"]
    if not t and not ablation_lines:
        return ""

    lines = [f"{_PEERS_HEADER} {'rel err':>8}"]
    for key in sorted(t, key=lambda k: (-k[0], k[1], k[2])):
        err = t[key].get("err")
        lines.append(f"{_peer_cells(key, t[key])} {'—' if err is None else format(err, '.1e'):>8}")
    if ablation_lines:
        lines += ["", f"{'D':>4} {'causal':>6} {'N':>6} {'switch flipped':>16} {'ours':>6} {'flipped':>7} {'gain':>6}"]
        lines += ablation_lines
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# The tile/switch sweep that chose DEFAULT_CONFIGS (prints only)
# ----------------------------------------------------------------------------------------
WS_SWEEP = [  # (tile, warps, stages, ws_loop, programs per SM, overlap)
    (128, 128, 8, 2, "tiles", 1, False), (128, 64, 8, 3, "tiles", 1, False), (128, 64, 4, 3, "tiles", 1, False),
    (128, 128, 4, 2, "tiles", 1, False), (64, 64, 4, 3, "tiles", 2, False), (128, 64, 8, 3, "tiles", 1, True),
    (128, 64, 4, 3, "keys", 1, False), (128, 128, 4, 2, "keys", 1, False),
]


def _sweep_points(seq_lens, num_tensors: int, backward: bool = False, head_dims=HEAD_DIMS, causals=CAUSAL):
    """The points of the print-only sweeps: ``(head_dim, causal, n, tensors, flops, timer)``
    for every head dim of ``head_dims``, mask of ``causals`` and ``n`` in ``seq_lens``, with ``num_tensors`` random bf16
    ``[batch, heads, n, head_dim]`` tensors (a fixed token count per point); memory is freed
    after each point."""
    from bench.common import time_ms

    device = torch.device("cuda")
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    timer = lambda fn: time_ms(fn, warmup=WARMUP_MS, rep=REP_MS)  # noqa: E731
    for head_dim in head_dims:
        for causal in causals:
            for n in seq_lens:
                batch, heads = max(1, TOKENS // n), HIDDEN // head_dim
                tensors = [torch.randn((batch, heads, n, head_dim), device=device, dtype=torch.bfloat16,
                                       generator=gen) for _ in range(num_tensors)]
                flops = nominal_attention_flops(batch, heads, n, n, head_dim, causal, backward=backward)
                yield head_dim, causal, n, tensors, flops, timer
                del tensors
                free_memory()


def ws_sweep(n: int = 4096) -> None:
    """Warp specialization placed on the tile loop vs the key loop (prints only)."""
    for head_dim, causal, n, (q, k, v), flops, timer in _sweep_points((n,), 3):
        ref = sdpa_attention("sdpa_cudnn", causal)(q, k, v)
        print(f"D={head_dim} causal={causal} N={n}", flush=True)
        for bm, bn, w, s, loop, per_sm, overlap in WS_SWEEP:
            for ws in (False, True):
                cfg = HopperConfig(bm, bn, w, s, warp_specialize=ws, ws_loop=loop, programs_per_sm=per_sm,
                                   overlap=overlap)
                res, status = attempt(lambda: timed_output(
                    lambda: flash_attention_hopper(q, k, v, causal=causal, config=cfg), timer), allow_errors=True)
                msg = (f"{flops / res[0] / 1e9:6.0f} TFLOP/s  err {rel_err(res[1], ref):.1e}" if res
                       else f"failed: {status[:200]}")
                print(f"   {cfg.describe():70s} {msg}", flush=True)


#: (head_dim, fp8, config) candidates of `candidate_sweep`: the persistent schedulers, and
#: FP8's V scale per block vs per head.
CANDIDATES = [
    (hd, False, cfg) for hd in HEAD_DIMS for cfg in (
        HopperConfig(128, 64, 8, 3, persistent=False),
        HopperConfig(128, 64, 8, 3, persistent=True),
        HopperConfig(128, 64, 8, 3, persistent=True, scheduler="dynamic"),
        HopperConfig(128, 64, 8, 3, persistent=True, scheduler="dynamic", programs_per_sm=2),
        HopperConfig(64, 64, 4, 3, persistent=True, scheduler="dynamic", programs_per_sm=3),
    )
] + [
    (hd, True, cfg) for hd in HEAD_DIMS for cfg in (
        HopperConfig(64, 64, 4, 3, programs_per_sm=2),
        HopperConfig(64, 64, 4, 3, programs_per_sm=2, v_scale="head"),
        HopperConfig(64, 64, 4, 3, persistent=False, v_scale="head"),
        HopperConfig(64, 64, 4, 3, programs_per_sm=2, scheduler="dynamic", v_scale="head"),
        HopperConfig(128, 64, 8, 3, programs_per_sm=2, v_scale="head"),
        HopperConfig(128, 64, 8, 3, persistent=False, v_scale="head"),
        HopperConfig(128, 128, 8, 3, persistent=False, v_scale="head"),
    )
]


def candidate_sweep(seq_lens=(4096, 16384)) -> None:
    """Time every `CANDIDATES` entry (prints only)."""
    for head_dim, causal, n, (q, k, v), flops, timer in _sweep_points(seq_lens, 3):
        print(f"D={head_dim} causal={causal} N={n}", flush=True)
        for hd, fp8, cfg in CANDIDATES:
            if hd != head_dim:
                continue
            if fp8:
                prepared = prepare_fp8(q, k, v, cfg)
                fn = lambda: flash_attention_fp8(q, k, v, causal=causal, config=cfg,  # noqa: E731
                                                 prepared=prepared)
            else:
                fn = lambda: flash_attention_hopper(q, k, v, causal=causal, config=cfg)  # noqa: E731
            res, status = attempt(lambda: timed_output(fn, timer), allow_errors=True)
            msg = f"{flops / res[0] / 1e9:6.0f} TFLOP/s" if res else f"failed: {status[:200]}"
            print(f"   {'fp8 ' if fp8 else ''}{cfg.describe()}{', V/head' if cfg.v_scale == 'head' else ''}"
                  f": {msg}", flush=True)


SWEEP_TILES = {
    128: [(128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)],
    64: [(128, 128, 8, 3), (128, 64, 8, 4), (128, 64, 8, 3), (64, 64, 4, 3)],
}
#: (warp_specialize, persistent, programs per SM, overlap) combinations tried on each tile.
SWEEP_SWITCHES = ((False, True, 1, False), (False, True, 2, False), (False, False, 1, False),
                  (False, True, 1, True), (False, True, 2, True), (True, True, 1, True))


def sweep(n: int = 4096, head_dims=HEAD_DIMS, causals=CAUSAL, fp8: bool = True) -> None:
    """Time every `SWEEP_TILES` tile with each switch combination at ``N = n`` and print TFLOP/s,
    with cuDNN and FA2 for reference. Compile errors are printed, not raised."""
    for head_dim, causal, n, (q, k, v), flops, timer in _sweep_points((n,), 3, head_dims=head_dims,
                                                                      causals=causals):
        tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
        ref = sdpa_attention("sdpa_cudnn", causal)(q, k, v)
        base = {name: tf(timed_output(lambda: fn(q, k, v), timer)[0]) for name, fn in _peers(causal).items()}
        print(f"D={head_dim} causal={causal} N={n}: " + ", ".join(f"{k_} {v_:.0f}" for k_, v_ in base.items()),
              flush=True)
        for bm, bn, w, s in SWEEP_TILES[head_dim]:
            for ws, persistent, per_sm, overlap in SWEEP_SWITCHES:
                cfg = HopperConfig(bm, bn, w, s, tma=True, warp_specialize=ws, persistent=persistent,
                                   overlap=overlap, programs_per_sm=per_sm)
                t0 = time.perf_counter()
                res, status = attempt(lambda: timed_output(
                    lambda: flash_attention_hopper(q, k, v, causal=causal, config=cfg), timer),
                    allow_errors=True)
                msg = (f"{tf(res[0]):6.0f} TFLOP/s  err {rel_err(res[1], ref):.1e}" if res
                       else f"failed: {status[:300]}")
                print(f"   {cfg.describe():60s} {msg}  ({time.perf_counter() - t0:.1f} s)", flush=True)
            for per_sm, overlap in ((1, False), (2, False), (1, True)) if fp8 else ():
                cfg = HopperConfig(bm, bn, w, s, programs_per_sm=per_sm, overlap=overlap)
                prepared = prepare_fp8(q, k, v, cfg)
                res, status = attempt(lambda: timed_output(
                    lambda: flash_attention_fp8(q, k, v, causal=causal, config=cfg, prepared=prepared), timer),
                    allow_errors=True)
                msg = (f"{tf(res[0]):6.0f} TFLOP/s  err {rel_err(res[1], ref):.1e}" if res
                       else f"failed: {status[:150]}")
                print(f"   fp8 {cfg.describe():56s} {msg}", flush=True)


#: Backward candidates of `bwd_sweep` per head dim (the H100 sweeps that chose
#: `BWD_DEFAULT_CONFIGS`): dK/dV tiles with dQ by atomics or by the separate pass, and the
#: separate pass's own tiles. `bwd_sweep` adds the default with each switch flipped.
_SEPARATE = dict(dq="separate", dq_num_stages=3)
BWD_SWEEP = {
    128: [HopperBwdConfig(64, 128, 8, 3), HopperBwdConfig(64, 128, 8, 2), HopperBwdConfig(32, 128, 8, 2),
          HopperBwdConfig(64, 128, 8, 3, **_SEPARATE), HopperBwdConfig(32, 128, 8, 3, **_SEPARATE),
          HopperBwdConfig(64, 128, 8, 2, **_SEPARATE), dataclasses.replace(HopperBwdConfig(64, 128, 8, 3, **_SEPARATE),
                                                                       dq_num_stages=4),
          HopperBwdConfig(64, 128, 8, 3, dq="separate", dq_block_m=64, dq_block_n=128, dq_num_warps=4)],
    64: [HopperBwdConfig(64, 128, 8, 3), HopperBwdConfig(64, 128, 8, 3, tma_reduce=False),
         HopperBwdConfig(64, 128, 8, 2, tma_reduce=False), HopperBwdConfig(128, 128, 8, 3),
         HopperBwdConfig(128, 128, 8, 2, tma_reduce=False), HopperBwdConfig(64, 128, 8, 3, **_SEPARATE),
         HopperBwdConfig(128, 128, 8, 3, **_SEPARATE), HopperBwdConfig(64, 128, 8, 3, dq="separate", dq_block_n=128)],
}


def bwd_sweep(seq_lens=(4096, 16384)) -> None:
    """Time every `BWD_SWEEP` config and each default with one switch flipped (prints only)."""
    for head_dim, causal, n, (q, k, v, dout), flops, timer in _sweep_points(seq_lens, 4, backward=True):
        out, lse = flash_attention_hopper(q, k, v, causal=causal, return_lse=True)
        cudnn = autograd_backward(sdpa_attention("sdpa_cudnn", causal), q, k, v, dout)
        ref = cudnn()
        print(f"D={head_dim} causal={causal} N={n}: cudnn {flops / timer(cudnn) / 1e9:.0f} TFLOP/s", flush=True)
        default = bwd_default_config(head_dim, causal)
        configs = BWD_SWEEP[head_dim] + [bwd_ablated(default, s) for s in BWD_ABLATIONS]
        for cfg in dict.fromkeys(configs):
            fn = lambda: flash_attention_hopper_backward(dout, q, k, v, out, lse,  # noqa: E731
                                                         causal=causal, config=cfg)
            res, status = attempt(lambda: grads_and_ms(fn, timer), allow_errors=True)
            msg = (f"{flops / res[1] / 1e9:6.0f} TFLOP/s  err {grads_err(res[0], ref):.1e}" if res
                   else f"failed: {status[:200]}")
            print(f"   {cfg.describe():110s} {msg}", flush=True)
        del out, lse, cudnn, ref


if __name__ == "__main__":
    if "--bwd-sweep" in sys.argv:
        bwd_sweep()
        raise SystemExit(0)
    if "--candidates" in sys.argv:
        candidate_sweep()
        raise SystemExit(0)
    if "--ws-sweep" in sys.argv:
        ws_sweep()
        raise SystemExit(0)
    if "--sweep" in sys.argv:
        sweep()
        raise SystemExit(0)
    from bench.run import main

    raise SystemExit(main(["--only", BENCHMARK]))
