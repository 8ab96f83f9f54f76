"""Graded tests for Chapter 9 (the engine). Run: `make grade CH=9`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run (the seed is in every
failure message; pin it with ``MINILLM_SEED``). The oracles are the engine's own parts: the
`Scheduler` for 9.1, `BlockManager.can_allocate` for 9.2, the sampler for 9.3.
"""
import numpy as np
import pytest
import torch

from minillm.decoding.sampling import SamplingParams, top_p_filter, sample_token
from minillm.engine.detokenizer import Detokenizer
from minillm.engine.request import Request, RequestStatus, Sequence
from minillm.engine.scheduler import Scheduler
from minillm.paged import Admission, BlockManager, OutOfBlocks, blocks_for, chain_hash

schedule_ex = pytest.mark.exercise(id="9.1", title="One scheduling step: budget, chunks, preemption, FCFS", points=4)
admission_ex = pytest.mark.exercise(id="9.2", title="Admission with prefix hits: now, later or never", points=2)
top_p_ex = pytest.mark.exercise(id="9.3", title="Top-p (nucleus) filter and sampling", points=2)


# --- 9.1 -------------------------------------------------------------------------------------

class _NoText:
    """A tokenizer stand-in: the scheduler never looks at text."""

    def decode(self, ids, skip_special_tokens=True):
        return ""


def engine_schedule(running, waiting, budget, max_seqs, free_blocks, bs):
    """The same state in the book's `Scheduler` over a `BlockManager` (prefix caching off):
    returns ``([(request_id, tokens), ...], [preempted ids])`` of one ``schedule()``."""
    held = sum(blocks_for(r.num_computed, bs) for r in running)
    mgr = BlockManager(held + free_blocks, bs, enable_prefix_caching=False)
    sched = Scheduler(mgr, max_seqs, budget)
    params = SamplingParams(temperature=0, max_tokens=1)
    for r in sorted([*running, *waiting], key=lambda r: r.arrival):
        tokens = list(range(r.num_tokens))
        req = Request(r.request_id, None, tokens, params, r.arrival, 0, ())
        seq = Sequence(r.request_id, 0, list(tokens), len(tokens), None, Detokenizer(_NoText(), tokens))
        req.seqs = [seq]
        if r in running:
            mgr.allocate(r.request_id, tokens[:r.num_computed])
            seq.num_computed = r.num_computed
            req.status = RequestStatus.RUNNING
            sched.running.append(req)
        else:
            sched.add(req)
    assert mgr.num_free_blocks == free_blocks
    out = sched.schedule()
    return ([(o.request_id, n) for o, n in zip(out.owners, out.num_new_tokens)],
            [r.request_id for r in out.preempted])


def random_state(impl, rng):
    bs = int(rng.integers(1, 9))
    max_seqs = int(rng.integers(1, 9))
    budget = max_seqs + int(rng.choice([0, 1, 3, 8, 20, 64, 200]))
    num_running = int(rng.integers(0, max_seqs + 1))
    num_waiting = int(rng.integers(0, 7))
    arrivals = rng.permutation(100)[:num_running + num_waiting].tolist()   # waiting can be older (preempted)
    running = []
    for i in range(num_running):
        n = int(rng.integers(2, 80))
        computed = n - 1 if rng.random() < 0.6 else int(rng.integers(1, n))   # decoding, or prefilling in chunks
        running.append(impl.Req(f"r{i}", arrivals[i], n, computed))
    free = int(rng.choice([0, 0, 1, 2, 3, 5, 10, 40]))
    held = sum(blocks_for(r.num_computed, bs) for r in running)
    free = max(free, 1 - held)                                            # a pool has at least one block
    waiting = [impl.Req(f"w{i}", arrivals[num_running + i], min(int(rng.integers(1, 120)), (held + free) * bs), 0)
               for i in range(num_waiting)]
    return running, waiting, budget, max_seqs, free, bs


