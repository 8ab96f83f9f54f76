"""Chapter 12's MLA kernels against the float64 NumPy reference (`minillm.reference.ch12_mla`).

- `mla_decode_attention`: absorbed queries against shuffled, NaN-poisoned latent pools
  (`minillm.testing.PagedPool` with one "KV head" of width ``kv_lora_rank + rope``): block
  sizes 1, 3, 16, 17; 3 to 20 heads (one and two head blocks); lengths 0, 1 and odd; 1, 2,
  3, 5 splits and more splits than tiles (Chapter 7's merge); the partials of the splits.
- `write_latent_cache`: RMSNorm of the latent and RoPE of the rotary key (interleaved and
  rotate-half pairs) fused into the store; slot -1 writes nothing.
- `mla_prefill_attention`: several new tokens per sequence, causal, after a cached prefix.

CPU: small shapes under the interpreter, fp32 and fp16. GPU (`make gpu`): fp16 and bf16, and
the `gpu`-marked DeepSeek-V2-Lite shapes (16 heads, 512 + 64) at 4k tokens with the default
tiles and split heuristic.
"""
import math

import numpy as np
import pytest
import torch

from minillm.kernels.ch12_mla import (
    mla_block_n, mla_decode_attention, mla_num_splits, mla_prefill_attention, write_latent_cache,
)
from minillm.reference import ch12_mla as ref
from minillm.testing import PagedPool, assert_close, poisoned, random_tensor, skip_fp32_on_gpu, to_numpy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_N = 16

# (heads, kv_lora_rank, rope, block_size, seq_lens, num_splits, block_h)
SMALL = [
    (3, 24, 8, 1, [37, 0, 5], 3, None),      # blocks of 1, a length 0, a sequence shorter than a split
    (16, 32, 16, 16, [77, 16, 40], 1, None),  # one split: the kernel writes the output itself
    (20, 40, 8, 3, [51, 1, 23], 2, 16),      # two head blocks (the second half empty), a length 1
    (5, 16, 4, 17, [70], 5, None),           # blocks of 17 straddle tiles
    (4, 8, 2, 4, [9, 3], 7, None),           # more splits than tiles: empty splits
]


def _case(heads, r, dr, block_size, lens, dtype, device, gen):
    pool = PagedPool(lens, block_size, 1, r + dr, dtype, device, gen)
    q = random_tensor((len(lens), heads, r + dr), dtype, device, gen)
    return pool, q, 1.0 / math.sqrt(r + dr)


