"""Host time per call of Chapter 4's training step and Chapter 7's decode calls, with
`minillm.kernels.base.launch`'s shortcuts on and off (a tool, not part of `bench.run`).

Run on an sm_90 GPU: ``python -m bench.host_time``. For each of three ways of launching, in one
process and on the same tensors:

- ``wrapper, fresh descriptors``: a hit of `launch` calls ``binary.run``, Triton's Python wrapper
  around the C launcher, and every call builds its TMA descriptors anew (Chapter 4's kernels
  did, Chapter 7's did not: they always kept theirs);
- ``wrapper``: the same with the descriptors kept (`cached_descriptor`);
- ``direct``: the defaults: a hit calls the C launcher itself (`launch`'s direct plan, Triton
  3.6) and the descriptors are kept.

it prints the host's milliseconds per call (the fastest of `ROUNDS` medians of `HOST_CALLS`
calls that are not waited for, `bench.ch04_gluon.host_ms`, the modes taking turns) of the
forward, the backward and the step of `fastest_attention` at 1k keys (batch 16, hidden 2048, as
the dispatch part of ``bench/ch04_gluon.py``), of the Gluon and Triton decode calls at batch 1,
8 KV heads and 4k keys (and of that Gluon call's `launch` alone), and of SDPA's cuDNN backend on
the same shapes (in the training step pinned at every call, as the dispatch part does; in the
decode call once, around the timed calls).
"""
from __future__ import annotations

import gc

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import minillm.kernels.base as base
from minillm.kernels.ch04_flash_attention_hopper import fastest_attention
from minillm.kernels.ch05_paged_attention import decode_block_n
from minillm.kernels.ch07_flash_decoding import flash_decode_attention, num_sms, num_splits_heuristic
from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon, plan_splits

from bench.ch04_gluon import HOST_CALLS, forward_and_backward, host_ms
from bench.ch04_hopper import autograd_backward, sdpa_attention
from bench.common import contiguous_cache, paged_cache

MODES = ("wrapper, fresh descriptors", "wrapper", "direct")
ROUNDS = 15
DEFAULT_VERSIONS = base.DIRECT_LAUNCH_VERSIONS


def set_mode(mode: str) -> None:
    """Launch the way ``mode`` says from the next call on (the caches emptied)."""
    base.DIRECT_LAUNCH_VERSIONS = () if mode.startswith("wrapper") else DEFAULT_VERSIONS
    base.clear_launch_cache()
    base.clear_descriptor_cache()


def in_mode(fn, mode: str):
    """``fn``, emptying the descriptor store before each call in the fresh-descriptor mode."""
    if mode == "wrapper, fresh descriptors":
        return lambda: (base.clear_descriptor_cache(), fn())
    return fn


def host_ms_by_mode(calls: dict, rounds: int = ROUNDS) -> dict:
    """``{(mode, call key): ms}``: the host's time per call (`host_ms`) of every call in every
    mode, the fastest of ``rounds`` rounds in which the modes take turns (so that a host whose
    speed drifts, as a shared one's does by tens of percent within minutes, drifts for all
    modes alike). cuDNN's calls do not go through `launch`: they are timed in the last mode only."""
    best: dict = {}
    gc.collect()
    gc.disable()  # a collection inside a timed call would be the collector's time, not the call's
    try:
        _rounds(calls, rounds, best)
    finally:
        gc.enable()
    set_mode(MODES[-1])
    return best


def _rounds(calls: dict, rounds: int, best: dict) -> None:
    for _ in range(rounds):
        for mode in MODES:
            set_mode(mode)
            for key, fn in calls.items():
                if key[0].startswith("cuDNN") and mode != MODES[-1]:
                    continue
                if key[0] == "cuDNN decode":  # the backend pinned once, outside the timed calls
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        ms = host_ms(fn)
                else:
                    ms = host_ms(in_mode(fn, mode))
                best[mode, key] = min(ms, best.get((mode, key), ms))


def training_calls(device, head_dim: int, causal: bool, n: int = 1024, tokens: int = 16384, hidden: int = 2048):
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    batch, heads = max(1, tokens // n), hidden // head_dim
    q, k, v, dout = (torch.randn((batch, heads, n, head_dim), device=device, dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))
    ours = lambda q, k, v: fastest_attention(q, k, v, causal=causal)  # noqa: E731
    cudnn = sdpa_attention("sdpa_cudnn", causal)
    calls = {}
    for name, attn in (("ours", ours), ("cuDNN", cudnn)):
        calls[name, "fwd"] = lambda attn=attn: attn(q, k, v)
        calls[name, "bwd"] = autograd_backward(attn, q, k, v, dout)
        calls[name, "step"] = forward_and_backward(attn, q, k, v, dout)
    return calls


def decode_calls(device, batch: int = 1, kv_heads: int = 8, context: int = 4096):
    import torch.nn.functional as F

    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    q = torch.randn(batch, 32, 128, device=device, dtype=torch.bfloat16, generator=gen)
    k, v, tables = paged_cache(1, batch, kv_heads, context, 128, 16, torch.bfloat16, device, gen)
    k_c, v_c = contiguous_cache(1, batch, kv_heads, context, 128, torch.bfloat16, device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out, lse = torch.empty_like(q), torch.empty(batch, 32, device=device)
    sms = num_sms(device)
    plan, wave = plan_splits(batch, kv_heads, context, sms), num_splits_heuristic(
        batch, kv_heads, context, sms, decode_block_n(128, torch.bfloat16))

    def cudnn():  # (pinned by `main`, around the whole measurement)
        return F.scaled_dot_product_attention(q[:, :, None], k_c, v_c, enable_gqa=True)
    gluon = lambda: flash_decode_attention_gluon(q, k, v, tables, lens, num_splits=plan, out=out, lse=lse)  # noqa: E731
    launched = _launch_of(gluon)
    return {("gluon decode", "call"): gluon,
            ("gluon decode", "launch alone"): lambda: base.launch(launched[0], launched[1], *launched[2],
                                                                  **launched[3]),
            ("triton decode", "call"): lambda: flash_decode_attention(q, k, v, tables, lens, num_splits=wave,
                                                                      out=out, lse=lse),
            ("cuDNN decode", "call"): cudnn}


def _launch_of(call) -> tuple:
    """``(kernel, grid, args, meta)`` of the one `launch` that ``call()`` makes (Chapter 7's
    Gluon decode call: the launch timed without the wrapper's checks and planning)."""
    import minillm.kernels.ch07_flash_decoding_gluon as gluon_decode

    seen = []

    def spy(kernel, grid, *args, **meta):
        seen.append((kernel, grid, args, meta))
        return base.launch(kernel, grid, *args, **meta)
    gluon_decode.launch = spy
    try:
        call()
    finally:
        gluon_decode.launch = base.launch
    return seen[-1]


def main() -> None:
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {base.triton.__version__}; "
          f"host ms per call, fastest of {ROUNDS} medians of {HOST_CALLS} calls not waited for, the modes "
          "taking turns")
    points = [("step d=128 causal 1k", training_calls(device, 128, True)),
              ("step d=64 causal 1k", training_calls(device, 64, True)),
              ("step d=128 no mask 1k", training_calls(device, 128, False)),
              ("decode B=1 Hkv=8 L=4k", decode_calls(device))]
    for label, calls in points:
        best = host_ms_by_mode(calls)
        for mode in MODES:
            cells = [f"{key[0]} {key[1]} {best[mode, key]:.3f}" for key in calls if (mode, key) in best]
            print(f"{label:24} {mode:28} " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
