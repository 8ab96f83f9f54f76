"""The NumPy reference is the oracle for every kernel, so it gets its own checks: against
PyTorch's SDPA (an independent implementation) and against hand-computable cases."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minillm.reference import attention, attention_mask, kv_head_for, softmax


def sdpa(q, k, v, causal, mask=None):
    """PyTorch's math SDPA in float64 with GQA expanded explicitly."""
    q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(mask)).numpy()
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).numpy()


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (6, 2), (5, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa(q_heads, kv_heads, causal, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, q_heads, 19, 24))
    k = rng.standard_normal((2, kv_heads, 19, 24))
    v = rng.standard_normal((2, kv_heads, 19, 24))
    out, lse = attention(q, k, v, causal=causal)
    np.testing.assert_allclose(out, sdpa(q, k, v, causal), atol=1e-12, err_msg=f"seed {seed}")
    # lse is the log of the softmax denominator: recompute it directly.
    s = np.einsum("bhmd,bhnd->bhmn", q, np.repeat(k, q_heads // kv_heads, axis=1)) / np.sqrt(24)
    s = np.where(attention_mask(19, 19, causal), s, -np.inf)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-12)


def test_window_matches_explicit_mask(seed):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 2, 23, 8)) for _ in range(3))
    mask = attention_mask(23, 23, causal=True, window=5)
    out, _ = attention(q, k, v, causal=True, window=5)
    np.testing.assert_allclose(out, sdpa(q, k, v, False, mask=mask), atol=1e-12)


def test_mask_bottom_right_alignment():
    # Decode: one query (the newest token) sees all 6 cached keys.
    assert attention_mask(1, 6, causal=True).tolist() == [[True] * 6]
    # Two new queries after 3 cached tokens: positions 3 and 4.
    assert attention_mask(2, 5, causal=True).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # Sliding window of 2: itself and one token back.
    assert attention_mask(3, 3, causal=True, window=2).astype(int).tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]


def test_fully_masked_rows_give_zero_and_minus_inf():
    # 3 queries, 1 key, causal: the first two queries precede the only key.
    q, k, v = np.ones((1, 1, 3, 4)), np.ones((1, 1, 1, 4)), np.ones((1, 1, 1, 4))
    out, lse = attention(q, k, v, causal=True)
    assert np.all(out[0, 0, :2] == 0) and np.all(np.isneginf(lse[0, 0, :2]))
    np.testing.assert_allclose(out[0, 0, 2], 1.0)
    np.testing.assert_allclose(lse[0, 0, 2], 2.0)  # one key: lse = its score, q·k/sqrt(4) = 4/2


def test_softmax_is_shift_invariant_and_safe():
    x = np.array([[1000.0, 1001.0, 1002.0], [-np.inf, -np.inf, -np.inf]])
    p = softmax(x)
    np.testing.assert_allclose(p[0], softmax(np.array([0.0, 1.0, 2.0])))
    assert np.all(p[1] == 0)


def test_kv_head_for():
    assert [kv_head_for(h, 8, 2) for h in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [kv_head_for(h, 4, 1) for h in range(4)] == [0, 0, 0, 0]
    with pytest.raises(ValueError):
        kv_head_for(0, 6, 4)