def check_properties(impl, got, running, waiting, budget, max_seqs, msg):
    assert isinstance(got, impl.Schedule), f"return a Schedule, got {type(got).__name__}"
    ids = [i for i, _ in got.scheduled]
    assert len(set(ids)) == len(ids), f"a request is scheduled twice: {got.scheduled} {msg}"
    assert not set(ids) & set(got.preempted), f"a preempted request cannot run: {got} {msg}"
    total = sum(n for _, n in got.scheduled)
    assert total <= budget, f"{total} tokens scheduled, over the budget of {budget} {msg}"
    assert all(n >= 1 for _, n in got.scheduled), f"a scheduled request computes at least one token {msg}"
    by_id = {r.request_id: r for r in [*running, *waiting]}
    for i, n in got.scheduled:
        r = by_id[i]
        assert n <= r.num_tokens - r.num_computed, f"{i} gets {n} tokens but has only " \
            f"{r.num_tokens - r.num_computed} to compute {msg}"
    run_ids = [i for i in ids if i.startswith("r")]
    adm_ids = [i for i in ids if i.startswith("w")]
    assert ids == run_ids + adm_ids, f"running requests first, then admitted ones: {ids} {msg}"
    arrival = {r.request_id: r.arrival for r in [*running, *waiting]}
    assert run_ids == sorted(run_ids, key=arrival.get), f"running requests run oldest first: {run_ids} {msg}"
    fcfs = [r.request_id for r in sorted(waiting, key=lambda r: r.arrival)]
    assert adm_ids == fcfs[:len(adm_ids)], \
        f"waiting requests are admitted first come, first served, none overtaking: {adm_ids}, queue {fcfs} {msg}"
    alive = len(running) - len(got.preempted)
    assert alive + len(adm_ids) <= max_seqs, f"more than max_num_seqs={max_seqs} requests running {msg}"
    if got.preempted:
        assert not adm_ids, f"nothing is admitted in a step that preempted {msg}"


