"""Chapters 5-6: the waste of contiguous vs paged KV caches, and the savings of block sharing.

Small cases are computed by hand or by brute force over every step; the headline numbers
(the vLLM paper's 60-80 % waste for contiguous max-length reservation, under 4 % for paging,
and its fork-sharing savings) are checked on the documented synthetic distributions.
"""
from __future__ import annotations

import numpy as np
import pytest

from minillm.experiments.ch05_fragmentation import (
    ALPACA_LIKE, SHAREGPT_LIKE, LengthDistribution, Requests, contiguous_reservation, contiguous_waste, paged_waste,
    paged_waste_tokens, simulate_serving, waste_vs_block_size,
)
from minillm.experiments.ch06_sharing import SharingTrace, beam_search_trace, parallel_sampling_trace, sharing_savings


@pytest.fixture(scope="module")
def sharegpt():
    return SHAREGPT_LIKE.sample(10_000, seed=0)


def brute_force(requests: Requests, reserve_of) -> float:
    """Waste by walking every step of every request: ``reserve_of(i, L)`` slots held at length L."""
    used = reserved = 0
    for i, (p, o) in enumerate(zip(requests.prompt_lens.tolist(), requests.output_lens.tolist())):
        for L in range(p, p + o):
            used += L
            reserved += reserve_of(i, L)
    return 1 - used / reserved


# --- the distribution --------------------------------------------------------------------------
def test_sampling_is_deterministic_and_truncated():
    a, b, c = (SHAREGPT_LIKE.sample(5000, seed=s) for s in (3, 3, 4))
    assert np.array_equal(a.prompt_lens, b.prompt_lens) and np.array_equal(a.output_lens, b.output_lens)
    assert not np.array_equal(a.prompt_lens, c.prompt_lens)
    assert len(a) == 5000 and a.prompt_lens.min() >= 1 and a.output_lens.min() >= 1
    assert (a.prompt_lens + a.output_lens).max() <= 2048


@pytest.mark.parametrize("dist", [SHAREGPT_LIKE, ALPACA_LIKE], ids=lambda d: d.name)
def test_sampled_means_are_near_the_documented_ones(dist):
    d = dist.sample(50_000, seed=1).describe()
    # Truncation at max_len (and rounding up to 1) move the means by a few per cent at most.
    assert d["prompt_mean"] == pytest.approx(dist.prompt_mean, rel=0.06)
    assert d["output_mean"] == pytest.approx(dist.output_mean, rel=0.06)
    assert d["prompt_median"] < d["prompt_mean"] and d["output_median"] < d["output_mean"]  # long tails


def test_requests_are_validated():
    with pytest.raises(ValueError):
        Requests.of([3, 0], [1, 1], 10)
    with pytest.raises(ValueError):
        Requests.of([3], [0], 10)
    with pytest.raises(ValueError):
        Requests.of([8], [4], 10)          # holds 11 tokens > max_len
    with pytest.raises(ValueError):
        Requests.of([], [], 10)


# --- closed forms ------------------------------------------------------------------------------
def test_hand_computed_case():
    # p = 3, o = 4: the request holds 3, 4, 5, 6 tokens (18 token-steps), at most 6.
    r = Requests.of([3], [4], 10)
    assert contiguous_waste(r, "max") == pytest.approx(1 - 18 / 40)
    assert contiguous_waste(r, "pow2") == pytest.approx(1 - 18 / 32)
    assert contiguous_waste(r, "oracle") == pytest.approx(1 - 18 / 24)
    assert contiguous_waste(r, "max", when="final") == pytest.approx(1 - 6 / 10)
    assert contiguous_waste(r, "oracle", when="final") == 0
    assert paged_waste(r, 4) == pytest.approx(1 - 18 / (4 + 4 + 8 + 8))
    assert paged_waste(r, 4, when="final") == pytest.approx(1 - 6 / 8)
    assert paged_waste(r, 1) == 0
    assert paged_waste_tokens(r, 4).tolist() == [2]


