"""Chapter 5's NumPy references: `paged_kv_addresses` against the slots `minillm.paged.gather_slots`
reads, and paged attention over K/V scattered into shuffled blocks
(`minillm.testing.PagedPool`) against `minillm.reference.ch01_naive_attention` on the
contiguous K/V. The kernels are tested against these in `test_ch05_paged_attention_kernels.py`.
"""
import numpy as np
import pytest
import torch

from minillm.paged import PAD, gather_slots
from minillm.reference import attention
from minillm.reference import ch05_paged_attention as ref
from minillm.testing import PagedPool, random_tensor, to_numpy


def test_paged_kv_addresses(seed):
    """The slots equal the ones `gather_slots` reads (a pool whose value is its slot index),
    for positions in any order; padding entries and positions past the table are refused."""
    rng = np.random.default_rng(seed)
    block_size, num_blocks = 7, 13
    row = rng.permutation(num_blocks)[:5].tolist() + [PAD, PAD]
    n = 4 * block_size + 3  # five blocks, the last one partial
    pool = np.arange(num_blocks * block_size).reshape(num_blocks, block_size)
    positions = rng.permutation(n)
    got = ref.paged_kv_addresses(row, positions, block_size)
    assert got.dtype == np.int64
    assert np.array_equal(got, gather_slots(pool, row, n)[positions])
    assert np.array_equal(got // block_size, np.asarray(row)[positions // block_size])
    with pytest.raises(ValueError, match="padding"):
        ref.paged_kv_addresses(row, [5 * block_size], block_size)
    with pytest.raises(ValueError, match="past the block table"):
        ref.paged_kv_addresses(row, [7 * block_size], block_size)


@pytest.mark.parametrize("block_size", [1, 4, 5])
def test_references_equal_contiguous_attention(block_size, seed, gen):
    """K/V scattered into shuffled blocks, read back by the paged references, give the same
    attention as `minillm.reference.ch01_naive_attention` on the contiguous K/V (decode and prefill)."""
    q_heads, kv_heads, head_dim = 6, 2, 8
    pool = PagedPool([13, 4, 0], block_size, kv_heads, head_dim, torch.float64, "cpu", gen)
    k, v, tables = pool.numpy()
    q = to_numpy(random_tensor((3, q_heads, head_dim), torch.float64, "cpu", gen))
    out, lse = ref.paged_decode_attention(q, k, v, tables, pool.seq_lens)
    for b, n in enumerate(pool.seq_lens):
        if n == 0:
            assert not out[b].any() and np.all(lse[b] == -np.inf)
            continue
        kb, vb = (to_numpy(t[b]).transpose(1, 0, 2)[None] for t in (pool.k_seq, pool.v_seq))
        o, l = attention(q[b][None, :, None], kb, vb)
        np.testing.assert_allclose(out[b], o[0, :, 0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[b], l[0, :, 0], rtol=1e-12)

    q_lens = [5, 4, 0]
    qp = to_numpy(random_tensor((9, q_heads, head_dim), torch.float64, "cpu", gen))
    out, lse = ref.paged_prefill_attention(qp, [0, 5, 9, 9], k, v, tables, pool.seq_lens, causal=True)
    assert out.shape == (9, q_heads, head_dim) and lse.shape == (q_heads, 9)
    for b, (q0, nq) in enumerate(zip([0, 5], q_lens[:2])):
        kb, vb = (to_numpy(t[b]).transpose(1, 0, 2)[None] for t in (pool.k_seq, pool.v_seq))
        o, l = attention(qp[q0:q0 + nq].transpose(1, 0, 2)[None], kb, vb, causal=True)
        np.testing.assert_allclose(out[q0:q0 + nq], o[0].transpose(1, 0, 2), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[:, q0:q0 + nq], l[0], rtol=1e-12)


def test_reference_refuses_padding_inside_the_length():
    k = np.zeros((2, 4, 1, 8))
    with pytest.raises(ValueError, match="padding"):
        ref.paged_decode_attention(np.zeros((1, 1, 8)), k, k, np.array([[0, PAD]]), [6])
