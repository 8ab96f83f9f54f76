"""The Gluon backward called bare and through autograd, against cuDNN's, taking turns (a tool,
not part of `bench.run`).

Run on an sm_90 GPU: ``python -m bench.backward_paths``. At the points where the dispatch part
of ``bench/ch04_gluon.py`` measured the training step's backward furthest below the backward
part's bare kernel (head dim 128, causal, 8k and 16k keys; batch 16k / N, hidden 2048), it
times, in one process on the same tensors:

- ``bare``: `flash_attention_gluon_backward` on the Gluon forward's out and logsumexp, as the
  backward part times it (``bwd_tma``);
- ``autograd``: the backward of `fastest_attention` through ``torch.autograd.grad``, as the
  dispatch part times it (its forward saved once);
- ``sdpa_cudnn``: the backward of SDPA's cuDNN backend through autograd.

Each is `ROUNDS` medians of ``do_bench`` (cold L2), the three taking turns in every round
(`bench.common.interleaved_times`); printed: each one's median and the spread of its rounds,
and the ratios to cuDNN.
"""
from __future__ import annotations

import statistics

import torch
import triton

from minillm.costs import nominal_attention_flops
from minillm.kernels.ch04_flash_attention_gluon import flash_attention_gluon, flash_attention_gluon_backward
from minillm.kernels.ch04_flash_attention_hopper import fastest_attention

from bench.ch04_hopper import HIDDEN, TOKENS, autograd_backward, sdpa_attention

ROUNDS = 7
POINTS = ((128, True, 8192), (128, True, 16384))


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for head_dim, causal, n in POINTS:
        batch, heads = max(1, TOKENS // n), HIDDEN // head_dim
        q, k, v, dout = (torch.randn((batch, heads, n, head_dim), device="cuda", dtype=torch.bfloat16,
                                     generator=gen) for _ in range(4))
        with torch.no_grad():
            out, lse = flash_attention_gluon(q, k, v, causal=causal)
        calls = {"bare": lambda: flash_attention_gluon_backward(dout, q, k, v, out, lse, causal=causal),
                 "autograd": autograd_backward(lambda q, k, v: fastest_attention(q, k, v, causal=causal),
                                               q, k, v, dout),
                 "sdpa_cudnn": autograd_backward(sdpa_attention("sdpa_cudnn", causal), q, k, v, dout)}
        times = {name: [] for name in calls}
        for fn in calls.values():
            fn()
        for _ in range(ROUNDS):
            for name, fn in calls.items():
                times[name].append(triton.testing.do_bench(fn, warmup=25, rep=100))
        flops = nominal_attention_flops(batch, heads, n, n, head_dim, causal, backward=True)
        ms = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"D={head_dim} causal={causal} N={n} batch={batch}: " + "; ".join(
            f"{name} {ms[name]:.3f} ms ({flops / ms[name] / 1e9:.0f} TFLOP/s, rounds {min(ts):.3f}-{max(ts):.3f}, "
            f"{ms['sdpa_cudnn'] / ms[name]:.3f}x cuDNN)" for name, ts in times.items()), flush=True)


if __name__ == "__main__":
    main()