def test_closed_forms_match_brute_force():
    rng = np.random.default_rng(0)
    p = rng.integers(1, 40, 60)
    r = Requests.of(p, rng.integers(1, 60 - p + 1), 100)
    for bs in (1, 3, 7, 16):
        assert paged_waste(r, bs) == pytest.approx(brute_force(r, lambda i, L: -(-L // bs) * bs), rel=1e-12)
    for policy in ("max", "pow2", "oracle"):
        res = contiguous_reservation(r, policy)
        assert contiguous_waste(r, policy) == pytest.approx(brute_force(r, lambda i, L: res[i]), rel=1e-12)
    assert contiguous_reservation(r, "pow2").tolist() == [min(100, 1 << int(np.ceil(np.log2(x))))
                                                          for x in r.peak_lens.tolist()]


def test_paged_wastes_less_than_a_block_per_sequence(sharegpt):
    for bs in (1, 5, 16, 100):
        left = paged_waste_tokens(sharegpt, bs)
        assert left.min() >= 0 and left.max() < bs


def test_paged_waste_grows_with_block_size(sharegpt):
    # A block of 2b slots rounds every length up at least as far as a block of b.
    d = waste_vs_block_size(sharegpt, [1, 2, 4, 8, 16, 32, 64, 128, 256])
    assert d["paged"][0] == 0
    assert all(a <= b for a, b in zip(d["paged"], d["paged"][1:]))
    c = d["contiguous"]
    assert c["oracle"] < c["pow2"] < c["max"]


def test_bad_arguments():
    r = Requests.of([3], [4], 10)
    with pytest.raises(ValueError, match="policy"):
        contiguous_waste(r, "fixed")
    with pytest.raises(ValueError, match="when"):
        paged_waste(r, 4, when="peak")
    with pytest.raises(ValueError, match="block_size"):
        paged_waste(r, 0)


# --- the headline numbers ------------------------------------------------------------------------
@pytest.mark.parametrize("when", ["lifetime", "final"])
def test_vllm_paper_claim_on_sharegpt_like_lengths(sharegpt, when):
    """Contiguous max-length reservation wastes 60-80 %; paging with blocks of up to 16 tokens,
    under 4 % (vLLM paper, Fig. 2)."""
    d = waste_vs_block_size(sharegpt, [8, 16], when=when)
    assert 0.60 <= d["contiguous"]["max"] <= 0.80
    assert all(w < 0.04 for w in d["paged"])


# --- the serving loop ----------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [None, 1, 16, 48])
def test_serving_loop_without_pressure_matches_the_closed_form(block_size):
    r = SHAREGPT_LIKE.sample(300, seed=2)
    trace = simulate_serving(r, 10**8, block_size)
    assert trace.preemptions == 0 and trace.steps == r.output_lens.max()
    expected = contiguous_waste(r) if block_size is None else paged_waste(r, block_size)
    assert trace.waste == pytest.approx(expected, rel=1e-12)


def test_paging_runs_bigger_batches_on_the_same_pool():
    r = SHAREGPT_LIKE.sample(400, seed=3)
    pool = 16 * 2048
    contiguous = simulate_serving(r, pool)
    paged = simulate_serving(r, pool, 16)
    for trace in (contiguous, paged):
        assert trace.running.sum() == r.output_lens.sum()   # one token per running request per step
        assert (trace.reserved <= pool).all() and (trace.used <= trace.reserved).all()
    assert contiguous.running.max() <= 16 and contiguous.preemptions == 0
    assert paged.mean_batch > 2 * contiguous.mean_batch and paged.steps < contiguous.steps
    assert paged.waste < 0.04 < 0.6 < contiguous.waste


def test_serving_loop_preempts_under_pressure():
    r = Requests.of([4] * 6, [12] * 6, 16)
    trace = simulate_serving(r, 32, 4)                      # 8 blocks; 6 requests of up to 4 blocks
    assert trace.preemptions > 0
    assert trace.running.sum() == r.output_lens.sum() and (trace.reserved <= 32).all()
    with pytest.raises(ValueError, match="longest"):
        simulate_serving(r, 12, 4)
    with pytest.raises(ValueError, match="reserves"):
        simulate_serving(r, 12)


# --- sharing: parallel sampling and beam search ---------------------------------------------------
def test_parallel_sampling_hand_computed():
    # Prompt of 5 tokens in blocks of 4: 2 blocks, the second partial, shared by both samples.
    # Step 1 copies it for one sample (3 blocks); step 2 fills the copies' third slot in place.
    t = parallel_sampling_trace(5, [3, 3], block_size=4)
    assert t.unshared.tolist() == [4, 4, 4] and t.shared.tolist() == [2, 3, 3] and t.copies == 1
    assert t.saving == pytest.approx(1 - 8 / 12)
    assert t.peak_saving == pytest.approx(1 - 3 / 4)


def test_parallel_sampling_with_different_lengths():
    t = parallel_sampling_trace(8, [1, 5, 9], block_size=4)
    # The one-token sample is freed after the prefill step; nothing is ever copied (8 = 2 full blocks).
    assert len(t.shared) == 9 and t.copies == 0
    assert t.unshared[0] == 3 * 2 and t.unshared[1] == 2 * 3 and t.unshared[-1] == 1 * 4
    assert (t.shared <= t.unshared).all()


def test_a_single_sequence_saves_nothing():
    assert parallel_sampling_trace(7, [10], 3).saving == 0
    b = beam_search_trace(7, 10, 1, 3)
    assert b.saving == 0 and b.copies == 0


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_beam_search_trace_bounds(block_size):
    t = beam_search_trace(20, 40, 4, block_size, seed=5)
    one_beam = np.asarray([-(-(20 + j) // block_size) for j in range(40)])
    assert (t.shared >= one_beam).all() and (t.shared <= t.unshared).all()
    assert t.unshared.tolist() == (4 * one_beam).tolist()
    assert t.shared[0] == one_beam[0]                        # all beams share the prompt
    if block_size == 1:
        assert t.copies == 0                                 # full blocks are never copied


def test_beams_that_stay_apart_share_less():
    merged = SharingTrace.concat([beam_search_trace(30, 60, 4, 4, seed=s) for s in range(5)])
    apart = SharingTrace.concat([beam_search_trace(30, 60, 4, 4, seed=s, keep_prob=1.0) for s in range(5)])
    assert apart.saving < merged.saving
    # With keep_prob = 1 the beams never merge: only the prompt is shared, plus copies of its tail.
    assert apart.copies == 5 * 3 and apart.shared[-1] == 4 * 23 - 3 * 7


def test_sharing_savings_on_alpaca_like_lengths():
    """The PagedAttention paper (Fig. 15, Alpaca): 6.1-9.8 % for parallel sampling, 37.6-55.2 %
    for beam search, at widths 2-6. The shapes must agree: beams save much more than samples,
    and more with more of them."""
    par = sharing_savings("parallel", [2, 6], ALPACA_LIKE, num_requests=30, seed=0)
    beam = sharing_savings("beam", [2, 6], ALPACA_LIKE, num_requests=30, seed=0)
    assert 0.03 < par["saving"][0] < par["saving"][1] < 0.15
    assert 0.30 < beam["saving"][0] < beam["saving"][1] < 0.75
    assert sharing_savings("beam", [2], ALPACA_LIKE, num_requests=30, seed=0) == {
        **beam, "widths": [2], "saving": beam["saving"][:1], "peak_saving": beam["peak_saving"][:1],
        "copies": beam["copies"][:1]}                        # deterministic, width by width


def test_sharing_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        sharing_savings("greedy", [2], ALPACA_LIKE, num_requests=1)
    with pytest.raises(ValueError, match="keep_prob"):
        beam_search_trace(4, 4, 2, 4, keep_prob=2.0)
    with pytest.raises(ValueError):
        parallel_sampling_trace(0, [3], 4)
    with pytest.raises(ValueError):
        parallel_sampling_trace(3, [], 4)


def test_length_distribution_is_a_value():
    d = LengthDistribution("tiny", 5, 0.5, 5, 0.5, max_len=16)
    r = d.sample(200, seed=0)
    assert (r.prompt_lens + r.output_lens).max() <= 16