@schedule_ex
@pytest.mark.parametrize("trial", range(6))
def test_schedule_matches_the_engine(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    kinds = {"preempted": 0, "admitted": 0, "chunked": 0}
    for case in range(150):
        running, waiting, budget, max_seqs, free, bs = random_state(impl, rng)
        before = (list(running), list(waiting))
        msg = (f"(running {running}, waiting {waiting}, token_budget={budget}, max_num_seqs={max_seqs}, "
               f"free_blocks={free}, block_size={bs}; seed {seed + trial}, case {case})")
        got = impl.schedule_step(list(running), list(waiting), budget, max_seqs, free, bs)
        assert (running, waiting) == before, "schedule_step must not change its inputs"
        check_properties(impl, got, running, waiting, budget, max_seqs, msg)
        want, preempted = engine_schedule(running, waiting, budget, max_seqs, free, bs)
        assert list(got.preempted) == preempted, f"preempted {got.preempted}, the engine preempts {preempted} {msg}"
        assert [tuple(s) for s in got.scheduled] == want, \
            f"scheduled {got.scheduled}, the engine schedules {want} {msg}"
        kinds["preempted"] += bool(preempted)
        kinds["admitted"] += any(i.startswith("w") for i, _ in want)
        kinds["chunked"] += any(n < r.num_tokens - r.num_computed for i, n in want
                                for r in [*running, *waiting] if r.request_id == i)
    assert all(kinds.values()), f"the random cases should cover every rule: {kinds}"


def R(impl, request_id, arrival, num_tokens, num_computed=0):
    return impl.Req(request_id, arrival, num_tokens, num_computed)


@schedule_ex
def test_decodes_then_a_chunk_of_the_prompt(impl):
    """A decodes (1 token), B is prefilling (100 tokens left) and gets what the budget leaves;
    C waits: no budget is left for it."""
    running = [R(impl, "rB", 1, 120, 20), R(impl, "rA", 0, 31, 30)]
    waiting = [R(impl, "wC", 2, 5)]
    got = impl.schedule_step(running, waiting, 20, 4, 100, 16)
    assert [tuple(s) for s in got.scheduled] == [("rA", 1), ("rB", 19)] and not got.preempted
    got = impl.schedule_step(running, waiting, 200, 4, 100, 16)
    assert [tuple(s) for s in got.scheduled] == [("rA", 1), ("rB", 100), ("wC", 5)], \
        "with budget to spare, B finishes its prompt and C is admitted with its whole prompt"
    got = impl.schedule_step(running, waiting, 105, 4, 100, 16)
    assert [tuple(s) for s in got.scheduled] == [("rA", 1), ("rB", 100), ("wC", 4)], \
        "C's prompt is chunked too: it gets the 4 tokens of budget left"


@schedule_ex
def test_head_of_line_blocking(impl):
    """The oldest waiting request needs 3 blocks and only 2 are free: it waits, and the small
    request behind it, which would fit, must not overtake it."""
    got = impl.schedule_step([], [R(impl, "wSmall", 5, 4), R(impl, "wBig", 3, 40)], 64, 4, 2, 16)
    assert list(got.scheduled) == [] and not got.preempted, "no overtaking: the small request waits too"
    got = impl.schedule_step([], [R(impl, "wSmall", 5, 4), R(impl, "wBig", 3, 40)], 64, 4, 3, 16)
    assert [tuple(s) for s in got.scheduled] == [("wBig", 40)], \
        "the big (older) request is admitted first; after it, no block is left for the small one"
    running = [R(impl, "r0", 0, 9, 8), R(impl, "r1", 1, 9, 8)]
    got = impl.schedule_step(running, [R(impl, "w0", 2, 3), R(impl, "w1", 4, 3)], 64, 3, 10, 16)
    assert [tuple(s) for s in got.scheduled] == [("r0", 1), ("r1", 1), ("w0", 3)], \
        "max_num_seqs = 3: two running, one admitted"


@schedule_ex
def test_preemption_takes_the_newest(impl):
    """Three decoding requests, each at a block boundary (each needs a new block), one free
    block: A takes it; B needs one, so C (the newest) is preempted and its 2 blocks serve B.
    Nothing is admitted in a step that preempted."""
    running = [R(impl, "rC", 2, 33, 32), R(impl, "rA", 0, 17, 16), R(impl, "rB", 1, 17, 16)]
    got = impl.schedule_step(running, [R(impl, "wD", 3, 2)], 64, 4, 1, 16)
    assert list(got.preempted) == ["rC"], "the newest running request is the victim"
    assert [tuple(s) for s in got.scheduled] == [("rA", 1), ("rB", 1)]
    alone = impl.schedule_step([R(impl, "rA", 0, 17, 16)], [], 64, 4, 0, 16)
    assert list(alone.preempted) == ["rA"] and list(alone.scheduled) == [], \
        "with nobody else to preempt, a request that cannot get its block preempts itself"


# --- 9.2 -------------------------------------------------------------------------------------

def hit_ref_counts(mgr, tokens):
    """Reference counts of the prefix-cache hits of ``tokens``, read through public methods."""
    bs = mgr.block_size
    num_hits = mgr.num_cached_prefix_tokens(tokens) // bs
    entries, key, refs = mgr.prefix_cache_entries(), None, []
    for i in range(num_hits):
        key = chain_hash(key, tokens[i * bs:(i + 1) * bs])
        refs.append(mgr.ref_count(entries[key]))
    return refs


def ask(impl, mgr, tokens):
    return impl.admission(len(tokens), mgr.block_size, mgr.num_blocks, mgr.num_free_blocks, mgr.num_cached_blocks,
                          hit_ref_counts(mgr, tokens))


@admission_ex
@pytest.mark.parametrize("trial", range(4))
def test_admission_matches_the_block_manager(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    seen = set()
    for scenario in range(12):
        bs = int(rng.integers(1, 6))
        mgr = BlockManager(int(rng.integers(3, 30)), bs)
        stems = [rng.integers(0, 3, int(rng.integers(1, 5 * bs))).tolist() for _ in range(3)]
        live = []

        def prompt(long=False):
            extra = rng.integers(0, 3, int(rng.integers(0, 3 * bs))).tolist()
            p = stems[int(rng.integers(len(stems)))] + extra
            return p * int(rng.integers(2, 8)) if long else p

        for step in range(40):
            tokens = prompt(long=rng.random() < 0.15)
            msg = (f"(prompt of {len(tokens)} tokens, block size {bs}, pool {mgr.num_blocks}, free "
                   f"{mgr.num_free_blocks}, evictable {mgr.num_cached_blocks}, hits {hit_ref_counts(mgr, tokens)}; "
                   f"seed {seed + trial}, scenario {scenario}, step {step})")
            got, want = ask(impl, mgr, tokens), mgr.can_allocate(tokens)
            assert got == want, f"{got} but the block manager says {want} {msg}"
            seen.add(want)
            if want is Admission.FITS_NOW and rng.random() < 0.7:
                mgr.allocate((scenario, step), tokens)
                live.append((scenario, step))
            if live and rng.random() < 0.45:
                mgr.free(live.pop(int(rng.integers(len(live)))))
    assert seen == set(Admission), f"the scenarios should reach every answer, got {seen}"


@admission_ex
def test_a_revived_hit_is_no_longer_available(impl):
    """Pool of 4 blocks of 2. A 4-token prompt is cached and freed (2 evictable blocks); another
    sequence takes 1 free block. A 6-token prompt with the same start hits both evictable
    blocks and needs 1 fresh block: 1 free, FITS_NOW. An 8-token one needs 2 fresh blocks, and
    only 1 is left once its 2 hits are revived: FITS_LATER (counting the hits as available
    too would say FITS_NOW, and allocate would fail)."""
    mgr = BlockManager(4, 2)
    mgr.allocate("a", [1, 2, 3, 4])
    mgr.free("a")
    mgr.allocate("b", [9, 9])
    assert (mgr.num_free_blocks, mgr.num_cached_blocks) == (1, 2)
    assert ask(impl, mgr, [1, 2, 3, 4, 5, 6]) is Admission.FITS_NOW, "2 evictable hits + 1 fresh block of 1 free"
    assert ask(impl, mgr, [1, 2, 3, 4, 5, 6, 7, 8]) is Admission.FITS_LATER, \
        "2 fresh blocks needed; the 2 evictable hits are revived, so only the 1 free block is available"
    with pytest.raises(OutOfBlocks):
        mgr.allocate("c", [1, 2, 3, 4, 5, 6, 7, 8])
    assert ask(impl, mgr, list(range(20, 29))) is Admission.NEVER_FITS, "9 tokens need 5 blocks of 2: never"
    assert impl.admission(9, 2, 4, 4, 0, []) is Admission.NEVER_FITS
    assert impl.admission(8, 2, 4, 0, 0, [3, 1, 2, 1]) is Admission.FITS_NOW, "every block is a shared hit"
    assert impl.admission(8, 2, 4, 0, 1, [1, 1, 0]) is Admission.FITS_LATER


# --- 9.3 -------------------------------------------------------------------------------------

def away_from_boundaries(logits, top_p, margin=1e-4):
    """``top_p`` moved off the cumulative masses of ``logits`` (float rounding would decide
    tokens that sit exactly on the boundary)."""
    probs = np.sort(torch.softmax(logits.double(), -1).numpy())[::-1]
    before = np.cumsum(probs) - probs
    while np.any(np.abs(before - top_p) < margin):
        top_p = min(1.0, top_p + 3 * margin) if top_p < 0.99 else top_p - 3 * margin
    return top_p


def kept(filtered):
    return torch.isfinite(filtered).nonzero().flatten().tolist()


@top_p_ex
@pytest.mark.parametrize("trial", range(4))
def test_filter_matches_the_book(impl, trial, seed):
    gen = torch.Generator().manual_seed(seed + trial)
    rng = np.random.default_rng(seed + trial)
    for case in range(40):
        vocab = int(rng.integers(2, 300))
        logits = torch.randn(vocab, generator=gen) * float(rng.choice([0.3, 1.0, 3.0, 8.0]))
        top_p = away_from_boundaries(logits, float(rng.uniform(0.01, 0.99)))
        before = logits.clone()
        got = impl.top_p_filter(logits, top_p)
        assert torch.equal(logits, before), "top_p_filter must not change its input"
        want = top_p_filter(logits, top_p)
        msg = f"(vocab {vocab}, top_p {top_p:.4f}, seed {seed + trial}, case {case})"
        assert kept(got) == kept(want), f"kept {kept(got)}, the book keeps {kept(want)} {msg}"
        assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(want)]), f"kept logits change {msg}"
        assert bool((got[~torch.isfinite(want)] == -torch.inf).all()), f"dropped tokens must be -inf {msg}"


