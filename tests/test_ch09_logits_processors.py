"""Chapter 9: the engine's batched logits processing (`minillm.decoding.logits_processors` and
`minillm.decoding.sampling.sampling_probs`) against the NumPy reference
(`minillm.reference.ch09_sampling`), on random logits and random histories, for many seeds
and parameter mixes, in batches that mix requests with and without any processing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minillm.decoding.logits_processors import apply_logits_processors, token_counts
from minillm.decoding.sampling import SamplingParams, min_p_filter, sampling_probs
from minillm.reference.ch09_sampling import next_token_probs, process_logits, softmax

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_params(rng, vocab: int) -> SamplingParams:
    """A random mix: each knob on with probability ~1/2 (some rows get none at all)."""
    on = lambda: rng.random() < 0.5  # noqa: E731
    kw: dict = {"max_tokens": 64}
    if on():
        kw["repetition_penalty"] = float(rng.choice([0.5, 0.9, 1.3, 2.0]))
    if on():
        kw["frequency_penalty"] = float(rng.uniform(-2, 2))
    if on():
        kw["presence_penalty"] = float(rng.uniform(-2, 2))
    if on():
        ids = rng.choice(vocab, int(rng.integers(1, min(vocab, 6))), replace=False)
        kw["logit_bias"] = {int(t): float(rng.uniform(-100, 100)) for t in ids}
    if on():
        kw["min_tokens"] = int(rng.integers(1, 8))
    if rng.random() < 0.3:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = float(rng.choice([0.3, 0.7, 1.0, 1.5]))
        if on():
            kw["min_p"] = float(rng.uniform(0, 0.5))
        if on():
            kw["top_k"] = int(rng.integers(1, vocab + 3))
        if on():
            kw["top_p"] = float(rng.uniform(0.05, 1.0))
    return SamplingParams(**kw)


def near_a_boundary(x: np.ndarray, params: SamplingParams, margin: float = 1e-4) -> bool:
    """Whether float32 rounding could flip a min-p, top-k or top-p decision of the reference."""
    if params.temperature == 0:
        top2 = np.sort(x[np.isfinite(x)])[::-1][:2]
        return len(top2) == 2 and top2[0] - top2[1] < margin
    x = x / params.temperature
    if params.min_p > 0:
        p = softmax(x)
        if np.any(np.abs(p - params.min_p * p.max()) < margin * p.max()):
            return True
        x = np.where(p < params.min_p * p.max(), -np.inf, x)
    if 0 < params.top_k < len(x):
        s = np.sort(x[np.isfinite(x)])[::-1]
        if params.top_k < len(s) and s[params.top_k - 1] - s[params.top_k] < margin:
            return True
        kth = np.sort(x)[::-1][params.top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    if params.top_p < 1:
        p = np.sort(softmax(x))[::-1]
        if np.any(np.abs(np.cumsum(p) - p - params.top_p) < margin):
            return True
    return False


def random_batch(rng, vocab: int, rows: int):
    params, prompts, outputs, stops = [], [], [], []
    for _ in range(rows):
        params.append(random_params(rng, vocab) if rng.random() < 0.75 else SamplingParams(max_tokens=64))
        prompts.append(rng.integers(0, vocab, int(rng.integers(1, 30))).tolist())
        # few distinct tokens, so that counts go above 1
        pool = rng.integers(0, vocab, int(rng.integers(1, 8)))
        outputs.append(rng.choice(pool, int(rng.integers(0, 12))).tolist())
        stops.append(set(rng.choice(vocab, int(rng.integers(1, 3)), replace=False).tolist()))
    return params, prompts, outputs, stops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(12))
def test_torch_matches_the_reference(seed, device):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    checked = 0
    for _ in range(6):
        vocab = int(rng.integers(5, 300))
        rows = int(rng.integers(1, 9))
        params, prompts, outputs, stops = random_batch(rng, vocab, rows)
        raw = (torch.randn(rows, vocab, generator=gen) * float(rng.choice([0.5, 2.0, 5.0]))).to(device)
        before = raw.clone()
        got = apply_logits_processors(raw, params, prompts, outputs, stops)
        assert torch.equal(raw, before), "the input logits (the raw log-probabilities' source) must not change"
        got = got.cpu()
        for i in range(rows):
            want = process_logits(raw[i].cpu().numpy(), prompts[i], outputs[i], params[i], stops[i])
            msg = f"seed {seed}, row {i}, {params[i]}"
            assert np.array_equal(np.isinf(got[i].numpy()), np.isinf(want)), msg
            finite = np.isfinite(want)
            np.testing.assert_allclose(got[i].numpy()[finite], want[finite], rtol=1e-5, atol=1e-5, err_msg=msg)
            if near_a_boundary(want, params[i]):
                continue
            checked += 1
            probs = (torch.nn.functional.one_hot(got[i].argmax(), vocab).double() if params[i].greedy
                     else sampling_probs(got[i], params[i]).double())
            np.testing.assert_allclose(probs.numpy(), next_token_probs(raw[i].cpu().numpy(), prompts[i], outputs[i],
                                                                       params[i], stops[i]), atol=2e-6, err_msg=msg)
    assert checked >= 10


def test_rows_without_processing_are_left_alone():
    logits = torch.randn(3, 50)
    params = [SamplingParams(), SamplingParams(temperature=0, top_k=5, min_p=0.3), SamplingParams(top_p=0.5)]
    assert apply_logits_processors(logits, params, [[1]] * 3, [[2, 2]] * 3, [{0}] * 3) is logits
    mixed = [params[0], SamplingParams(presence_penalty=1.0), params[2]]
    got = apply_logits_processors(logits, mixed, [[1]] * 3, [[2, 2]] * 3, [{0}] * 3)
    assert torch.equal(got[[0, 2]], logits[[0, 2]])
    assert got[1, 2] == logits[1, 2] - 1 and torch.equal(got[1, :2], logits[1, :2])


def test_token_counts():
    counts = token_counts([[1, 1, 3], [], [0]], 4, "cpu")
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_min_p_filter_batched():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    got = min_p_filter(probs.log(), torch.tensor([0.2, 0.9]))
    assert torch.isinf(got).tolist() == [[False, False, False, True], [False] * 4]
