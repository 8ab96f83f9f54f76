"""Graded tests for Chapter 6 (copy-on-write, beam search, prefix caching). Run: `make grade CH=6`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run (the seed is in every
failure message; pin it with ``MINILLM_SEED``).
"""
import bisect
import math

import numpy as np
import pytest
import torch

import minillm.decoding.beams as beams_module
from minillm.decoding import BeamSearchParams, FinishedHypotheses, beam_search
from minillm.decoding.beams import Hypothesis
from minillm.model import LlamaForCausalLM, ModelConfig
from minillm.paged import BlockManager, chain_hash
from minillm.paged.layout import copy_blocks as reference_copy_blocks
from minillm.paged.layout import gather_slots
from minillm.testing import kernel_dtypes, to_numpy

cow_ex = pytest.mark.exercise(id="6.1", title="Fork and copy-on-write bookkeeping", points=3)
beam_ex = pytest.mark.exercise(id="6.2", title="One beam-search step", points=3)
hash_ex = pytest.mark.exercise(id="6.3", title="The prefix hash chain", points=2)
copy_ex = pytest.mark.exercise(id="6.4", title="The copy-on-write block copy kernel", points=2, kind="triton")
gather_ex = pytest.mark.exercise(id="6.5", title="Reading sequences out of the pool: a gather kernel", points=2,
                                 kind="triton")


# --- 6.1 -------------------------------------------------------------------------------------

def assert_same_state(bt, mgr, msg):
    """The exercise's `BlockTables` and the real `BlockManager` hold the same sequences, tables,
    lengths, reference counts and free list (in order)."""
    assert sorted(bt.tables, key=str) == sorted(mgr.seq_ids(), key=str), f"live sequences differ: {msg}"
    for seq in mgr.seq_ids():
        assert bt.tables[seq] == mgr.block_table(seq), f"block table of {seq!r}: {msg}"
        assert bt.lengths[seq] == mgr.num_tokens(seq), f"length of {seq!r}: {msg}"
    assert bt.ref_counts == [mgr.ref_count(b) for b in range(mgr.num_blocks)], f"reference counts: {msg}"
    assert list(bt.free_list) == mgr.free_block_ids(), f"free list (order matters): {msg}"


@cow_ex
def test_fork_append_free_by_hand(impl):
    bt = impl.BlockTables(num_blocks=8, block_size=4)
    bt.add_sequence("a", 6)                                   # blocks 0, 1; block 1 half full
    impl.fork(bt, "a", "b")
    assert bt.tables["b"] == [0, 1] and bt.tables["b"] is not bt.tables["a"], "the child needs its own table"
    assert bt.ref_counts[:2] == [2, 2] and bt.lengths["b"] == 6 and list(bt.free_list) == [2, 3, 4, 5, 6, 7]
    slot, copy = impl.append_slot(bt, "b")                    # shared, partly filled: copy block 1 to 2
    assert copy == (1, 2) and slot == 2 * 4 + 2, "copy-on-write of the shared last block"
    assert bt.tables == {"a": [0, 1], "b": [0, 2]} and bt.ref_counts[:3] == [2, 1, 1]
    slot, copy = impl.append_slot(bt, "a")                    # block 1 is a's alone now: no copy
    assert copy is None and slot == 1 * 4 + 2
    impl.append_slot(bt, "a")                                 # a: 8 tokens, block 1 full
    impl.fork(bt, "a", "c")
    slot, copy = impl.append_slot(bt, "c")                    # full shared block: a new block, no copy
    assert copy is None and slot == 3 * 4 and bt.tables["c"] == [0, 1, 3] and bt.ref_counts[1] == 2
    impl.free(bt, "a")
    assert bt.ref_counts[:4] == [2, 1, 1, 1] and "a" not in bt.tables and "a" not in bt.lengths
    impl.free(bt, "c")                                        # last block first: 3, then 1
    assert list(bt.free_list) == [4, 5, 6, 7, 3, 1] and bt.ref_counts == [1, 0, 1, 0, 0, 0, 0, 0]


