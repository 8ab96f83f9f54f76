"""`minillm.experiments.ch07_softmax_stats`: the softmax-input statistics that choose FlashDecoding++'s φ."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minillm.model import LlamaForCausalLM, ModelConfig
from minillm.model import torch_model
from minillm.experiments.ch07_softmax_stats import choose_phi, collect_score_stats, fallback_fraction


def tiny_model(seed: int) -> LlamaForCausalLM:
    config = ModelConfig(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def test_row_max_equals_the_scores_sdpa_sees(seed, monkeypatch):
    """Capture the q and k the model really hands to SDPA and compare: the hook's recomputation
    of the scores (projection, RoPE, GQA) must be the model's own."""
    model = tiny_model(seed)
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, 61, (2, 13)))
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = (q.double() @ kk.double().transpose(-1, -2)) * kwargs["scale"]
        T = q.shape[2]
        seen.append(s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).amax(-1))
        return real_sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch_model.F, "scaled_dot_product_attention", spy)
    stats = collect_score_stats(model, ids)
    assert stats.row_max.shape == (2, 2, 4, 13)
    np.testing.assert_allclose(stats.row_max, torch.stack(seen).numpy(), rtol=1e-5, atol=1e-5)
    assert np.all(stats.row_min <= stats.row_max)
    assert np.all(np.diff(stats.quantiles, axis=1) >= 0)


def test_choose_phi_by_hand():
    # Window width 4: {0, 1, 2, 3} fit together, 10 does not. φ may range over
    # [3 - hi, 0 - lo] = [1, 2] (lo = -2, hi = 2); the middle is 1.5.
    phi, coverage = choose_phi([0.0, 1.0, 2.0, 3.0, 10.0], lo=-2.0, hi=2.0)
    assert phi == pytest.approx(1.5) and coverage == pytest.approx(0.8)
    assert fallback_fraction([0.0, 1.0, 2.0, 3.0, 10.0], phi, -2.0, 2.0) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        choose_phi([1.0], lo=1.0, hi=1.0)


def test_choose_phi_is_optimal_on_random_data(seed):
    rng = np.random.default_rng(seed)
    m = np.concatenate([rng.normal(5, 2, 500), rng.normal(15, 1, 50)])
    lo, hi = -10 / math.log2(math.e), 15 / math.log2(math.e)
    phi, coverage = choose_phi(m, lo, hi)
    assert coverage == pytest.approx(1 - fallback_fraction(m, phi, lo, hi))
    for other in np.linspace(m.min() - hi, m.max() - lo, 301):  # no φ keeps more rows inside
        assert fallback_fraction(m, other, lo, hi) >= 1 - coverage - 1e-12
