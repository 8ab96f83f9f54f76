"""Chapter 9: the NumPy reference of the sampling parameters (`minillm.reference.ch09_sampling`),
on small cases worked out by hand, and `SamplingParams`' checks of them."""
from __future__ import annotations

import numpy as np
import pytest

from minillm.decoding.sampling import SamplingParams
from minillm.reference.ch09_sampling import next_token_probs, process_logits

INF = np.inf


def P(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 16, **kw})


def test_nothing_asked_changes_nothing():
    x = np.array([1.0, -2.0, 0.5])
    assert np.array_equal(process_logits(x, [0, 1], [2, 2], P()), x)


def test_repetition_divides_positive_and_multiplies_negative_over_prompt_and_output():
    x = np.array([1.0, -1.0, 2.0, 0.5, 0.0])
    # token 0 in the prompt, 1 and 2 in the output, 3 nowhere, 4 (logit 0) in the prompt
    got = process_logits(x, [0, 4], [1, 2, 2], P(repetition_penalty=2.0))
    assert np.array_equal(got, [0.5, -2.0, 1.0, 0.5, 0.0])
    # r < 1 rewards repetition: the reverse
    got = process_logits(x, [0], [1], P(repetition_penalty=0.5))
    assert np.array_equal(got, [2.0, -0.5, 2.0, 0.5, 0.0])


def test_frequency_and_presence_count_the_output_only():
    x = np.array([1.0, -1.0, 2.0, 0.5])
    got = process_logits(x, [0, 0, 3], [1, 2, 2], P(frequency_penalty=0.5, presence_penalty=0.25))
    # token 1: once -> -1 - 0.5 - 0.25; token 2: twice -> 2 - 1.0 - 0.25; prompt tokens 0, 3 untouched
    assert np.allclose(got, [1.0, -1.75, 0.75, 0.5])
    # negative values reward what was said
    got = process_logits(x, [], [3], P(frequency_penalty=-1.0, presence_penalty=-2.0))
    assert np.allclose(got, [1.0, -1.0, 2.0, 3.5])


def test_all_three_penalties_together():
    x = np.array([1.0, -1.0, 2.0, 0.5])
    got = process_logits(x, [0], [1, 2, 2], P(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25))
    # repetition first: [0.5, -2, 1, 0.5]; then token 1: -2 - 0.5 - 0.25, token 2: 1 - 1 - 0.25
    assert np.allclose(got, [0.5, -2.75, -0.25, 0.5])


def test_logit_bias_comes_before_the_penalties():
    x = np.array([1.0, 0.0, -3.0])
    got = process_logits(x, [], [1], P(logit_bias={1: 2.0, 2: 5.0}, repetition_penalty=2.0))
    assert np.array_equal(got, [1.0, 1.0, 2.0])       # (0 + 2) / 2, and -3 + 5 (not repeated)


def test_min_tokens_masks_the_stop_tokens_until_reached():
    x = np.array([3.0, 1.0, 2.0, 0.0])
    stops = {0, 2}
    for generated in ([], [1], [1, 3]):
        got = process_logits(x, [1], generated, P(min_tokens=3), stops)
        assert np.array_equal(got, [-INF, 1.0, -INF, 0.0]), generated
    assert np.array_equal(process_logits(x, [1], [1, 3, 1], P(min_tokens=3), stops), x), "3 generated: free"
    # a bias cannot bring a masked stop token back
    got = process_logits(x, [], [], P(min_tokens=1, logit_bias={0: 100.0}), stops)
    assert got[0] == -INF
    assert np.argmax(next_token_probs(x, [], [], P(min_tokens=1, temperature=0), stops)) == 1


def test_greedy_is_the_argmax_after_processing():
    x = np.array([5.0, 1.0, 0.0])
    assert np.array_equal(next_token_probs(x, [], [], P(temperature=0)), [1, 0, 0])
    assert np.array_equal(next_token_probs(x, [], [], P(temperature=0, logit_bias={2: 100})), [0, 0, 1])
    assert np.array_equal(next_token_probs(x, [0], [], P(temperature=0, repetition_penalty=6.0)), [0, 1, 0])
    # min_p does not apply to greedy (it never removes the argmax)
    assert np.array_equal(next_token_probs(x, [], [], P(temperature=0, min_p=0.9)), [1, 0, 0])


