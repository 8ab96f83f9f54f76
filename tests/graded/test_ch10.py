"""Graded tests for Chapter 10 (fusing the decode step). Run: `make grade CH=10`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run (the seed is in every
failure message; pin it with ``MINILLM_SEED``).
"""
import numpy as np
import pytest
import torch

from minillm.model.torch_model import rope_cos_sin
from minillm.reference import ch10_fused_decode as ref
from minillm.reference.ch10_sampling import exponential_race as race_reference
from minillm.testing import assert_close, poisoned, random_tensor, to_numpy

norm_ex = pytest.mark.exercise(id="10.1", title="Residual add + RMSNorm in one kernel", points=3, kind="triton")
rope_ex = pytest.mark.exercise(id="10.2", title="Rotary embedding fused with the paged cache write", points=4,
                               kind="triton")


# --- 10.1 ------------------------------------------------------------------------------------

@norm_ex
@pytest.mark.parametrize("T,hidden", [(1, 16), (5, 96), (3, 130), (8, 512)])
def test_add_rmsnorm(impl, T, hidden, dtype, device, gen, seed):
    x = random_tensor((T, hidden), dtype, device, gen)
    r = random_tensor((T, hidden), dtype, device, gen)
    w = random_tensor((hidden,), dtype, device, gen, scale=0.5) + 1
    y, new_r = impl.add_rmsnorm(x, r, w, 1e-5)
    want_y, want_r = ref.add_rmsnorm(to_numpy(x), to_numpy(r), to_numpy(w), 1e-5)
    assert y.shape == (T, hidden) and new_r.shape == (T, hidden)
    assert_close(new_r, want_r, dtype, "residual", seed)
    assert_close(y, want_y, dtype, "normed output", seed)


@norm_ex
def test_add_rmsnorm_strided_rows(impl, device, gen, seed):
    """Rows of ``x`` two apart (a view): the kernel must use the row stride it is given."""
    big = random_tensor((6, 2, 40), torch.float32, device, gen)
    x, r = big[:, 0], random_tensor((6, 40), torch.float32, device, gen)
    w = random_tensor((40,), torch.float32, device, gen)
    y, new_r = impl.add_rmsnorm(x, r, w, 1e-6)
    want_y, want_r = ref.add_rmsnorm(to_numpy(x), to_numpy(r), to_numpy(w), 1e-6)
    assert_close(new_r, want_r, torch.float32, "residual", seed)
    assert_close(y, want_y, torch.float32, "normed output", seed)


# --- 10.2 ------------------------------------------------------------------------------------

def _rope_case(T, H, Hkv, D, block_size, dtype, device, gen, seed):
    rng = np.random.default_rng(seed)
    qkv = random_tensor((T, (H + 2 * Hkv) * D), dtype, device, gen)     # the merged projection's output
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
    cos, sin = rope_cos_sin(torch.as_tensor(rng.integers(0, 3000, T), device=device), D, 10000.0, dtype)
    num_blocks = T // block_size + 3
    slots = rng.permutation(num_blocks * block_size)[:T]
    return q, k, v, cos, sin, num_blocks, slots


@rope_ex
@pytest.mark.parametrize("T,H,Hkv,D,block_size", [(1, 2, 1, 16, 4), (7, 4, 2, 32, 16), (5, 6, 3, 24, 3),
                                                   (4, 3, 3, 64, 2)])
def test_rope_write_kv(impl, T, H, Hkv, D, block_size, dtype, device, gen, seed):
    q, k, v, cos, sin, num_blocks, slots = _rope_case(T, H, Hkv, D, block_size, dtype, device, gen, seed)
    k_cache = poisoned((num_blocks, block_size, Hkv, D), dtype, device)
    v_cache = poisoned((num_blocks, block_size, Hkv, D), dtype, device)
    q_out = impl.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, torch.as_tensor(slots, device=device))
    want_q, want_k, want_v = ref.rope_write_kv(to_numpy(q), to_numpy(k), to_numpy(v), to_numpy(cos), to_numpy(sin),
                                               to_numpy(k_cache), to_numpy(v_cache), slots)
    assert_close(q_out, want_q, dtype, "rotated q", seed)
    flat_k, flat_v = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    assert_close(flat_k[slots], want_k.reshape(-1, Hkv, D)[slots], dtype, "k in its slots", seed)
    assert_close(flat_v[slots], want_v.reshape(-1, Hkv, D)[slots], dtype, "v in its slots", seed)


@rope_ex
def test_rope_write_kv_skips_padding_slots(impl, device, gen, seed):
    """Slot -1 (a padding token): nothing is written for it, and every slot no token names
    keeps its old contents."""
    T, H, Hkv, D, bs = 6, 4, 2, 16, 4
    q, k, v, cos, sin, num_blocks, slots = _rope_case(T, H, Hkv, D, bs, torch.float32, device, gen, seed)
    slots[[1, 4]] = -1
    k_cache = poisoned((num_blocks, bs, Hkv, D), torch.float32, device)
    v_cache = poisoned((num_blocks, bs, Hkv, D), torch.float32, device)
    q_out = impl.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, torch.as_tensor(slots, device=device))
    assert_close(q_out, ref.rotary(to_numpy(q), to_numpy(cos), to_numpy(sin)), torch.float32, "rotated q", seed)
    written = np.zeros(num_blocks * bs, bool)
    written[slots[slots >= 0]] = True
    flat_k = k_cache.view(-1, Hkv, D).cpu()
    assert torch.isnan(flat_k[torch.from_numpy(~written)]).all(), "a slot no token names was written"
    assert not torch.isnan(flat_k[torch.from_numpy(written)]).any(), "a token's slot was not written"


# --- 10.3 ------------------------------------------------------------------------------------

race_ex = pytest.mark.exercise(id="10.3", title="The exponential race: the sampler's draw", points=3, kind="triton")


def _race_case(B, vocab, device, seed):
    rng = np.random.default_rng(seed)
    p = rng.random((B, vocab)).astype(np.float32)
    p[:, rng.random(vocab) < 0.3] = 0                       # tokens that may never win
    p[0] = np.where(np.arange(vocab) == vocab - 1, 0.7, 0)  # only the last token left
    u = rng.uniform(1e-6, 1 - 1e-6, (B, vocab)).astype(np.float32)
    return p, u


@race_ex
@pytest.mark.parametrize("B,vocab", [(1, 1), (3, 37), (4, 1000), (2, 2500)])
def test_race_matches_the_reference(impl, B, vocab, device, seed):
    p, u = _race_case(B, vocab, device, seed)
    got = impl.race(torch.as_tensor(p, device=device), torch.as_tensor(u, device=device))
    assert got.dtype == torch.int64 and got.shape == (B,)
    want = race_reference(p, u)
    assert got.cpu().tolist() == want.tolist(), f"tokens differ (seed {seed}): {got.cpu().tolist()} vs {want.tolist()}"


@race_ex
def test_race_ties_go_to_the_lowest_id_across_tiles(impl, device, seed):
    """Equal scores in two tiles (vocab 2500 is three tiles of 1024): the first token wins."""
    p = np.zeros((2, 2500), np.float32)
    u = np.full((2, 2500), 0.5, np.float32)
    p[0, [7, 1500, 2400]] = 0.2
    p[1, [2100, 1030]] = 0.2
    got = impl.race(torch.as_tensor(p, device=device), torch.as_tensor(u, device=device)).cpu().tolist()
    assert got == [7, 1030], f"seed {seed}: {got}"
