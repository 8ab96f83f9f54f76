"""Chapter 6 benchmark: the copy-on-write block copies (`minillm.kernels.ch06_copy_on_write`).

One decode step's copies: ``n`` (src, dst) block pairs, each copied in every layer for K and
V, in the engine's pool ``[2, layers, num_blocks, block_size, kv_heads, head_dim]`` (bf16,
Llama-3-8B's 32 layers, 8 KV heads of 128; 64k token slots). Peers, on the same pool and
pairs, in the same run:

- ``torch_index``: ``flat[:, dst] = flat[:, src]`` on the pool viewed as ``[planes,
  num_blocks, block_elems]``, what `minillm.paged.layout.copy_blocks` does on a tensor (a
  gather into a temporary, then a scatter: two kernels, and the block bytes cross HBM twice);
- ``torch_index_copy``: ``flat.index_copy_(1, dst, flat.index_select(1, src))``, the same
  two steps spelled with the dedicated ops.

Points: block sizes 16 and 256; pairs 1, 4, 16, 64, 256 (a step of beam search with width 4
over a batch of 64 sequences copies up to 192 blocks; parallel sampling's forks copy once
per child).

Rows (``params``: block_size, pairs, layers, kv_heads, head_dim, dtype):

=================  ========================================================================
``time_ms``        median time (`triton.testing.do_bench`, L2 flushed) of one call; one row
                   per peer
``bandwidth_TBps`` bytes moved (each block read once and written once, in every plane) /
                   time, with its fraction of the measured copy bandwidth (``copy_TBps``
                   counts reads plus writes too, so the ceiling is 1)
=================  ========================================================================

What to expect: a few pairs are a few MB (one 16-token block is 32 KB per plane, 2 MB over
the 64 planes), far too little to reach the copy bandwidth: the launch and the first bytes'
latency dominate, and the torch peers pay for two kernels. With hundreds of pairs (hundreds
of MB) the kernel streams at a large fraction of the copy bandwidth, and the torch peers,
which move every byte twice through a temporary, run at about half of it.
"""
from __future__ import annotations

import numpy as np
import torch

from minillm.kernels.ch06_copy_on_write import copy_blocks

from bench.common import Results, attempt, free_memory, time_ms

BENCHMARK = "ch06_copy_on_write"
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
TOKEN_SLOTS = 65536
BLOCK_SIZES = (16, 256)
PAIRS = (1, 4, 16, 64, 256)
WARMUP_MS, REP_MS = 25, 100


def run(results: Results, device) -> None:
    """Run the sweep on ``device`` (CUDA) and add its rows to ``results``."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError("the Chapter 6 copy benchmark needs a CUDA device")
    copy_tbps = (results.ceilings or {}).get("copy_TBps")
    rng = np.random.default_rng(0)
    for block_size in BLOCK_SIZES:
        num_blocks = TOKEN_SLOTS // block_size
        shape = (2, LAYERS, num_blocks, block_size, KV_HEADS, HEAD_DIM)
        pool, status = attempt(lambda: torch.randn(shape, device=device, dtype=DTYPE))
        if pool is None:
            results.add(BENCHMARK, {"block_size": block_size}, "oom", True, note=f"pool {shape}: {status}")
            continue
        for n in PAIRS:
            if 2 * n > num_blocks:
                continue
            _run_point(results, pool, rng, n, copy_tbps)
        del pool
        free_memory()


def _run_point(results: Results, pool: torch.Tensor, rng, n: int, copy_tbps) -> None:
    _, _, num_blocks, block_size, kv_heads, head_dim = pool.shape
    blocks = rng.permutation(num_blocks)
    pairs = list(zip(blocks[n:2 * n].tolist(), blocks[:n].tolist()))          # (src, dst), distinct
    params = {"block_size": block_size, "pairs": n, "layers": pool.shape[1], "kv_heads": kv_heads,
              "head_dim": head_dim, "dtype": str(pool.dtype).removeprefix("torch.")}
    flat = pool.view(pool.shape[0] * pool.shape[1], num_blocks, -1)
    src = torch.tensor([s for s, _ in pairs], device=pool.device)
    dst = torch.tensor([d for _, d in pairs], device=pool.device)
    pairs_t = torch.tensor(pairs, device=pool.device)

    def ours():
        copy_blocks(pool, pairs_t)      # a CUDA tensor: no host-side check, as in a captured step

    def torch_index():
        flat[:, dst] = flat[:, src]

    def torch_index_copy():
        flat.index_copy_(1, dst, flat.index_select(1, src))

    # Correctness first: after one call the destinations hold the sources, bit for bit.
    before = flat[:, src].clone()
    ours()
    assert torch.equal(flat[:, dst], before), "copy_blocks did not copy the blocks"

    timer = lambda fn: time_ms(fn, warmup=WARMUP_MS, rep=REP_MS)  # noqa: E731
    ours_ms = timer(ours)
    n_bytes = 2 * n * flat.shape[0] * flat.shape[2] * pool.element_size()       # read + write
    tbps = lambda ms: n_bytes / (ms * 1e-3) / 1e12  # noqa: E731
    for peer, fn in (("torch_index", torch_index), ("torch_index_copy", torch_index_copy)):
        peer_ms = timer(fn)
        results.add(BENCHMARK, params, "time_ms", ours_ms, peer=peer, peer_value=peer_ms)
        results.add(BENCHMARK, params, "bandwidth_TBps", tbps(ours_ms), peer=peer, peer_value=tbps(peer_ms),
                    fraction_of_ceiling=tbps(ours_ms) / copy_tbps if copy_tbps else None)
    print(f"  [{BENCHMARK}] block_size={block_size} pairs={n}: ours {ours_ms * 1e3:.1f} us "
          f"({tbps(ours_ms):.2f} TB/s)", flush=True)


def summary(results: Results) -> str:
    rows = [r for r in results.rows if r["benchmark"] == BENCHMARK and r["metric"] == "time_ms"
            and r["peer"] == "torch_index"]
    return "\n".join(f"  block_size={r['params']['block_size']:>3} pairs={r['params']['pairs']:>3}: "
                     f"ours {r['ours'] * 1e3:7.1f} us, torch indexing {r['peer_value'] * 1e3:7.1f} us "
                     f"({r['ratio']:.2f}x)" for r in rows)
