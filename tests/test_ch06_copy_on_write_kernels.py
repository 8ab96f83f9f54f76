"""Chapter 6's block-copy kernel (`minillm.kernels.ch06_copy_on_write.copy_blocks`) against the
reference `minillm.paged.layout.copy_blocks`.

Pools of the engine's shape ``[2, layers, num_blocks, block_size, kv_heads, head_dim]`` and
single per-layer caches, block sizes 1 to 17 and blocks larger than one program's chunk
(several programs per block, a ragged last chunk), random pairs whose destinations are
fresh blocks. Whole pools are compared bit for bit: every block that is not a destination
must keep its contents, and NaN payloads are copied as they are (the copy is a byte copy).
The pool is a view that starts one block into a larger tensor and ends one block before its
end, so a copy that strays outside the pool is caught in those guard blocks.

CPU: the interpreter, fp32 and fp16 (the byte copy makes the dtype irrelevant to the kernel,
so bf16 runs there too); GPU (`make gpu`): the same, plus a pool past 2^31 elements.
"""
import numpy as np
import pytest
import torch

from minillm.kernels.ch06_copy_on_write import check_pairs, copy_block_size, copy_blocks
from minillm.paged import BlockManager
from minillm.paged.layout import copy_blocks as reference_copy_blocks
from minillm.testing import default_device, fresh_seed


def guarded_pool(rng, lead, num_blocks, block_size, kv_heads, head_dim, dtype, device):
    """``(big, pool)``: ``pool = big[..., 1:-1, :, :, :]``, random values (some NaN)."""
    big = rng.standard_normal((*lead, num_blocks + 2, block_size, kv_heads, head_dim))
    big[rng.random(big.shape) < 0.05] = np.nan
    big = torch.from_numpy(big).to(device=device, dtype=dtype)
    return big, big[..., 1:-1, :, :, :]


def random_pairs(rng, num_blocks, n):
    """``n`` pairs: distinct destinations, none of them a source (a source may repeat: two
    forks of one parent both copy its last block)."""
    blocks = rng.permutation(num_blocks)
    dst = blocks[:n]
    src = rng.choice(blocks[n:], size=n, replace=True)
    return [(int(s), int(d)) for s, d in zip(src, dst)]


def expected(big, pairs):
    want = big.detach().cpu().clone()
    inner = want[..., 1:-1, :, :, :]
    reference_copy_blocks([inner.movedim(-4, 0)], pairs)   # block axis first for the reference
    return want


def same_bits(a, b):
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@pytest.mark.parametrize("lead,num_blocks,block_size,kv_heads,head_dim,n_pairs", [
    ((2, 3), 12, 4, 2, 16, 3),       # the engine's [2, layers, ...] pool
    ((2, 1), 9, 1, 1, 8, 4),         # block size 1
    ((2, 2), 8, 17, 3, 12, 2),       # 612 elements per block: a ragged chunk
    ((), 10, 7, 2, 32, 4),           # one layer's k_cache
    ((2, 2), 6, 16, 8, 64, 2),       # 8192 elements: several programs per block
])
def test_copy_blocks_matches_the_reference(lead, num_blocks, block_size, kv_heads, head_dim, n_pairs, dtype):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    device = default_device()
    big, pool = guarded_pool(rng, lead, num_blocks, block_size, kv_heads, head_dim, dtype, device)
    pairs = random_pairs(rng, num_blocks, n_pairs)
    want = expected(big, pairs)
    copy_blocks(pool, pairs)
    assert same_bits(big, want), f"pairs {pairs}, pool {tuple(pool.shape)} {dtype}, seed {seed}"


def test_copy_blocks_of_separate_k_and_v_pools_and_pair_forms():
    """A (k_pool, v_pool) tuple; pairs as a list, an array and a tensor; bf16 (a byte copy)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    device = default_device()
    for form in (list, np.array, torch.tensor):
        bk, k = guarded_pool(rng, (3,), 11, 5, 2, 16, torch.bfloat16, device)
        bv, v = guarded_pool(rng, (3,), 11, 5, 2, 16, torch.bfloat16, device)
        pairs = random_pairs(rng, 11, 3)
        want_k, want_v = expected(bk, pairs), expected(bv, pairs)
        copy_blocks((k, v), form(pairs))
        assert same_bits(bk, want_k) and same_bits(bv, want_v), f"{form.__name__} pairs {pairs}, seed {seed}"


def test_copy_blocks_from_the_block_manager():
    """The copies `BlockManager` asks for after forks (beam search style), done on a pool."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    device = default_device()
    mgr = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    mgr.allocate("p", list(range(10)))                 # 3 blocks, the last one half full
    for child in "abc":
        mgr.fork("p", child)
    copies = []
    for seq in "pabc":
        copies += list(mgr.append_slots([seq], [7]).copies)
    assert len(copies) == 3, copies                    # the last appender keeps the original
    big, pool = guarded_pool(rng, (2, 2), 16, 4, 2, 16, torch.float32, device)
    want = expected(big, copies)
    copy_blocks(pool, copies)
    assert same_bits(big, want), f"copies {copies}, seed {seed}"


def test_no_pairs_is_a_no_op():
    big, pool = guarded_pool(np.random.default_rng(0), (2,), 4, 2, 1, 8, torch.float32, default_device())
    before = big.clone()
    copy_blocks(pool, [])
    copy_blocks(pool, np.zeros((0, 2), dtype=np.int64))
    assert same_bits(big, before)


@pytest.mark.parametrize("pairs,why", [
    ([(0, 1), (2, 1)], "two copies into one block"),
    ([(0, 1), (1, 2)], "a destination that is also a source"),
    ([(0, 9)], "a block past the pool"),
    ([(-1, 2)], "a negative block id"),
])
def test_bad_pairs_are_refused(pairs, why):
    pool = torch.zeros(2, 9, 2, 1, 8, device=default_device())
    with pytest.raises(ValueError):
        copy_blocks(pool, pairs)
    with pytest.raises(ValueError):
        check_pairs(pairs, 9)


def test_a_pool_that_does_not_flatten_is_refused():
    pool = torch.zeros(4, 8, 3, 2, 16, device=default_device()).transpose(0, 1)  # [8, 4, ...]: planes strided
    pool = pool.transpose(-3, -2)                                                # block not contiguous
    with pytest.raises(ValueError):
        copy_blocks(pool, [(0, 1)])


def test_chunk_size():
    assert copy_block_size(1) == 1 and copy_block_size(612) == 1024 and copy_block_size(16 * 8 * 128) == 4096


@pytest.mark.gpu
def test_copy_blocks_past_2_31_elements():
    """Block offsets of a pool past 2^31 elements need 64-bit addresses (fp16: 4.3 GB)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    num_blocks, block_size, kv_heads, head_dim = 65600, 16, 8, 128       # 2 planes: 2.15e9 elements
    pool = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=torch.float16)
    src = [int(b) for b in rng.choice(100, 3, replace=False)]
    dst = [num_blocks - 1 - i for i in range(3)]
    for s in src:
        pool[:, s] = torch.randn(2, block_size, kv_heads, head_dim, device="cuda", dtype=torch.float16)
    copy_blocks(pool, list(zip(src, dst)))
    for s, d in zip(src, dst):
        assert torch.equal(pool[:, d], pool[:, s]), f"block {s} -> {d}, seed {seed}"