def test_min_p_keeps_tokens_at_least_min_p_times_the_best():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    x = np.log(probs)
    got = next_token_probs(x, [], [], P(min_p=0.2))        # threshold 0.1: token 3 goes
    assert np.allclose(got, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    got = next_token_probs(x, [], [], P(min_p=0.5))        # threshold 0.25
    assert np.allclose(got, [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    assert np.allclose(next_token_probs(x, [], [], P(min_p=1.0)), [1, 0, 0, 0])
    assert np.allclose(next_token_probs(x, [], [], P(min_p=0.0)), probs)
    # after temperature: at T = 2 the probabilities flatten (sqrt), 0.05 -> 0.224 of the best
    got = next_token_probs(x, [], [], P(min_p=0.2, temperature=2.0))
    flat = np.sqrt(probs) / np.sqrt(probs).sum()
    assert np.allclose(got, flat / flat.sum())
    # min_p before top-p: what top-p sees is already renormalised
    got = next_token_probs(x, [], [], P(min_p=0.2, top_p=0.8))
    assert np.allclose(got, [0.5 / 0.8, 0.3 / 0.8, 0, 0])


def test_top_k_and_top_p():
    x = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    assert np.allclose(next_token_probs(x, [], [], P(top_k=2)), [0, 0.4 / 0.7, 0, 0.3 / 0.7])
    assert np.allclose(next_token_probs(x, [], [], P(top_p=0.6)), [0, 0.4 / 0.7, 0, 0.3 / 0.7])
    assert np.allclose(next_token_probs(x, [], [], P(top_p=0.75)), [0, 0.4 / 0.9, 0.2 / 0.9, 0.3 / 0.9])


@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, "presence_penalty must lie in \\[-2, 2\\]"),
    ("frequency_penalty", -2.01, "frequency_penalty must lie in \\[-2, 2\\]"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be a finite number"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("repetition_penalty", -1.0, "repetition_penalty must be > 0"),
    ("min_p", 1.5, "min_p must lie in \\[0, 1\\]"),
    ("min_p", -0.1, "min_p must lie in \\[0, 1\\]"),
    ("min_tokens", -1, "min_tokens must be an integer >= 0"),
    ("min_tokens", 17, "min_tokens must be <= max_tokens=16"),
    ("min_tokens", 1.5, "min_tokens must be an integer"),
    ("logit_bias", {"5": 1.0}, "logit_bias keys must be token ids"),
    ("logit_bias", {-1: 1.0}, "logit_bias keys must be token ids"),
    ("logit_bias", {5: float("inf")}, "logit_bias values must be finite"),
    ("prompt_logprobs", 21, "prompt_logprobs must be an integer in \\[0, 20\\]"),
])
def test_params_are_checked(field, value, message):
    with pytest.raises(ValueError, match=message):
        P(**{field: value})


def test_beam_search_refuses_what_it_would_ignore():
    for field, value in (("repetition_penalty", 1.2), ("presence_penalty", 0.5), ("frequency_penalty", 0.5),
                         ("min_p", 0.1), ("min_tokens", 2), ("logit_bias", {1: 1.0})):
        with pytest.raises(ValueError, match=f"{field} is not supported with beam search"):
            P(num_beams=2, **{field: value})


def test_logit_bias_is_normalised():
    p = P(logit_bias={np.int64(3): 1, 7: np.float32(-2.5)})
    assert p.logit_bias == {3: 1.0, 7: -2.5} and all(type(k) is int for k in p.logit_bias)
    assert P(logit_bias={}).logit_bias is None
    assert not P().processes_logits and P(min_tokens=1).processes_logits and not P(min_p=0.5).processes_logits
