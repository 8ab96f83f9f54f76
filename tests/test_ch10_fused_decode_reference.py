"""Chapter 10's NumPy references (`minillm.reference.ch10_fused_decode`) against the torch
model's ops in float64 (`minillm.model.torch_model`): the references are what the model
computes, written without rounding."""
import numpy as np
import torch
import torch.nn.functional as F

from minillm.model.torch_model import RMSNorm, apply_rope, rope_cos_sin
from minillm.reference import ch10_fused_decode as ref


def test_add_rmsnorm_is_the_models_residual_add_then_norm():
    rng = np.random.default_rng(0)
    x, r, w = rng.standard_normal((5, 48)), rng.standard_normal((5, 48)), rng.standard_normal(48)
    norm = RMSNorm(48, 1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        want = norm(torch.from_numpy(x + r)).numpy()
    y, new_r = ref.add_rmsnorm(x, r, w, 1e-5)
    np.testing.assert_allclose(new_r, x + r)
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
    y0, r0 = ref.add_rmsnorm(x, None, w, 1e-5)
    np.testing.assert_allclose(r0, x)
    np.testing.assert_allclose(y0, ref.rmsnorm(x, w, 1e-5))


def test_rope_cos_sin_and_rotary_are_the_models():
    positions = np.array([0, 1, 7, 1000])
    cos, sin = ref.rope_cos_sin(positions, 16, 10000.0)
    tc, ts = rope_cos_sin(torch.from_numpy(positions), 16, 10000.0, torch.float64)
    np.testing.assert_allclose(cos, tc.numpy(), atol=1e-12)
    np.testing.assert_allclose(sin, ts.numpy(), atol=1e-12)
    x = np.random.default_rng(1).standard_normal((4, 3, 16))
    want = apply_rope(torch.from_numpy(x), tc[:, None], ts[:, None]).numpy()
    np.testing.assert_allclose(ref.rotary(x, cos, sin), want, atol=1e-12)
    # Rotation keeps each pair's length, and position 0 is the identity.
    np.testing.assert_allclose(np.linalg.norm(ref.rotary(x, cos, sin), axis=-1), np.linalg.norm(x, axis=-1))
    np.testing.assert_allclose(ref.rotary(x, cos, sin)[0], x[0])


def test_rope_write_kv_writes_rotated_k_and_plain_v():
    rng = np.random.default_rng(2)
    T, H, Hkv, D = 3, 4, 2, 8
    q, k, v = rng.standard_normal((T, H, D)), rng.standard_normal((T, Hkv, D)), rng.standard_normal((T, Hkv, D))
    cos, sin = ref.rope_cos_sin(np.array([3, 4, 5]), D, 10000.0)
    kc, vc = np.zeros((2, 4, Hkv, D)), np.zeros((2, 4, Hkv, D))
    q_rot, kc2, vc2 = ref.rope_write_kv(q, k, v, cos, sin, kc, vc, np.array([5, -1, 0]))
    np.testing.assert_allclose(q_rot, ref.rotary(q, cos, sin))
    k_rot = ref.rotary(k, cos, sin)
    np.testing.assert_allclose(kc2[1, 1], k_rot[0])
    np.testing.assert_allclose(kc2[0, 0], k_rot[2])
    np.testing.assert_allclose(vc2[1, 1], v[0])
    assert np.count_nonzero(kc2.reshape(8, -1).any(-1)) == 2 and not kc.any()   # the inputs stay


def test_silu_mul_is_swiglu():
    x = np.random.default_rng(3).standard_normal((4, 10))
    g, u = torch.from_numpy(x).chunk(2, dim=-1)
    np.testing.assert_allclose(ref.silu_mul(x), (F.silu(g) * u).numpy(), atol=1e-12)
