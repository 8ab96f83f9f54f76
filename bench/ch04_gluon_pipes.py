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
"""
from __future__ import annotations

import torch

from minillm.kernels.ch04_flash_attention_gluon import (
    flash_attention_gluon, flash_attention_gluon_fp8, prepare_gluon_fp8,
)

#: (batch, heads, keys, head dim): the forward part's 16k point at hidden 2048.
POINT = (1, 16, 16384, 128)
#: Launch order: name -> what it runs (the profiled launches are numbered in this order).
KERNELS = ("bf16 ws", "fp8 ws (row sums on the tensor cores)", "fp8 ws (row sums on the CUDA cores)")


def main() -> None:
    batch, heads, n, head_dim = POINT
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    prepared = prepare_gluon_fp8(q, k, v)
    calls = (lambda: flash_attention_gluon(q, k, v, variant="ws"),
             lambda: flash_attention_gluon_fp8(q, k, v, variant="ws", prepared=prepared),
             lambda: flash_attention_gluon_fp8(q, k, v, variant="ws", prepared=prepared, row_sum_mma=False))
    for name, call in zip(KERNELS, calls):
        call()
        torch.cuda.synchronize()
        print(f"launched: {name}", flush=True)


if __name__ == "__main__":
    main()
