"""Chapter 12 benchmark: MLA decode attention over the paged latent cache (absorbed form).

Shapes of DeepSeek-V2-Lite's attention: 16 heads, ``kv_lora_rank`` 512, ``qk_rope_head_dim``
64 (latent rows of 576), ``qk_nope_head_dim`` 128 and ``v_head_dim`` 128 for the peer's
decompressed heads; bf16; blocks of 64 tokens in shuffled order; batch 1, 8, 64 and context
4k, 32k (every sequence at length L).

- ours: `minillm.kernels.ch12_mla.mla_decode_attention` (absorbed queries ``[B, 16, 576]``
  over the latent rows; splits and Chapter 7's merge as its heuristic picks);
- ``sdpa_decompressed``: ``F.scaled_dot_product_attention`` with PyTorch's own backend choice
  over the *decompressed* keys ``[B, 16, L, 192]`` and values ``[B, 16, L, 128]`` of the same
  tokens (what a decode step costs when MLA is run as ordinary MHA with K/V materialised:
  8.9x the bytes of the latent rows); decompression is done once, outside the timing;
- ``torch_absorbed``: the absorbed form in plain torch over the latent rows, contiguous
  ``[B, L, 576]``: ``softmax(q Cᵀ · scale) C[:, :512]`` (two batched matmuls and a softmax).

Rows (``params``: batch, heads, context, kv_lora_rank, rope_dim, block_size, dtype):

===================  ========================================================================
``time_ms``          median time (``triton.testing.do_bench``, cold L2); one row per peer
``bandwidth_TBps``   `minillm.costs.mla_decode_bytes` (latent rows once, queries, latent
                     outputs, lse) / time, with the fraction of the measured copy bandwidth;
                     the SDPA peer's own figure over `minillm.costs.mla_naive_decode_bytes`
                     is in the note
``rel_err``          ``‖W_UV·ours − sdpa‖ / ‖sdpa‖`` (fp32), ours taken through ``W_UV``
``oom``              True when a point's inputs did not fit (nothing else recorded)
===================  ========================================================================

The sweep stops starting points after ``MINILLM_CH12_BUDGET_S`` seconds (default 150).
Importable without a GPU; `run` needs CUDA.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

import torch

from minillm.costs import mla_decode_bytes, mla_naive_decode_bytes
from minillm.kernels.ch12_mla import mla_decode_attention

from bench.common import (
    Results, attempt, cuda_device, dtype_name, fraction, free_memory, rel_err, shuffled_tables, sweep_start,
    time_sdpa,
)

BENCHMARK = "ch12_mla"
HEADS, KV_LORA_RANK, ROPE_DIM, NOPE_DIM, V_DIM = 16, 512, 64, 128, 128
BATCHES = (1, 8, 64)
CONTEXTS = (4096, 32768)
BLOCK_SIZE = 64
DTYPE = torch.bfloat16
WARMUP_MS, REP_MS = 25, 100


def budget_s() -> float:
    """Seconds after which no new point is started: ``MINILLM_CH12_BUDGET_S`` (default 150)."""
    return float(os.environ.get("MINILLM_CH12_BUDGET_S", "150"))


def run(results: Results, device) -> None:
    """The sweep on ``device`` (CUDA); needs ``results.ceilings["copy_TBps"]`` for the fractions."""
    sweep(results, cuda_device(device, "the Chapter 12 benchmark"))


def sweep(results: Results, device, heads: int = HEADS, kv_lora_rank: int = KV_LORA_RANK, rope_dim: int = ROPE_DIM,
          nope_dim: int = NOPE_DIM, v_dim: int = V_DIM, batches=BATCHES, contexts=CONTEXTS,
          block_size: int = BLOCK_SIZE, dtype: torch.dtype = DTYPE,
          timer: Callable[[Callable[[], Any]], float] | None = None) -> None:
    """The points of `run`. ``timer(fn) -> ms`` defaults to `bench.common.time_ms` (CUDA);
    the CPU test passes a stand-in to check the bookkeeping under the interpreter."""
    timer, gen, out_of_time = sweep_start(results, BENCHMARK, device, budget_s(), timer, WARMUP_MS, REP_MS)
    copy_tbps = (results.ceilings or {}).get("copy_TBps")
    for batch in batches:
        for context in contexts:
            if out_of_time():
                return
            t0 = time.perf_counter()
            _point(results, device, gen, batch, heads, context, kv_lora_rank, rope_dim, nope_dim, v_dim, block_size,
                   dtype, copy_tbps, timer)
            print(f"  [{BENCHMARK}] batch={batch} L={context}: {time.perf_counter() - t0:.1f} s", flush=True)


def _point(results, device, gen, batch, heads, context, r, dr, nope, dv, block_size, dtype, copy_tbps, timer):
    params = {"batch": batch, "heads": heads, "context": context, "kv_lora_rank": r, "rope_dim": dr,
              "block_size": block_size, "dtype": dtype_name(dtype)}
    add = lambda *a, **kw: results.add(BENCHMARK, params, *a, **kw)  # noqa: E731
    width, blocks_per_seq = r + dr, -(-context // block_size)

    def make():
        pool = torch.randn(batch * blocks_per_seq, block_size, 1, width, device=device, dtype=dtype, generator=gen)
        tables = shuffled_tables(batch, blocks_per_seq, device, gen)
        w_uk = torch.randn(heads, nope, r, device=device, dtype=dtype, generator=gen) / math.sqrt(r)
        w_uv = torch.randn(heads, dv, r, device=device, dtype=dtype, generator=gen) / math.sqrt(r)
        q_nope = torch.randn(batch, heads, nope, device=device, dtype=dtype, generator=gen)
        q_rope = torch.randn(batch, heads, dr, device=device, dtype=dtype, generator=gen)
        return pool, tables, w_uk, w_uv, q_nope, q_rope

    inputs, _ = attempt(make)
    if inputs is None:
        add("oom", True, note="latent pool did not fit")
        return
    pool, tables, w_uk, w_uv, q_nope, q_rope = inputs
    scale = 1.0 / math.sqrt(nope + dr)
    q_abs = torch.cat([torch.einsum("bhd,hdr->bhr", q_nope, w_uk), q_rope], dim=-1)  # [B, H, W]
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out = torch.empty(batch, heads, r, device=device, dtype=dtype)
    lse = torch.empty(batch, heads, device=device, dtype=torch.float32)

    def ours():
        return mla_decode_attention(q_abs, pool, tables, lens, r, scale, max_seq_len=context, out=out, lse=lse)

    ours()
    ours_ms = timer(ours)
    n_bytes = mla_decode_bytes([context] * batch, heads, r, dr, dtype.itemsize)
    tbps = lambda ms: n_bytes / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    ours_v = torch.einsum("bhr,hvr->bhv", out, w_uv)

    # The latent rows of each sequence, contiguous [B, L, W] (outside the timings).
    rows = pool[tables.long()].flatten(1, 2)[:, :context, 0]
    del pool
    free_memory()

    # Peer 1: SDPA over the decompressed K/V, built one sequence at a time (less peak memory).
    def decompress():
        k = torch.empty(batch, heads, context, nope + dr, device=device, dtype=dtype)
        v = torch.empty(batch, heads, context, dv, device=device, dtype=dtype)
        for b in range(batch):
            k[b, :, :, :nope] = torch.einsum("hdr,lr->hld", w_uk, rows[b, :, :r])
            k[b, :, :, nope:] = rows[b, None, :, r:]
            v[b] = torch.einsum("hvr,lr->hlv", w_uv, rows[b, :, :r])
        return k, v

    kv, status = attempt(decompress)
    sdpa = None
    if kv is not None:
        q_full = torch.cat([q_nope, q_rope], dim=-1)
        # (SDPA's default scale, 1/sqrt(192), is the decompressed head's: ours too.)
        sdpa, status = attempt(lambda: time_sdpa(q_full, kv[0], kv[1], None, timer), allow_errors=True)
        del kv
        free_memory()
    naive_bytes = mla_naive_decode_bytes([context] * batch, heads, nope + dr, dv, dtype.itemsize)
    add("time_ms", ours_ms, "sdpa_decompressed", sdpa[0] if sdpa else None, note=status)

    # Peer 2: the absorbed form in plain torch over the contiguous latent rows.
    def torch_absorbed():
        s = torch.matmul(q_abs, rows.transpose(1, 2)).float() * scale          # [B, H, L]
        return torch.matmul(torch.softmax(s, dim=-1).to(dtype), rows[..., :r])  # [B, H, r]

    absorbed_ms, status2 = attempt(lambda: timer(torch_absorbed), allow_errors=True)
    add("time_ms", ours_ms, "torch_absorbed", absorbed_ms, note=status2)
    note = "mla_decode_bytes / time"
    if sdpa:
        note += f"; sdpa_decompressed moves mla_naive_decode_bytes at {naive_bytes / (sdpa[0] * 1e-3) / 1e12:.2f} TB/s"
    add("bandwidth_TBps", tbps(ours_ms), "torch_absorbed", tbps(absorbed_ms),
        fraction_of_ceiling=fraction(tbps(ours_ms), copy_tbps), note=note)
    if sdpa is not None:
        add("rel_err", rel_err(ours_v, sdpa[1]), "sdpa_decompressed", None)
    del rows, out, lse, q_abs, sdpa
    free_memory()


def summary(results: Results | dict) -> str:
    """One line per point: our time, the peers', our bandwidth and its fraction of the copy."""
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    t: dict[tuple, dict] = {}
    for r in select(data, BENCHMARK, "time_ms"):
        key = (r["params"]["batch"], r["params"]["context"])
        t.setdefault(key, {})["ours"] = r["ours"]
        t[key][r["peer"]] = r["peer_value"]
    for r in select(data, BENCHMARK, "bandwidth_TBps"):
        key = (r["params"]["batch"], r["params"]["context"])
        t.setdefault(key, {}).update(bw=r["ours"], frac=r["fraction_of_ceiling"])
    for r in select(data, BENCHMARK, "oom"):
        t.setdefault((r["params"]["batch"], r["params"]["context"]), {})["oom"] = True

    def f(x, fmt="{:.3f}"):
        return "—" if x is None else fmt.format(x)

    lines = [f"{'B':>3} {'L':>6} {'ours ms':>9} {'sdpa ms':>9} {'torch ms':>9} {'TB/s':>6} {'of copy':>7}"]
    for key in sorted(t):
        row = t[key]
        if row.get("oom"):
            lines.append(f"{key[0]:>3} {key[1]:>6}  OOM (inputs)")
            continue
        lines.append(f"{key[0]:>3} {key[1]:>6} {f(row.get('ours')):>9} {f(row.get('sdpa_decompressed')):>9} "
                     f"{f(row.get('torch_absorbed')):>9} {f(row.get('bw'), '{:.2f}'):>6} "
                     f"{f(row.get('frac'), '{:.0%}'):>7}")
    return "\n".join(lines)


if __name__ == "__main__":
    from bench.run import main

    raise SystemExit(main(["--only", BENCHMARK]))
