"""Chapter 4 benchmark: what each FlashAttention-2 idea buys, measured one at a time.

Every row compares our forward kernel (``ours``: all ideas on) with a variant that has one
idea taken away (``peer``), on the same inputs, with the same tile config, in the same run:

==========================  ================================================================
peer                        what is taken away
==========================  ================================================================
``rescale_each_step``       FA2 change (2): O is renormalised after every key block (FA1)
                            instead of divided by ℓ once at the end
``mask_every_block``        the mask is applied to every visited block, not only to the
                            diagonal (causal) or ragged (tail) ones
``visit_every_block``       causal block skipping: every key block is loaded, computed and
                            masked (as a causal kernel without skipping would)
``fa1_order``               FA2 change (1): Chapter 3's kernel, FlashAttention-1's loop order
                            (K/V blocks outside, Q blocks inside, O/ℓ/m in an HBM workspace,
                            one program per (batch, head)); its own tile sizes
==========================  ================================================================

Metrics: ``time_ms`` and ``TFLOPs`` (FLOPs as in `minillm.costs.nominal_attention_flops`); ratio > 1 means the
idea helps. FA2 change (3) (store only ``L = m + log ℓ``) is a memory claim: ``peak_bytes``
rows give the peak memory allocated during one forward + backward (inputs excluded) for
ours and for SDPA's math backend, which keeps the N x N probabilities for its backward.

Shapes: bf16, head_dim 128, 16 heads, N = 4096, batch 4 (16k tokens, as the main sweep) and
batch 1 (where FA1's one program per (batch, head) gives only 16 programs for 132 SMs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from minillm.costs import nominal_attention_flops
from minillm.kernels.ch04_flash_attention import (
    ABLATIONS, FWD_TILES, FWD_TILES_TMA, Packing, flash_attention, launch_forward, use_tma,
)
from minillm.kernels.ch03_online_softmax import tiled_attention

from bench.common import Results, attempt, free_memory, rel_err, time_ms

BENCHMARK = "ch04_ablations"
HEADS, SEQ_LEN, HEAD_DIM = 16, 4096, 128
BATCHES = (4, 1)
DTYPE = torch.bfloat16


def run(results: Results, device) -> None:
    """Run every comparison on ``device`` (CUDA) and add the rows to ``results``."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError("the Chapter 4 ablations need a CUDA device")
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    for batch in BATCHES:
        for causal in (False, True):
            _ablations(results, device, gen, batch, causal)
            free_memory()
    _memory(results, device, gen)


def _params(batch: int, causal: bool, **extra) -> dict:
    return {"batch": batch, "heads": HEADS, "seq_len": SEQ_LEN, "head_dim": HEAD_DIM, "causal": causal,
            "dtype": "bfloat16", **extra}


def _ablations(results: Results, device, gen, batch: int, causal: bool) -> None:
    shape = (batch, HEADS, SEQ_LEN, HEAD_DIM)
    q, k, v = (torch.randn(shape, device=device, dtype=DTYPE, generator=gen) for _ in range(3))
    packing = Packing(batch, SEQ_LEN, SEQ_LEN)
    tma = use_tma(packing, q, k, v, q)
    bm, bn, warps, stages = (FWD_TILES_TMA if tma else FWD_TILES)[HEAD_DIM][0]
    config = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
    scale = HEAD_DIM ** -0.5
    flops = nominal_attention_flops(batch, HEADS, SEQ_LEN, SEQ_LEN, HEAD_DIM, causal)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    note = f"tile {bm}x{bn}, {warps} warps, {stages} stages, {'TMA' if tma else 'pointer'} path"

    def forward(ablation=None):
        return lambda: launch_forward(q, k, v, packing, causal, scale, None, config=config, tma=tma, ablation=ablation)

    ours_out = forward()()[0]
    ours_ms = time_ms(forward())
    variants = {name: forward(name) for name in ABLATIONS}
    variants["fa1_order"] = lambda: tiled_attention(q, k, v, causal=causal)
    for name, fn in variants.items():
        res, status = attempt(lambda: (fn()[0], time_ms(fn)), allow_errors=True)
        peer_ms = res[1] if res else None
        err = rel_err(res[0], ours_out) if res else None
        row_note = f"{note}; max rel. difference to ours {err:.1e}" if err is not None else (status or note)
        params = _params(batch, causal)
        results.add(BENCHMARK, params, "time_ms", ours_ms, name, peer_ms, note=row_note)
        results.add(BENCHMARK, params, "TFLOPs", tflops(ours_ms), name, tflops(peer_ms), note=row_note)
        print(f"  [{BENCHMARK}] B={batch} causal={causal} {name}: ours {ours_ms:.3f} ms, "
              f"{name} {peer_ms if peer_ms is None else round(peer_ms, 3)} ms", flush=True)


def _peak_bytes(fn) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _memory(results: Results, device, gen, batch: int = 1) -> None:
    """FA2 change (3): peak memory of a forward + backward, ours vs SDPA math (keeps P)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = (batch, HEADS, SEQ_LEN, HEAD_DIM)
    q, k, v, dout = (torch.randn(shape, device=device, dtype=DTYPE, generator=gen) for _ in range(4))

    def fwd_bwd(attn):
        def run():
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            torch.autograd.grad(attn(qg, kg, vg), (qg, kg, vg), dout)
        return run

    def sdpa_math(a, b, c):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    ours_fn = fwd_bwd(lambda a, b, c: flash_attention(a, b, c, causal=True))
    # Once untimed first: the first call autotunes, and the autotuner's timing allocates a
    # 256 MiB buffer (to flush L2) that is not the kernels' memory.
    ours_fn()
    ours = _peak_bytes(ours_fn)
    peer, status = attempt(lambda: (fwd_bwd(sdpa_math)(), _peak_bytes(fwd_bwd(sdpa_math)))[1], allow_errors=True)
    results.add(BENCHMARK, _params(batch, True, **{"pass": "fwd+bwd"}), "peak_bytes", ours, "sdpa_math", peer,
                note="peak allocated during one forward + backward, inputs excluded; ours saves O and "
                     f"L ({batch * HEADS * SEQ_LEN * 4} bytes of L) for the backward" + (f"; {status}" if status else ""))


def summary(results: Results | dict) -> str:
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    lines = [f"{'B':>3} {'causal':>6} {'without':>18} {'ours ms':>8} {'without ms':>10} {'gain':>5}"]
    for r in select(data, BENCHMARK, "time_ms"):
        p = r["params"]
        peer, ratio = r["peer_value"], r.get("ratio")
        peer_s = "—" if peer is None else f"{peer:.3f}"
        ratio_s = "—" if ratio is None else f"{ratio:.2f}"
        lines.append(f"{p['batch']:>3} {str(p['causal']):>6} {r['peer']:>18} {r['ours']:>8.3f} {peer_s:>10} {ratio_s:>5}")
    for r in select(data, BENCHMARK, "peak_bytes"):
        peer = "—" if r["peer_value"] is None else f"{r['peer_value'] / 2**20:.0f} MiB"
        lines.append(f"peak memory fwd+bwd: ours {r['ours'] / 2**20:.0f} MiB, {r['peer']} {peer}")
    return "\n".join(lines)


if __name__ == "__main__":
    from bench.run import main

    raise SystemExit(main(["--only", BENCHMARK]))