@pytest.mark.parametrize("heads,r,dr,block_size,lens,num_splits,block_h", SMALL)
def test_decode_matches_reference(heads, r, dr, block_size, lens, num_splits, block_h, dtype, device, gen, seed):
    skip_fp32_on_gpu(dtype, device)
    pool, q, scale = _case(heads, r, dr, block_size, lens, dtype, device, gen)
    out = poisoned((len(lens), heads, r), dtype, device)
    lse = poisoned((len(lens), heads), torch.float32, device)
    workspace = None
    if num_splits > 1:
        workspace = (poisoned((len(lens), heads, num_splits, r), torch.float32, device),
                     poisoned((len(lens), heads, num_splits), torch.float32, device))
    got, got_lse = mla_decode_attention(q, pool.k, pool.tables, pool.lens(device), r, scale, num_splits=num_splits,
                                        out=out, lse=lse, block_n=BLOCK_N, block_h=block_h, workspace=workspace)
    assert got is out and got_lse is lse
    k, _, tables = pool.numpy()
    exp_out, exp_lse = ref.paged_latent_decode(to_numpy(q), k, tables, lens, r, scale)
    assert_close(out, exp_out, dtype, "out", seed)
    assert_close(lse, exp_lse, torch.float32 if dtype == torch.float32 else dtype, "lse", seed)
    if workspace is not None:  # each split's partial is attention over its own rows
        from minillm.reference.ch07_flash_decoding import split_bounds
        o_part = to_numpy(workspace[0])
        qn = to_numpy(q)
        for b, n in enumerate(lens):
            pos = np.arange(n)
            rows = k[tables[b][pos // block_size], pos % block_size, 0]
            for s, (lo, hi) in enumerate(split_bounds(n, num_splits, BLOCK_N)):
                if hi > lo:
                    o, _ = ref.latent_attention(qn[b:b + 1], rows[lo:hi], r, scale, causal=False)
                    assert_close(workspace[0][b, :, s], o[0], dtype, f"partial {b},{s}", seed)
                else:
                    assert np.all(to_numpy(workspace[1][b, :, s]) == -np.inf)
        assert np.isfinite(o_part[..., 0][to_numpy(workspace[1]) > -np.inf]).all()


def test_default_heuristic_and_tiles(device, gen, seed):
    """The defaults (tile size, head block, splits from ``max_seq_len``) give the reference too."""
    dtype = torch.float16
    pool, q, scale = _case(6, 32, 8, 16, [300, 7], dtype, device, gen)
    out, lse = mla_decode_attention(q, pool.k, pool.tables, pool.lens(device), 32, scale, max_seq_len=300)
    k, _, tables = pool.numpy()
    exp_out, exp_lse = ref.paged_latent_decode(to_numpy(q), k, tables, [300, 7], 32, scale)
    assert_close(out, exp_out, dtype, "out", seed)
    assert mla_num_splits(1, 1, 4096, 132) == 16 and mla_num_splits(64, 1, 32768, 132) == 4
    assert mla_num_splits(1, 1, 100, 132) == 1
    assert mla_block_n(512, torch.bfloat16) in (16, 32)


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "rotate-half"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no-norm"])
def test_write_latent_cache(interleave, norm, dtype, device, gen, seed):
    skip_fp32_on_gpu(dtype, device)
    r, dr, block_size, num_blocks, n = 24, 8, 4, 6, 9
    cache = poisoned((num_blocks, block_size, 1, r + dr), dtype, device)
    kv = random_tensor((n, r + dr), dtype, device, gen)
    weight = (1 + 0.1 * random_tensor((r,), torch.float64, "cpu", gen)).to(device, dtype)
    positions = torch.randint(0, 500, (n,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[3] = -1  # not written
    cos_h, sin_h = ref.rope_tables(positions.numpy(), dr, 10000.0)                 # [n, dr/2]
    cos = torch.from_numpy(np.concatenate([cos_h, cos_h], 1)).to(device, dtype)
    sin = torch.from_numpy(np.concatenate([sin_h, sin_h], 1)).to(device, dtype)
    write_latent_cache(cache, kv, slots.to(device), r, cos, sin, weight if norm else None, 1e-6, interleave)
    kvn = to_numpy(kv)
    c = ref.rms_norm(kvn[:, :r], to_numpy(weight), 1e-6) if norm else kvn[:, :r]
    k_rope = ref.apply_rope(kvn[:, r:], cos_h, sin_h, interleave)
    flat = cache.view(-1, r + dr)
    keep = slots >= 0
    expected = np.concatenate([c, k_rope], 1)[keep.numpy()]
    assert_close(flat[slots[keep].to(device)], expected, dtype, "rows", seed)
    assert torch.isnan(flat[[i for i in range(flat.shape[0]) if i not in set(slots[keep].tolist())]]).all()


@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_matches_reference(block_size, dtype, device, gen, seed):
    """Chunks of new tokens after cached prefixes (and a fresh prompt), causal, bottom-right."""
    skip_fp32_on_gpu(dtype, device)
    heads, r, dr = 5, 24, 8
    lens, new = [29, 7, 18], [4, 7, 1]
    pool, _, scale = _case(heads, r, dr, block_size, lens, dtype, device, gen)
    q = random_tensor((sum(new), heads, r + dr), dtype, device, gen)
    cu = torch.tensor([0, *np.cumsum(new)], dtype=torch.int32, device=device)
    out, lse = mla_prefill_attention(q, pool.k, cu, pool.tables, pool.lens(device), r, scale, max_seq_len=max(lens))
    k, _, tables = pool.numpy()
    qn = to_numpy(q)
    for b, (n, t) in enumerate(zip(lens, new)):
        pos = np.arange(n)
        rows = k[tables[b][pos // block_size], pos % block_size, 0]
        lo = int(cu[b])
        o, l = ref.latent_attention(qn[lo:lo + t], rows, r, scale, causal=True)
        assert_close(out[lo:lo + t], o, dtype, f"sequence {b}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq_len", [(1, 4096), (8, 1000)])
def test_deepseek_v2_lite_shapes_gpu(batch, seq_len, gen, seed):
    """16 heads, kv_lora_rank 512, rope 64, bf16, blocks of 16, default tiles and splits."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    lens = [seq_len - 17 * b for b in range(batch)]
    pool, q, _ = _case(16, 512, 64, 16, lens, dtype, device, gen)
    scale = 1.0 / math.sqrt(192)
    out, lse = mla_decode_attention(q, pool.k, pool.tables, pool.lens(device), 512, scale, max_seq_len=max(lens))
    k, _, tables = pool.numpy()
    exp_out, exp_lse = ref.paged_latent_decode(to_numpy(q), k, tables, lens, 512, scale)
    assert_close(out, exp_out, dtype, "out", seed)
    assert_close(lse, exp_lse, dtype, "lse", seed)


def test_benchmark_dry_run(device):
    """`bench.ch12_mla.sweep` end to end on tiny shapes with a stand-in timer that calls each
    function once: every point adds its rows, ours (through W_UV) agrees with SDPA over the
    decompressed K/V, and the summary prints. The real sweep runs on a GPU
    (`python -m bench.run --only ch12_mla`)."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench import ch12_mla as bench
    from bench.common import Results

    results = Results("dry run", {"copy_TBps": 1.0, "bf16_matmul_TFLOPs": 1.0}, env={})
    bench.sweep(results, device, heads=3, kv_lora_rank=16, rope_dim=8, nope_dim=12, v_dim=10, batches=(1, 2),
                contexts=(40,), block_size=16, dtype=torch.float32, timer=lambda fn: (fn(), 1.0)[1])
    count = lambda metric: sum(r["metric"] == metric for r in results.rows)  # noqa: E731
    assert count("time_ms") == 2 * 2 and count("bandwidth_TBps") == 2 and count("rel_err") == 2
    assert all(r["ours"] < 1e-5 for r in results.rows if r["metric"] == "rel_err")
    assert results.status[bench.BENCHMARK] == "complete"
    assert len(bench.summary(results).splitlines()) == 1 + 2