@top_p_ex
def test_the_most_likely_token_always_stays(impl, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(20):
        logits = torch.randn(50, generator=gen) * 4
        for top_p in (1e-9, 1e-3):
            assert kept(impl.top_p_filter(logits, top_p)) == [int(logits.argmax())], \
                f"top_p={top_p}: only the argmax is kept, and it is kept (seed {seed})"
    peaked = torch.tensor([0.0, 10.0, 0.0, 1.0])
    assert kept(impl.top_p_filter(peaked, 0.9)) == [1], "p(token 1) > 0.9: the nucleus is token 1 alone"


@top_p_ex
def test_ties_go_to_the_smaller_token_id(impl):
    """Four equal logits: probabilities 1/4 each, exactly. top_p = 0.5 keeps two of them (the
    mass above the third is exactly 0.5, which reaches top_p): tokens 0 and 1."""
    four = torch.zeros(4)
    assert kept(impl.top_p_filter(four, 0.5)) == [0, 1]
    assert kept(impl.top_p_filter(four, 0.6)) == [0, 1, 2]
    assert kept(impl.top_p_filter(four, 0.25)) == [0]
    assert kept(impl.top_p_filter(four, 0.2500001)) == [0, 1]
    tied = torch.tensor([0.0, 5.0, 1.0, 5.0, 5.0, -2.0])    # three tied leaders, about 1/3 each
    got = kept(impl.top_p_filter(tied, 0.5))
    assert got == [1, 3], f"ties ranked by token id: keep 1 and 3, drop 4; got {got}"
    assert len(got) == len(kept(top_p_filter(tied, 0.5))), "as many tokens as the book keeps"


@top_p_ex
@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 1.7])
def test_sampling_matches_sample_token(impl, temperature, seed):
    """Same logits, same generator seed: the same tokens as the engine's `sample_token`."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    for case in range(12):
        logits = torch.randn(int(rng.integers(2, 200)), generator=gen) * 3
        top_p = 1.0 if case % 4 == 0 else float(rng.uniform(0.05, 0.98))
        if temperature > 0 and top_p < 1:
            top_p = away_from_boundaries(logits / temperature, top_p)
        params = SamplingParams(temperature=temperature, top_p=top_p)
        ours, book = torch.Generator().manual_seed(seed + case), torch.Generator().manual_seed(seed + case)
        got = [impl.sample_top_p(logits, temperature, top_p, ours) for _ in range(25)]
        want = [sample_token(logits, params, book) for _ in range(25)]
        assert all(isinstance(t, int) for t in got), "return plain ints"
        assert got == want, f"temperature {temperature}, top_p {top_p:.4f}, seed {seed + case}: {got} vs {want}"
        if top_p < 1 and temperature > 0:
            nucleus = set(kept(top_p_filter(logits / temperature, top_p)))
            assert set(got) <= nucleus, "every draw comes from the nucleus"
