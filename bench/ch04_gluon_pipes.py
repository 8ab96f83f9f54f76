"""Chapter 4, Gluon: which units the forward keeps busy, bf16 against FP8 (a tool for Nsight
Compute, not part of `bench.run`).

Run on an sm_90 GPU under Nsight Compute::

    ncu --clock-control none --kernel-name-base function --kernel-name _warp_specialized_kernel \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \\
        --section WarpStateStats --page raw --csv python -m bench.ch04_gluon_pipes

At one point of the forward part of ``bench/ch04_gluon.py`` (head dim 128, no mask, 16k keys,
batch 1, 16 heads), it calls each of `KERNELS` once, in this order: the bf16 kernel ``ws``, the
FP8 kernel with its defaults (row sums on the tensor cores) and the FP8 kernel summing on the
CUDA cores. Nsight Compute replays each launch for its sections (caches flushed before each
pass), so what it reports is each kernel's own use of the tensor cores (``pipe_tensor``), the
special-function unit that evaluates the exponentials (``xu``), the FMA and ALU pipes and the
issue slots, and where the warps wait. Chapter 4's page "where the FP8 kernel's time goes"
reads the committed log, ``bench/results/raw/<gpu>.ch04_gluon_pipes.csv``.

Where in the code the warps wait: with ``--pinned`` the tool also launches the bf16 and FP8
kernels with ``pin_softmax=True`` (`PINNED_KERNELS`, after the three above), for Nsight Compute's
per-instruction warp samples::

    ncu --clock-control none --kernel-name-base function --kernel-name _warp_specialized_kernel \
        --section SourceCounters -o source python -m bench.ch04_gluon_pipes --pinned
    ncu -i source.ncu-rep --page source --print-source sass --csv > source.csv
    python -m bench.ch04_gluon_pipes --shares source.csv

The last prints, for each launch, the share of its warps' samples at each kind of instruction
(`INSTRUCTION_KINDS`): the page of Chapter 4 on what the compiler did with the overlap reads
it from ``bench/results/raw/<gpu>.ch04_gluon_source_shares.csv``.

With ``--wide`` it launches, after `KERNELS` (and the pinned ones, if asked for), the FP8 kernel with 192-key blocks
(`WIDE_KERNELS`; ``block_n=192``, its row sums on the tensor cores), for the same sections:
Chapter 4's page on FlashAttention-3's FP8 tile reads ``<gpu>.ch04_gluon_pipes_wide.csv``.

``python -m bench.ch04_gluon_pipes --sass`` (no profiler) compiles the warp-specialized kernels
on this GPU, pinned and not, and prints their key loops' events in the machine code
(`minillm.testing.key_loop_events`): what this machine's Triton and ptxas made of the order
(``bench/results/raw/<gpu>.ch04_gluon_sass_order.txt``).
"""
from __future__ import annotations

import csv
import sys

import torch

from minillm.kernels.ch04_flash_attention_gluon import (
    flash_attention_gluon, flash_attention_gluon_fp8, prepare_gluon_fp8,
)

#: (batch, heads, keys, head dim): the forward part's 16k point at hidden 2048.
POINT = (1, 16, 16384, 128)
#: Launch order: name -> what it runs (the profiled launches are numbered in this order).
KERNELS = ("bf16 ws", "fp8 ws (row sums on the tensor cores)", "fp8 ws (row sums on the CUDA cores)")
#: With ``--pinned``, launched after `KERNELS`: the first two with the softmax pinned ahead of the
#: wait for P·V (``pin_softmax=True``).
PINNED_KERNELS = ("bf16 ws, pinned", "fp8 ws (row sums on the tensor cores), pinned")
#: With ``--wide``, launched after `KERNELS`: FP8 with 192-key blocks (two tiles of 128 and 64 keys).
WIDE_KERNELS = ("fp8 ws, 192-key blocks (row sums on the tensor cores)",)
#: Kinds of SASS instruction, by the start of the opcode: what a warp sampled there was doing.
INSTRUCTION_KINDS = {
    "wait for matmuls": ("WARPGROUP.DEPBAR",), "start matmuls": ("HGMMA", "QGMMA", "WARPGROUP.ARRIVE"),
    "exponentials": ("MUFU.EX2",), "max": ("FMNMX",), "add": ("FADD",), "multiply (-add)": ("FMUL", "FFMA"),
    "convert": ("F2FP",), "shuffle": ("SHFL",), "barriers (mbarrier, bar.sync)": ("SYNCS", "BAR.SYNC"),
    "idle (NOP)": ("NOP",),
}