@cow_ex
@pytest.mark.parametrize("trial", range(6))
def test_random_operations_match_the_block_manager(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    bs = int(rng.choice([1, 2, 3, 4, 16]))
    num_blocks = int(rng.integers(8, 40))
    bt, mgr = impl.BlockTables(num_blocks, bs), BlockManager(num_blocks, bs, enable_prefix_caching=False)
    live, next_id = [], 0
    for step in range(150):
        msg = f"step {step}, block_size {bs}, {num_blocks} blocks, seed {seed + trial}"
        op = rng.choice(["add", "fork", "append", "append", "append", "free"]) if live else "add"
        if op == "add":
            n = int(rng.integers(1, 3 * bs + 2))
            if -(-n // bs) > mgr.num_free_blocks:
                continue
            mgr.allocate(next_id, rng.integers(0, 1000, n).tolist())
            bt.add_sequence(next_id, n)
            live.append(next_id)
            next_id += 1
        elif op == "fork":
            parent = live[int(rng.integers(len(live)))]
            impl.fork(bt, parent, next_id)
            mgr.fork(parent, next_id)
            live.append(next_id)
            next_id += 1
        elif op == "append":
            seq = live[int(rng.integers(len(live)))]
            if mgr.num_free_blocks == 0:
                continue
            want = mgr.append_slot(seq, int(rng.integers(0, 1000)))
            slot, copy = impl.append_slot(bt, seq)
            assert slot == want.slot, f"slot of the appended token: {msg}"
            assert (copy,) == (want.copies or (None,)), f"the copy-on-write copy: {msg}"
        else:
            seq = live.pop(int(rng.integers(len(live))))
            impl.free(bt, seq)
            mgr.free(seq)
        assert_same_state(bt, mgr, msg)


# --- 6.2 -------------------------------------------------------------------------------------

def reference_step(logprobs, sum_logprobs, k, eos, length_penalty, new_len, at_max_length=False):
    """`minillm.decoding.beams`' own candidate selection (checked against transformers)."""
    params = BeamSearchParams(k, eos_token_ids=tuple(eos))
    cands = beams_module.top_candidates(torch.from_numpy(sum_logprobs), torch.from_numpy(logprobs),
                                         params.num_candidates)
    ends = [at_max_length or t in eos for t in cands.tokens]
    scorer = FinishedHypotheses(k, length_penalty)
    finished = [(cands.parents[r], cands.tokens[r], scorer.score(cands.sum_logprobs[r], new_len))
                for r in range(k) if ends[r]]
    go_on = [] if at_max_length else [r for r, end in enumerate(ends) if not end][:k]
    return ([cands.parents[r] for r in go_on], [cands.tokens[r] for r in go_on],
            cands.sum_logprobs[go_on].numpy(), finished)


def random_step_inputs(rng, k, live, vocab, eos):
    logits = torch.from_numpy(3 * rng.standard_normal((live, vocab)).astype(np.float32))
    for t in eos:  # make eos competitive in some beams, so that some candidates finish
        logits[:, t] += torch.from_numpy(rng.uniform(0, 6, live).astype(np.float32))
    logprobs = torch.log_softmax(logits, dim=-1).numpy()
    sums = (-rng.uniform(0, 20, live)).astype(np.float32) if live > 1 else np.zeros(1, np.float32)
    return logprobs, sums


def assert_same_step(got, want, msg):
    parents, tokens, sums, finished = got
    assert [int(p) for p in parents] == want[0], f"parents of the next beams: {msg}"
    assert [int(t) for t in tokens] == want[1], f"tokens of the next beams: {msg}"
    np.testing.assert_allclose(np.asarray(sums, dtype=np.float64), want[2], rtol=1e-6, atol=1e-6,
                               err_msg=f"summed log-probs of the next beams: {msg}")
    assert [(int(p), int(t)) for p, t, _ in finished] == [(p, t) for p, t, _ in want[3]], \
        f"finished (parent, token), in rank order, top k only: {msg}"
    np.testing.assert_allclose([s for *_, s in finished], [s for *_, s in want[3]], rtol=1e-6,
                               err_msg=f"finished scores: {msg}")


@beam_ex
@pytest.mark.parametrize("trial", range(8))
def test_step_matches_the_reference(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    k = int(rng.integers(1, 6))
    vocab = int(rng.integers(3 * k + 4, 60))
    eos = sorted(rng.choice(vocab, int(rng.integers(0, 3)), replace=False).tolist())
    live = 1 if trial % 3 == 0 else k                               # the first step has one beam
    new_len = int(rng.integers(1, 30))
    length_penalty = float(rng.choice([1.0, 0.0, 2.0, -1.0, 0.5]))
    at_max = trial == 7
    logprobs, sums = random_step_inputs(rng, k, live, vocab, eos)
    msg = f"k={k} live={live} vocab={vocab} eos={eos} lp={length_penalty} new_len={new_len} seed={seed + trial}"
    got = impl.beam_search_step(logprobs, sums, k, eos, length_penalty, new_len, at_max)
    assert_same_step(got, reference_step(logprobs, sums, k, eos, length_penalty, new_len, at_max), msg)


@beam_ex
def test_only_eos_in_the_top_k_finishes(impl):
    """Two beams, vocabulary 6, eos 5. Candidates by total: (0,5) -1.0, (1,2) -1.5, (0,1) -2.0,
    (1,5) -2.5, ...: (0,5) finishes (rank 0 < k), (1,5) ranks 3 >= k and is dropped."""
    logprobs = np.full((2, 6), -30.0, np.float32)
    logprobs[0, [5, 1]] = [-0.5, -1.5]
    logprobs[1, [2, 5]] = [-0.5, -1.5]
    sums = np.array([-0.5, -1.0], np.float32)
    parents, tokens, psums, finished = impl.beam_search_step(logprobs, sums, 2, [5], 1.0, 4)
    assert [(int(p), int(t)) for p, t in zip(parents, tokens)] == [(1, 2), (0, 1)]
    np.testing.assert_allclose(psums, [-1.5, -2.0])
    assert [(int(p), int(t)) for p, t, _ in finished] == [(0, 5)], "an eos candidate ranked below k must be dropped"
    assert finished[0][2] == pytest.approx(-1.0 / 4)
    *_, finished = impl.beam_search_step(logprobs, sums, 2, [5], 2.0, 4, at_max_length=True)
    assert [(int(p), int(t)) for p, t, _ in finished] == [(0, 5), (1, 2)], "at max length the top k all finish"
    assert [s for *_, s in finished] == pytest.approx([-1.0 / 16, -1.5 / 16])


@beam_ex
def test_two_eos_ids_keep_three_k_candidates(impl):
    """k = 2, eos 4 and 5, which take the top four places: with K = max(2, 1 + 2) · k = 6
    candidates, two that do not end are still there to continue."""
    logprobs = np.full((2, 8), -30.0, np.float32)
    logprobs[0, [5, 4, 1]] = [-0.1, -0.2, -3.0]
    logprobs[1, [5, 4, 2]] = [-0.1, -0.2, -3.5]
    sums = np.array([0.0, -0.05], np.float32)
    parents, tokens, _, finished = impl.beam_search_step(logprobs, sums, 2, [4, 5], 1.0, 3)
    assert [(int(p), int(t)) for p, t in zip(parents, tokens)] == [(0, 1), (1, 2)], \
        "with two eos ids, keep 3k candidates so that k of them can continue"
    assert [(int(p), int(t)) for p, t, _ in finished] == [(0, 5), (1, 5)]


EOS, VOCAB = 3, 64


def tiny_model(seed):
    """A tiny random Llama whose eos token is often likely (its output embedding points along
    the mean final hidden state), so that beams finish early."""
    config = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name or "lm_head" in name:
                p.normal_(0, 0.5)
        hidden = []
        hook = model.lm_head.register_forward_hook(lambda mod, args, out: hidden.append(args[0]))
        logits = model(torch.randint(0, VOCAB, (4, 10), generator=torch.Generator().manual_seed(seed)))
        hook.remove()
        mean = hidden[0].reshape(-1, config.hidden_size).mean(0)
        model.lm_head.weight[EOS] = mean / (mean @ mean) * logits.max(-1).values.mean()
    return model


class ScoredHypotheses(FinishedHypotheses):
    """Keeps hypotheses with the scores the exercise computed."""

    def add_scored(self, token_ids, score):
        at = bisect.bisect_right([-h.score for h in self._hyps], -float(score))
        self._hyps.insert(at, Hypothesis(tuple(token_ids), float(score)))
        del self._hyps[self.num_beams:]


@torch.no_grad()
def search_with(step, model, prompt, params):
    """A whole beam search in which ``step`` picks the candidates (no cache: every beam's
    logits come from a forward over its whole sequence)."""
    finished = ScoredHypotheses(params.num_beams, params.length_penalty)
    beams, sums = [()], np.zeros(1, np.float32)
    for i in range(params.max_new_tokens):
        logits = torch.stack([model(torch.tensor([list(prompt) + list(b)]))[0, -1] for b in beams])
        logprobs = torch.log_softmax(logits.float(), dim=-1).numpy()
        at_max = i + 1 == params.max_new_tokens
        parents, tokens, new_sums, done = step(logprobs, sums, params.num_beams, list(params.eos_token_ids),
                                               params.length_penalty, i + 1, at_max)
        for parent, token, score in done:
            finished.add_scored(beams[int(parent)] + (int(token),), score)
        if at_max or beams_module.search_is_over(finished, torch.tensor(np.float32(new_sums[0])), i + 1, params):
            break
        beams = [beams[int(p)] + (int(t),) for p, t in zip(parents, tokens)]
        sums = np.asarray(new_sums, np.float32)
    return finished.best(params.num_return_sequences)


@beam_ex
@pytest.mark.parametrize("model_seed, k, length_penalty, early_stopping",
                         [(0, 2, 1.0, False), (1, 3, 2.0, "never"), (2, 4, 0.5, True), (3, 4, -1.0, False)])
def test_your_step_drives_a_whole_search(impl, model_seed, k, length_penalty, early_stopping):
    """Iterated, your step reproduces `minillm.decoding.beam_search` (which matches
    transformers' ``generate(num_beams=k)``): the same hypotheses with the same scores."""
    model = tiny_model(model_seed)
    prompt = torch.randint(4, VOCAB, (6,), generator=torch.Generator().manual_seed(model_seed)).tolist()
    params = BeamSearchParams(k, 8, length_penalty, early_stopping, num_return_sequences=k, eos_token_ids=(EOS,))
    got = search_with(impl.beam_search_step, model, prompt, params)
    want = beam_search(model, prompt, params, block_size=4).hypotheses
    assert [h.token_ids for h in got] == [h.token_ids for h in want], f"model seed {model_seed}, k={k}"
    np.testing.assert_allclose([h.score for h in got], [h.score for h in want], rtol=1e-5)


# --- 6.3 -------------------------------------------------------------------------------------

@hash_ex
@pytest.mark.parametrize("trial", range(4))
def test_chain_hash_is_the_book_s(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    tokens = rng.integers(0, 2**31 - 1, int(rng.integers(1, 40))).tolist()
    parent = None if trial == 0 else bytes(rng.integers(0, 256, 16, dtype=np.uint8))
    got = impl.chain_hash(parent, tokens)
    assert isinstance(got, bytes) and len(got) == 16, "a 16-byte digest"
    assert got == chain_hash(parent, tokens), f"trial {trial}, seed {seed + trial}"


@hash_ex
@pytest.mark.parametrize("trial", range(4))
def test_block_keys_chain_full_blocks_only(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    bs = int(rng.integers(1, 9))
    tokens = rng.integers(0, 5000, int(rng.integers(0, 6 * bs))).tolist()
    keys = impl.block_keys(tokens, bs)
    assert len(keys) == len(tokens) // bs, "one key per FULL block"
    parent = None
    for i, key in enumerate(keys):
        parent = chain_hash(parent, tokens[i * bs:(i + 1) * bs])
        assert key == parent, f"block {i}: chain_hash(key of block {i - 1}, its tokens); seed {seed + trial}"
    # a key depends on everything before its block
    if len(keys) >= 2:
        changed = list(tokens)
        changed[0] += 1
        assert all(a != b for a, b in zip(impl.block_keys(changed, bs), keys))


def cache_dict(mgr):
    """The prefix cache of a `BlockManager` as the exercise's ``{key: (parent_key, tokens)}``."""
    out = {}
    for key, block_id in mgr.prefix_cache_entries().items():
        block = mgr.block(block_id)
        out[key] = (block.parent.hash if block.parent is not None else None, block.token_ids)
    return out


def colliding_hash(parent, tokens):
    """A 1-byte hash: collisions everywhere, only the tokens tell blocks apart."""
    return bytes([(sum(tokens) + (parent[0] if parent else 7)) % 5])


def chainless_hash(parent, tokens):
    """A hash that forgets the chain: the same block after a different prefix gets the same
    key, and only the parent check tells them apart."""
    return bytes([sum(tokens) % 7])


HASHES = {"blake2b": None, "colliding-hash": colliding_hash, "chainless-hash": chainless_hash}


@hash_ex
@pytest.mark.parametrize("hash_name", list(HASHES))
def test_cached_prefix_matches_the_block_manager(impl, hash_name, seed):
    rng = np.random.default_rng(seed)
    bs = int(rng.integers(1, 5))
    hash_fn = HASHES[hash_name]
    mgr = BlockManager(400, bs, enable_prefix_caching=True, **({"hash_fn": hash_fn} if hash_fn else {}))
    stems = [rng.integers(0, 4, int(rng.integers(0, 4 * bs))).tolist() for _ in range(4)]  # shared beginnings
    live, first = [], None
    for i in range(60):
        prompt = list(stems[int(rng.integers(len(stems)))]) + rng.integers(0, 4, int(rng.integers(1, 3 * bs))).tolist()
        if i == 0:  # at least one full block and one token more, so that request 1 (the same prompt) must hit
            first = prompt = prompt + rng.integers(0, 4, max(0, bs + 1 - len(prompt))).tolist()
        elif i == 1:
            prompt = first
        got = impl.cached_prefix_tokens(prompt, cache_dict(mgr), bs, hash_fn)
        want = mgr.allocate(i, prompt)
        assert got == want, f"prompt {prompt} (block size {bs}, request {i}, seed {seed})"
        live.append(i)
        if rng.random() < 0.4:
            mgr.free(live.pop(int(rng.integers(len(live)))))
    assert mgr.stats.cached_prompt_tokens > 0


@hash_ex
def test_a_fully_cached_prompt_still_computes_its_last_token(impl):
    tokens = list(range(12))
    cache, parent = {}, None
    for i in range(3):
        key = chain_hash(parent, tokens[4 * i:4 * i + 4])
        cache[key] = (parent, tuple(tokens[4 * i:4 * i + 4]))
        parent = key
    assert impl.cached_prefix_tokens(tokens, cache, 4) == 8, "12 tokens, all cached: the last block is computed"
    assert impl.cached_prefix_tokens(tokens + [99], cache, 4) == 12
    assert impl.cached_prefix_tokens(tokens[:9], cache, 4) == 8
    assert impl.cached_prefix_tokens([5] + tokens[1:], cache, 4) == 0, "the first block differs: no hit at all"


# --- 6.4 and 6.5: the Triton kernels -------------------------------------------------------------

def pick_dtype(device, seed):
    dtypes = kernel_dtypes(device)
    return dtypes[seed % len(dtypes)]


@copy_ex
@pytest.mark.parametrize("layers,num_blocks,block_size,kv_heads,head_dim,n_pairs", [
    (2, 10, 4, 2, 16, 3),        # 128 elements per block: less than one chunk
    (1, 8, 17, 3, 12, 2),        # 612: three chunks of 256, the last one ragged
    (3, 12, 1, 1, 8, 5),         # block size 1
    (2, 9, 16, 2, 16, 4),        # 512: exactly two chunks
])
def test_copy_blocks_kernel(impl, layers, num_blocks, block_size, kv_heads, head_dim, n_pairs, device, seed):
    """Random pairs (a source may be copied twice: two forks of one parent); the whole pool is
    compared exactly, so every plane (K and V of every layer) must be copied and every other
    block left alone. The pool lies inside a larger buffer, with a margin of 1024 elements on
    either side: a copy that strays past the pool lands there and is caught."""
    rng = np.random.default_rng(seed)
    dtype = pick_dtype(device, seed)
    shape, margin = (2, layers, num_blocks, block_size, kv_heads, head_dim), 1024
    buf = torch.from_numpy(rng.standard_normal(math.prod(shape) + 2 * margin)).to(device=device, dtype=dtype)
    pool = buf[margin:-margin].view(shape)
    blocks = rng.permutation(num_blocks)
    pairs = [(int(s), int(d)) for s, d in zip(rng.choice(blocks[n_pairs:], n_pairs), blocks[:n_pairs])]
    want_buf = to_numpy(buf)
    want = want_buf[margin:-margin].reshape(shape)
    reference_copy_blocks([np.moveaxis(want, 2, 0)], pairs)
    impl.copy_blocks(pool, pairs)
    got_buf = to_numpy(buf)
    got = got_buf[margin:-margin].reshape(shape)
    what = f"pairs {pairs}, pool {list(shape)} {dtype}, seed {seed}"
    for plane in np.ndindex(2, layers):
        for src, dst in pairs:
            assert np.array_equal(got[plane][dst], want[plane][dst]), \
                f"block {dst} of (K/V {plane[0]}, layer {plane[1]}) is not a copy of block {src}: {what}"
    assert np.array_equal(got, want), f"a block that is not a destination changed: {what}"
    assert np.array_equal(got_buf, want_buf), f"memory outside the pool was written: {what}"


@copy_ex
def test_copy_blocks_kernel_after_forks(impl, device, seed):
    """The copies a `BlockManager` asks for when four forks of one sequence append a token."""
    rng = np.random.default_rng(seed)
    mgr = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=False)
    mgr.allocate("p", list(range(10)))
    for child in "abc":
        mgr.fork("p", child)
    copies = [c for seq in "pabc" for c in mgr.append_slots([seq], [7]).copies]
    pool = torch.from_numpy(rng.standard_normal((2, 2, 12, 4, 2, 16))).to(device=device, dtype=torch.float32)
    want = to_numpy(pool)
    reference_copy_blocks([np.moveaxis(want, 2, 0)], copies)
    impl.copy_blocks(pool, copies)
    assert np.array_equal(to_numpy(pool), want), f"copies {copies}, seed {seed}"


def shared_pool(rng, seq_lens, block_size, kv_heads, head_dim, share):
    """A float64 pool with ``len(seq_lens)`` sequences in shuffled blocks (NaN where no token
    is), sequence 1 sharing the first ``share`` blocks of sequence 0 (a fork or a cached
    prefix); block tables padded with -1."""
    tables, used = [], []
    free = list(rng.permutation(sum(-(-n // block_size) for n in seq_lens) + 3))
    for b, n in enumerate(seq_lens):
        need = -(-n // block_size)
        own = tables[0][:share] if b == 1 and share else []
        tables.append(own + [int(free.pop()) for _ in range(need - len(own))])
    num_blocks = max(max(t, default=0) for t in tables) + 2
    cache = np.full((num_blocks, block_size, kv_heads, head_dim), np.nan)
    for b, n in enumerate(seq_lens):
        for p in range(n):
            blk, off = tables[b][p // block_size], p % block_size
            if np.isnan(cache[blk, off]).all():
                cache[blk, off] = rng.standard_normal((kv_heads, head_dim))
    width = max(len(t) for t in tables) + 2
    padded = np.full((len(seq_lens), width), -1, dtype=np.int32)
    for b, t in enumerate(tables):
        padded[b, :len(t)] = t
    return cache, padded


@gather_ex
@pytest.mark.parametrize("seq_lens,block_size,kv_heads,head_dim,share", [
    ([37, 16], 16, 2, 16, 0),
    ([23, 30, 0, 5], 7, 3, 8, 2),           # shared blocks, an empty sequence, 24-element rows (padded to 32)
    ([9, 40], 1, 1, 16, 4),                 # block size 1
    ([50, 17], 5, 2, 12, 3),
])
def test_gather_kernel(impl, seq_lens, block_size, kv_heads, head_dim, share, device, seed):
    rng = np.random.default_rng(seed)
    dtype = pick_dtype(device, seed)
    cache_np, tables = shared_pool(rng, seq_lens, block_size, kv_heads, head_dim, share)
    # One NaN guard block in front of the pool, which is a view past it.
    big = torch.from_numpy(np.concatenate([np.full_like(cache_np[:1], np.nan), cache_np])).to(device, dtype)
    cache = big[1:]
    lens_arg = seq_lens if seed % 2 else torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out, cu = impl.gather_sequences(cache, torch.from_numpy(tables).to(device), lens_arg)
    what = f"seq_lens={seq_lens} block_size={block_size} kv_heads={kv_heads} head_dim={head_dim}, seed {seed}"
    assert out.shape == (sum(seq_lens), kv_heads, head_dim), what
    assert cu.tolist() == [0, *np.cumsum(seq_lens).tolist()], what
    rounded = to_numpy(cache)
    got = to_numpy(out)
    assert not np.isnan(got).any(), f"NaN in the output: a row left unwritten or read from an empty slot ({what})"
    starts = cu.tolist()
    for b, n in enumerate(seq_lens):
        want = gather_slots(rounded, tables[b], n)
        assert np.array_equal(got[starts[b]:starts[b + 1]], want), f"sequence {b} (length {n}): {what}"
