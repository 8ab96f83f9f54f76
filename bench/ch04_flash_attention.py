"""Chapter 4 benchmark: our FlashAttention-2 (forward and backward) against PyTorch's SDPA.

Peers, measured in the same run on the same random inputs:

- ``sdpa_flash``: ``F.scaled_dot_product_attention`` pinned to ``SDPBackend.FLASH_ATTENTION``
  (the FlashAttention-2 CUDA kernels that ship inside PyTorch);
- ``sdpa_cudnn``: the same call pinned to ``SDPBackend.CUDNN_ATTENTION`` (cuDNN's fused
  attention, which on Hopper uses the wgmma/TMA hardware FlashAttention-2's CUDA code predates).

A peer that refuses a point (an unsupported dtype or head dim, an old cuDNN) is recorded
with ``peer_value = None`` and the reason in ``note``.

Points: the batch holds ``TOKENS`` = 16k tokens (``batch = 16384 // N``) and the model width
is ``HIDDEN`` = 2048 (``heads = 2048 // head_dim``), so every point does the same
projection-sized work and only the sequence length changes; head_dim 128 and 64, N = 512 …
16k, bf16 and fp16, causal and not, forward and backward (``pass``). The sweep stops
starting new points after ``MINILLM_CH04_BUDGET_S`` seconds (default 240; status "partial").
It runs the most important points first (bf16, head_dim 128), because the first call of
every (dtype, head_dim, causal, pass) combination autotunes, compiling each config.

Rows (``params``: batch, heads, seq_len, head_dim, causal, dtype, pass):

=============  ==========================================================================
``time_ms``    median time of our call; one row per peer. Forward: `flash_attention`.
               Backward: ``torch.autograd.grad`` of a saved forward (preprocess, dK/dV and
               dQ kernels for us), the same call for the peers
``TFLOPs``     `minillm.costs.nominal_attention_flops` / time (forward 4·B·H·N²·D, halved when causal; backward
               2.5x that); one row per peer; fraction of the measured bf16 matmul ceiling
``rel_err``    ‖ours − peer‖ / ‖peer‖ in fp32 against sdpa_flash (sdpa_cudnn if flash
               refused): the output (forward), the largest of dQ, dK, dV's (backward)
``oom``        True when the inputs of a point did not fit
=============  ==========================================================================

Our kernels autotune their tiles on the first call of every (dtype, head_dim, causal, pass,
length bucket); on Hopper the forward and dQ kernels move tiles with TMA descriptors (the
``note`` of each row says which path ran; ``MINILLM_FLASH_TMA=0`` forces the pointer path,
to measure what TMA buys).

What to expect (targets for Hopper, to be measured): forward at head_dim 128 and N >= 4k
about 1.15x sdpa_flash, at head_dim 64 about 1.1x; backward at least on par. Our dQ kernel
recomputes S and dP (7 matmuls per tile pair instead of FA2's 5 with atomics; see
`minillm.kernels.ch04_flash_attention`), which the conventional 2.5x FLOP count does not credit.

`compile_report` (no GPU needed) compiles every tile candidate for sm_90 and lists registers,
spills and shared memory: how the candidate lists in the kernel modules were chosen.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from minillm.costs import nominal_attention_flops
from minillm.kernels.ch04_flash_attention import Packing, flash_attention, use_tma

from bench.common import Results, attempt, cuda_device, dtype_name, free_memory, rel_err, sweep_start

BENCHMARK = "ch04_flash_attention"
TOKENS = 16384
HIDDEN = 2048
HEAD_DIMS = (128, 64)
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
DTYPES = (torch.bfloat16, torch.float16)
CAUSAL = (False, True)
PASSES = ("fwd", "bwd")
PEERS = ("sdpa_flash", "sdpa_cudnn")
WARMUP_MS, REP_MS = 25, 100


def budget_s() -> float:
    """Seconds after which no new point is started: ``MINILLM_CH04_BUDGET_S`` (default 240)."""
    return float(os.environ.get("MINILLM_CH04_BUDGET_S", "240"))


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[name]


# ----------------------------------------------------------------------------------------
# One implementation at one point: (ms, outputs)
# ----------------------------------------------------------------------------------------
def _measure(attn: Callable, q, k, v, dout, pass_: str, timer: Callable) -> tuple[float, tuple[torch.Tensor, ...]]:
    """Time ``attn(q, k, v)`` (forward) or its backward; returns ``(ms, outputs)`` where the
    outputs are ``(out,)`` or ``(dq, dk, dv)`` from one untimed call (for the error check)."""
    if pass_ == "fwd":
        with torch.no_grad():
            out = attn(q, k, v)
            return timer(lambda: attn(q, k, v)), (out,)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn(qg, kg, vg)

    def backward():
        return torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)

    grads = backward()
    return timer(backward), grads


def _peer(name: str, causal: bool) -> Callable:
    from torch.nn.attention import sdpa_kernel

    def attn(q, k, v):
        with sdpa_kernel(_backend(name)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return attn


# ----------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------
def run(results: Results, device) -> None:
    """Run the Chapter 4 sweep on ``device`` (CUDA) and add its rows to ``results``.

    Needs ``results.ceilings["bf16_matmul_TFLOPs"]`` for the fractions."""
    device = cuda_device(device, "the Chapter 4 benchmark")
    sweep(results, device)


def sweep(results: Results, device, head_dims=HEAD_DIMS, seq_lens=SEQ_LENS, tokens: int = TOKENS,
          hidden: int = HIDDEN, dtypes=DTYPES, causals=CAUSAL, passes=PASSES,
          timer: Callable[[Callable[[], Any]], float] | None = None) -> None:
    """The loops of `run`, most important points first, until the time budget is spent.
    ``timer(fn) -> ms`` defaults to `bench.common.time_ms` (CUDA only); the CPU tests pass
    a stand-in to check the bookkeeping under the interpreter."""
    timer, gen, out_of_time = sweep_start(results, BENCHMARK, device, budget_s(), timer, WARMUP_MS, REP_MS)
    mm_tflops = (results.ceilings or {}).get("bf16_matmul_TFLOPs")

    for dtype in dtypes:
        for head_dim in head_dims:
            for causal in causals:
                for pass_ in passes:
                    for n in seq_lens:
                        if out_of_time():
                            return
                        t0 = time.perf_counter()
                        _run_point(results, device, gen, max(1, tokens // n), hidden // head_dim, n, head_dim,
                                   causal, dtype, pass_, mm_tflops, timer)
                        free_memory()  # the point's tensors are gone with its frame
                        print(f"  [{BENCHMARK}] {dtype_name(dtype)} D={head_dim} causal={causal} {pass_} N={n}: "
                              f"{time.perf_counter() - t0:.1f} s", flush=True)


def _run_point(results: Results, device, gen, batch: int, heads: int, n: int, head_dim: int, causal: bool,
               dtype: torch.dtype, pass_: str, mm_tflops, timer) -> None:
    params = {"batch": batch, "heads": heads, "seq_len": n, "head_dim": head_dim, "causal": causal,
              "dtype": dtype_name(dtype), "pass": pass_}
    add = lambda *a, **kw: results.add(BENCHMARK, params, *a, **kw)  # noqa: E731

    def make():
        shape = (batch, heads, n, head_dim)
        return tuple(torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4))

    inputs, status = attempt(make)
    if inputs is None:
        add("oom", True, note="inputs did not fit")
        return
    q, k, v, dout = inputs
    ours_ms, ours_out = _measure(lambda a, b, c: flash_attention(a, b, c, causal=causal), q, k, v, dout, pass_, timer)
    path = "ours: TMA path" if use_tma(Packing(batch, n, n), q, k, v, q) else "ours: pointer path"

    flops = nominal_attention_flops(batch, heads, n, n, head_dim, causal, backward=pass_ == "bwd")
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    ref = None
    for name in PEERS:
        res, note = attempt(lambda: _measure(_peer(name, causal), q, k, v, dout, pass_, timer), allow_errors=True)
        peer_ms = res[0] if res else None
        note = "; ".join(x for x in (path, note) if x)
        add("time_ms", ours_ms, name, peer_ms, note=note)
        add("TFLOPs", tflops(ours_ms), name, tflops(peer_ms),
            fraction_of_ceiling=tflops(ours_ms) / mm_tflops if mm_tflops else None, note=note)
        if res is not None and ref is None:
            ref = (name, res[1])
    if ref is not None:
        err = max(rel_err(a, b) for a, b in zip(ours_out, ref[1]))
        add("rel_err", err, ref[0], None, note="max over dq, dk, dv" if pass_ == "bwd" else None)


# ----------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------
def summary(results: Results | dict) -> str:
    """One line per point: our TFLOP/s, each peer's, and the ratios."""
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    t: dict[tuple, dict] = {}
    for r in select(data, BENCHMARK, "TFLOPs"):
        p = r["params"]
        key = (p["dtype"], p["head_dim"], p["causal"], p["pass"], p["seq_len"])
        t.setdefault(key, {})["ours"] = r["ours"]
        t[key][r["peer"]] = r["peer_value"]
        t[key]["frac"] = r["fraction_of_ceiling"]
    for r in select(data, BENCHMARK, "rel_err"):
        p = r["params"]
        t.setdefault((p["dtype"], p["head_dim"], p["causal"], p["pass"], p["seq_len"]), {})["err"] = r["ours"]

    def f(x, fmt="{:.1f}"):
        return "—" if x is None else fmt.format(x)

    def ratio(ours, peer):
        return f"{ours / peer:.2f}" if ours and peer else "—"

    lines = [f"{'dtype':>8} {'D':>4} {'causal':>6} {'pass':>4} {'N':>6} {'ours TF':>8} {'flash TF':>9} "
             f"{'cudnn TF':>9} {'/flash':>6} {'/cudnn':>6} {'of mm':>6} {'rel_err':>8}"]
    for key in sorted(t, key=lambda k: (k[0], -k[1], k[2], k[3] != "fwd", k[4])):
        row = t[key]
        o = row.get("ours")
        lines.append(f"{key[0]:>8} {key[1]:>4} {str(key[2]):>6} {key[3]:>4} {key[4]:>6} {f(o):>8} "
                     f"{f(row.get('sdpa_flash')):>9} {f(row.get('sdpa_cudnn')):>9} "
                     f"{ratio(o, row.get('sdpa_flash')):>6} {ratio(o, row.get('sdpa_cudnn')):>6} "
                     f"{f(row.get('frac'), '{:.0%}'):>6} {f(row.get('err'), '{:.1e}'):>8}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Compile report: registers, spills and shared memory of every candidate, without a GPU
# ----------------------------------------------------------------------------------------
def compile_report(head_dims=(64, 128, 256), dtype=torch.bfloat16, arch: int = 90, causals=(False, True),
                   groups=(1, 4), kernels=("fwd", "dkdv", "dq"), tma=(False, True),
                   print_table: bool = True) -> list[dict]:
    """Compile every autotuning candidate of the three Chapter 4 kernels for an ``sm_<arch>``
    GPU, without running anything, and report what decides whether a tile config can be fast
    before any timing: registers per thread, bytes spilled to local memory, shared memory.

    Triton compiles for the target it is given with the ``ptxas`` it bundles, so this works
    on a machine without a GPU (a stand-in driver reports the target). The kernels must have
    been compiled, not interpreted::

        TRITON_INTERPRET=0 python -c "from bench.ch04_flash_attention import compile_report; compile_report()"

    ``tma``: which load paths to compile the forward and dQ kernels for (the dK/dV kernel
    has only the pointer path). ``groups``: GQA group sizes to compile for (1 is MHA, where the dK/dV kernel's loop over
    the group compiles away; a larger group keeps it, and needs a few more registers).
    Inputs are contiguous ``[batch, heads, seq, head_dim]`` tensors, whose strides Triton
    specializes as it would at run time (16-divisible, unit stride along head_dim).

    Returns one dict per (kernel, head_dim, group, causal, config) with ``regs``,
    ``spill_bytes``, ``smem_bytes`` and ``ok`` (no spills, shared memory within Hopper's 227 KB).
    """
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction, MockTensor

    from minillm.kernels import ch04_flash_attention as fa
    from minillm.kernels import ch04_flash_attention as fb

    if not isinstance(fa._fwd_kernel, JITFunction):
        raise RuntimeError("the kernels were loaded for the interpreter: run with TRITON_INTERPRET=0")
    if not torch.cuda.is_available():
        class _TargetOnly:  # just enough of a driver for JITFunction.warmup to compile
            def get_current_device(self):
                return 0

            def get_current_stream(self, device=None):
                return 0

            def get_current_target(self):
                return GPUTarget("cuda", arch, 32)

            def get_active_torch_device(self):
                return torch.device("cpu")

        driver.set_active(_TargetOnly())
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

    def resources(kernel) -> tuple[int, int]:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            text = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True,
                                  text=True, check=True).stdout
        return int(re.search(r"REG:(\d+)", text).group(1)), int(re.search(r"STACK:(\d+)", text).group(1))

    batch, heads, n = 4, 16, 4096
    lens = (n, n, fa.seq_bucket(n), fa.seq_bucket(n))
    rows = []
    for head_dim in head_dims:
        t = MockTensor(dtype, [batch, heads, n, head_dim])
        lse = MockTensor(torch.float32, [batch, heads, n])
        st = (heads * n * head_dim, n * head_dim, head_dim, 1)  # contiguous (MockTensor's own are not)
        lst = (heads * n, n, 1)
        for group in groups:
            jobs = [("fwd", False, fa._fwd_kernel, fa.FWD_TILES), ("fwd", True, fa._fwd_kernel, fa.FWD_TILES_TMA),
                    ("dkdv", None, fb._bwd_dkdv_kernel, fb.DKDV_TILES),
                    ("dq", False, fb._bwd_dq_kernel, fb.DQ_TILES), ("dq", True, fb._bwd_dq_kernel, fb.DQ_TILES_TMA)]
            kernel_args = {
                "fwd": (t, t, t, t, lse, None, None, *st, *st, *st, *st, *lst, heads, group, *lens, 0.1, 0),
                "dkdv": (t, t, t, t, lse, lse, t, t, None, None, *st, *st, *st, *st, *lst, *lst, *st, *st,
                         heads // group, group, *lens, 0.1, 0.1, 0),
                "dq": (t, t, t, t, lse, lse, t, None, None, *st, *st, *st, *st, *lst, *lst, *st,
                       heads, group, *lens, 0.1, 0.1, 0),
            }
            for name, tma_path, kernel, table in jobs:
                if name not in kernels or (tma_path is not None and tma_path not in tma):
                    continue
                for causal in causals:
                    meta = dict(HEAD_DIM=head_dim, BLOCK_D=fa.block_d(head_dim), CAUSAL=causal, USE_WINDOW=False,
                                VARLEN=False, DOT_PRECISION=fa.dot_precision(dtype))
                    if tma_path is not None:
                        meta["TMA"] = tma_path
                    for bm, bn, warps, stages in table[fa.head_dim_class(fa.block_d(head_dim))]:
                        compiled = kernel.warmup(*kernel_args[name], grid=(1,), **meta, BLOCK_M=bm, BLOCK_N=bn,
                                                 num_warps=warps, num_stages=stages)
                        regs, spill = resources(compiled)
                        smem = int(compiled.metadata.shared)
                        r = {"kernel": name + ("+tma" if tma_path else ""), "head_dim": head_dim, "group": group,
                             "causal": causal,
                             "config": (bm, bn, warps, stages), "regs": regs, "spill_bytes": spill,
                             "smem_bytes": smem, "ok": spill == 0 and smem <= 227 * 1024}
                        rows.append(r)
                        if print_table:
                            kind = "causal" if causal else "full"
                            print(f"{r['kernel']:>8} D={head_dim:<4} group={group:<2} {kind:>6} "
                                  f"BLOCK_M={bm:<4} BLOCK_N={bn:<4} warps={warps} stages={stages}: "
                                  f"{regs:>3} regs, {spill:>5} B spilled, {smem // 1024:>4} KB smem"
                                  f"{'' if r['ok'] else '  <- does not fit'}", flush=True)
    return rows


if __name__ == "__main__":
    from bench.run import main

    raise SystemExit(main(["--only", BENCHMARK]))