def instruction_shares(source_csv: str) -> list[dict]:
    """Per launch in Nsight Compute's ``--page source --print-source sass --csv`` output: the share
    of its warps' samples (``Warp Stall Sampling (All Samples)``) at each of `INSTRUCTION_KINDS`,
    and ``"other"``; every launch's shares add up to 1. (The warps that ``gl.warp_specialize``
    leaves without work wait in ``NOP``s; ``other`` holds the branches of the barrier waits'
    retry loops, most of them the loader warp's, and the integer work.)"""
    launches, header = [], None
    for row in csv.reader(source_csv.splitlines()):
        if row and row[0] == "Kernel Name":
            launches.append({})
            header = None
        elif row and row[0] == "Address":
            header = {name: i for i, name in enumerate(row)}
        elif header and len(row) == len(header):
            op = row[header["Source"]].split()
            op = op[1] if op and op[0].startswith("@") else (op[0] if op else "")
            kind = next((k for k, prefixes in INSTRUCTION_KINDS.items() if op.startswith(prefixes)), "other")
            samples = int(row[header["Warp Stall Sampling (All Samples)"]].replace(",", "") or 0)
            launches[-1][kind] = launches[-1].get(kind, 0) + samples
    return [{kind: n / sum(counts.values()) for kind, n in counts.items()} for counts in launches]


def print_shares(source_csv_path: str) -> None:
    """`instruction_shares` of a source CSV as a CSV table: a row per kind, a column per launch."""
    shares = instruction_shares(open(source_csv_path).read())
    names = (KERNELS + PINNED_KERNELS)[:len(shares)]
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow(["kind", *names])
    for kind in (*INSTRUCTION_KINDS, "other"):
        out.writerow([kind, *(f"{launch.get(kind, 0):.4f}" for launch in shares)])


def print_sass_order() -> None:
    """The key loop's events in the machine code (`minillm.testing.key_loop_events`) of the bf16
    and FP8 kernels at `POINT`'s head dim, both warp-specialized variants, pinned and not,
    compiled here by this Triton (and its ptxas)."""
    import triton

    from minillm.testing import exps_before_wait, key_loop_events, sass_ops

    q = torch.zeros(1, 4, 256, POINT[3], device="cuda", dtype=torch.bfloat16)
    print(f"# {torch.cuda.get_device_name()}, Triton {triton.__version__}: exponentials before the wait "
          "for P·V (of 66 a block), then the key loop's events from the wait for S")
    for dtype, fn in (("bf16", flash_attention_gluon), ("fp8", flash_attention_gluon_fp8)):
        for variant in ("ws", "ws_pingpong"):
            for pin in (False, True):
                ops = sass_ops(fn(q, q, q, variant=variant, pin_softmax=pin, compile_only=True).asm["cubin"])
                print(f"{dtype} {variant}{' pinned' if pin else ''}: {exps_before_wait(ops)}: {key_loop_events(ops)}")


def main(pinned: bool = False, wide: bool = False) -> None:
    batch, heads, n, head_dim = POINT
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    prepared = prepare_gluon_fp8(q, k, v)
    names = KERNELS
    calls = (lambda: flash_attention_gluon(q, k, v, variant="ws"),
             lambda: flash_attention_gluon_fp8(q, k, v, variant="ws", prepared=prepared),
             lambda: flash_attention_gluon_fp8(q, k, v, variant="ws", prepared=prepared, row_sum_mma=False))
    if pinned:
        names += PINNED_KERNELS
        calls += (lambda: flash_attention_gluon(q, k, v, variant="ws", pin_softmax=True),
                  lambda: flash_attention_gluon_fp8(q, k, v, variant="ws", prepared=prepared, pin_softmax=True))
    if wide:
        prepared_192 = prepare_gluon_fp8(q, k, v, 192)
        names += WIDE_KERNELS
        calls += (lambda: flash_attention_gluon_fp8(q, k, v, variant="ws", block_n=192, prepared=prepared_192),)
    for name, call in zip(names, calls):
        call()
        torch.cuda.synchronize()
        print(f"launched: {name}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--shares"]:
        print_shares(sys.argv[2])
    elif sys.argv[1:2] == ["--sass"]:
        print_sass_order()
    else:
        main(pinned="--pinned" in sys.argv[1:], wide="--wide" in sys.argv[1:])
