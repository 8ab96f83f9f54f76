"""Chapter 10's host-overhead benchmark on tiny sizes (a smoke test: no timing is asserted), and
the bookkeeping that keeps the engine's step cheap on the host: the scheduler's one-call path
for a step where every running sequence decodes, the gathered step inputs, and the virtual
manager's running page count, each against the slower definition it replaces."""
import random

import pytest
import torch

from bench import ch10_host_overhead as b
from minillm.experiments import ch10_host_overhead as hx
from bench.common import Results
from minillm.engine.scheduler import Scheduler
from minillm.model.paged import PagedBatch
from minillm.paged import BlockManager
from minillm.kernels.base import interpreting


def test_benchmark_runs_on_tiny_sizes():
    for mode in hx.MODES:
        assert hx.host_step_ms(mode, num_seqs=4, prompt_len=20, steps=3, warmup=1) > 0
    assert "function calls" in hx.profile_steps("paged", num_seqs=2, prompt_len=8, steps=2, top=5)


def test_run_records_both_modes(monkeypatch):
    monkeypatch.setattr(b, "NUM_SEQS", 3)
    monkeypatch.setattr(b, "PROMPT_LEN", 10)
    monkeypatch.setattr(b, "STEPS", 2)
    res = Results("cpu-test", env={})
    b.run(res)
    rows = [r for r in res.rows if r["metric"] == "host_step_ms"]
    assert [r["params"]["kv_cache"] for r in rows] == ["paged", "virtual"]
    assert rows[1]["peer"] == "paged" and rows[1]["peer_value"] == rows[0]["ours"]
    assert "ms of host time" in b.summary(res)


def test_free_runner_keeps_the_engine_outputs_consistent():
    """Every request decodes one token per step, from the runner's fixed argmax row."""
    engine = hx.decoding_engine("paged", num_seqs=3, prompt_len=5, steps=4)
    before = {r.request_id: len(r.seqs[0].token_ids) for r in engine.scheduler.running}
    hx.time_steps(engine, 4)
    for r in engine.scheduler.running:
        row = engine.scheduler.running.index(r)
        assert len(r.seqs[0].token_ids) == before[r.request_id] + 4
        assert r.seqs[0].token_ids[-1] == int(engine.runner.argmax[row])


class _Seq:
    def __init__(self, seq_id, tokens, computed):
        self.seq_id, self.token_ids, self.num_computed = seq_id, tokens, computed

    @property
    def num_uncomputed(self):
        return len(self.token_ids) - self.num_computed


class _Req:
    def __init__(self, arrival, seqs):
        self.arrival_index, self.seqs = arrival, seqs
        self.num_cached_tokens, self.num_preemptions = 0, 0

    @property
    def num_seqs(self):
        return len(self.seqs)


def _running(manager, rng, num_requests=6, block_size=4, shared_prefix=False):
    """Running requests of one or two sequences (forks share blocks), each with one new token."""
    requests, next_id = [], 0
    prefix = [rng.randrange(50) for _ in range(2 * block_size)] if shared_prefix else []
    for i in range(num_requests):
        prompt = prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 3 * block_size))]
        manager.allocate(next_id, prompt)
        seqs = [_Seq(next_id, list(prompt), len(prompt))]
        next_id += 1
        if rng.random() < 0.5:  # a fork: its last block is shared, so its first append copies
            manager.fork(seqs[0].seq_id, next_id)
            seqs.append(_Seq(next_id, list(prompt), len(prompt)))
            next_id += 1
        for s in seqs:
            s.token_ids.append(rng.randrange(50))
        requests.append(_Req(i, seqs))
    return requests


@pytest.mark.parametrize("seed", range(6))
def test_one_call_for_all_running_takes_what_request_by_request_takes(seed):
    """The scheduler's one-call path and its request-by-request path give the same step: same
    sequences, counts, copies, and the same block tables after it."""
    outs, tables = [], []
    for one_call in (True, False):
        rng = random.Random(seed)
        manager = BlockManager(64, 4)
        scheduler = Scheduler(manager, max_num_seqs=32, max_num_batched_tokens=64)
        scheduler.running = _running(manager, rng, shared_prefix=seed % 2 == 0)
        if not one_call:  # the general path only
            scheduler._take_all_running = lambda out: False
        out = scheduler.schedule()
        outs.append(([s.seq_id for s in out.seqs], out.num_new_tokens, out.copies, [r.arrival_index for r in out.requests]))
        tables.append({sid: manager.block_table(sid) for sid in manager.seq_ids()})
    assert outs[0] == outs[1]
    assert tables[0] == tables[1]


def test_one_call_path_falls_back_when_the_pool_is_short():
    """With too few blocks for every sequence, the step preempts as before (the one call
    changed nothing)."""
    rng = random.Random(0)
    manager = BlockManager(9, 4, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=32, max_num_batched_tokens=64)
    requests = []
    for i in range(3):  # three full blocks each: the next token needs a new block
        prompt = [rng.randrange(50) for _ in range(12)]
        manager.allocate(i, prompt)
        requests.append(_Req(i, [_Seq(i, prompt + [1], 12)]))
    scheduler.running = list(requests)
    out = scheduler.schedule()
    assert [r.arrival_index for r in out.preempted] == [2]
    assert [s.seq_id for s in out.seqs] == [0, 1]


@pytest.mark.parametrize("mode", ["paged", "virtual"])
def test_step_inputs_match_the_per_sequence_views(mode):
    engine = hx.decoding_engine(mode, num_seqs=4, prompt_len=9, steps=3)
    manager = engine.manager
    ids = manager.seq_ids()
    counts = [1, 3, 2, 9][:len(ids)]
    got = manager.step_inputs(ids, counts)
    want = ([t for i, n in zip(ids, counts) for t in manager.token_ids(i)[-n:]],
            [p for i, n in zip(ids, counts) for p in range(manager.num_tokens(i) - n, manager.num_tokens(i))],
            [s for i, n in zip(ids, counts) for s in manager.slot_mapping(i, manager.num_tokens(i) - n)],
            [manager.num_tokens(i) for i in ids], [manager.block_table(i) for i in ids])
    assert got == want
    with pytest.raises(ValueError, match="cannot run its last"):
        manager.step_inputs(ids[:1], [manager.num_tokens(ids[0]) + 1])


def test_from_manager_reads_any_manager_through_its_views():
    """A manager without `step_inputs` (e.g. an exercise's) gives the same batch."""
    manager = BlockManager(32, 4)
    manager.allocate("a", list(range(10)))
    manager.allocate("b", list(range(20, 27)))

    class ViewsOnly:
        def __getattr__(self, name):
            if name == "step_inputs":
                raise AttributeError(name)
            return getattr(manager, name)

    fast = PagedBatch.from_manager(manager, ["b", "a"], [3, 1])
    slow = PagedBatch.from_manager(ViewsOnly(), ["b", "a"], [3, 1])
    for name in ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name


def test_virtual_used_blocks_count_matches_the_sum_over_requests():
    """`VirtualBlockManager.num_used_blocks` (a running count) equals the pages the page
    table's active requests need, summed, through admissions, growth, forks and frees."""
    engine = hx.build_engine("virtual", num_seqs=6, max_len=64, record_steps=False)
    manager, table = engine.manager, engine.manager.table
    rng = random.Random(1)

    def summed():
        return sum(table.geometry.pages_for(table.tokens[table.slot(r)]) for r in table.requests)

    live = []
    for step in range(60):
        op = rng.random()
        if op < 0.3 and len(live) < 4:
            sid = f"s{step}"
            manager.allocate(sid, [1] * rng.randrange(1, 20))
            live.append(sid)
        elif op < 0.4 and live and len(live) < 4:
            child = f"f{step}"
            manager.fork(rng.choice(live), child)
            live.append(child)
        elif op < 0.55 and live:
            manager.free(live.pop(rng.randrange(len(live))))
        elif live:
            grow = [s for s in live if manager.num_tokens(s) < 40]
            if grow:
                manager.append_slots(grow, [[2] * rng.randrange(1, 4) for _ in grow])
        assert manager.num_used_blocks == summed() == table.needed_bytes() // (
            table.geometry.page_bytes * table.geometry.num_tensors)


# -- overlapped decode: the next decode step launched before the last one's tokens are read ----

from minillm.decoding.sampling import SamplingParams  # noqa: E402
from minillm.engine import EngineConfig, LLMEngine  # noqa: E402
from minillm.kernels.base import interpreting  # noqa: E402
from minillm.model import load_tokenizer  # noqa: E402
from minillm import BUNDLED_MODEL  # noqa: E402
from minillm.testing import run_to_completion, tiny_llama  # noqa: E402

TOKENIZER = load_tokenizer(BUNDLED_MODEL)[0]
VOCAB = TOKENIZER.get_vocab_size()


def _engine(overlap: bool, kv_cache: str = "paged", **config) -> LLMEngine:
    """A CPU engine drawing its tokens "on the device" (the eager runner's `forward_and_sample`),
    with overlapped decode on or off (on a CPU nothing runs concurrently; the bookkeeping is
    the same as on CUDA)."""
    config = {"num_blocks": 96, "block_size": 4, "max_num_seqs": 4, "max_n": 2, "seed": 0, "fused_decode": "off",
              "record_steps": True, "kv_cache": kv_cache, **config}
    engine = LLMEngine(tiny_llama(0, vocab_size=VOCAB), TOKENIZER, EngineConfig(**config))
    engine.sample_on_device = True
    engine.overlap_decode = overlap
    return engine


def _workload(seed: int, n: int = 9):
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(2, 14))] for _ in range(n)]
    stops = list(range(0, VOCAB, 5))   # a fifth of the vocabulary: sequences stop at random steps
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 12), ignore_eos=True,
                             stop_token_ids=stops if rng.random() < 0.5 else ()) for _ in prompts]
    return prompts, params


def _outputs(engine, prompts, params):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in run_to_completion(engine, prompts, params)]


@pytest.mark.parametrize("kv_cache", ["paged", "virtual"])
@pytest.mark.parametrize("seed", range(3))
def test_overlapped_decode_gives_the_same_tokens(kv_cache, seed):
    """More requests than the batch holds, stops at random steps, some requests ending after
    one token: the same outputs with and without overlap, every block freed, and steps did
    overlap."""
    prompts, params = _workload(seed)
    plain, overlapped = _engine(False, kv_cache), _engine(True, kv_cache)
    assert _outputs(overlapped, prompts, params) == _outputs(plain, prompts, params)
    assert overlapped.stats.overlapped_steps > 0 and plain.stats.overlapped_steps == 0
    assert overlapped.stats.generation_tokens == plain.stats.generation_tokens
    records = overlapped.steps
    assert all(a.end <= b.start for a, b in zip(records, records[1:])), "step records must not overlap"


def test_overlapped_decode_with_a_short_pool_preempts_as_before():
    prompts, params = _workload(5, n=6)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True) for _ in prompts]
    kw = {"num_blocks": 14}
    plain, overlapped = _engine(False, **kw), _engine(True, **kw)
    assert _outputs(overlapped, prompts, params) == _outputs(plain, prompts, params)
    assert overlapped.scheduler.num_preemptions > 0 and overlapped.stats.overlapped_steps > 0


def test_overlapped_decode_keeps_the_prefix_cache_keys():
    """Blocks filled by a token appended before its id was known are offered to the prefix
    cache once it is: a second run of the same prompt finds its generated blocks."""
    prompt = list(range(1, 9))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    caches = []
    for overlap in (False, True):
        engine = _engine(overlap)
        first = run_to_completion(engine, [prompt], params)[0].outputs[0].token_ids
        again = run_to_completion(engine, [prompt + first], SamplingParams(temperature=0, max_tokens=1))[0]
        caches.append((engine.manager.prefix_cache_entries().keys(), again.num_cached_tokens))
    assert caches[0] == caches[1] and caches[1][1] >= 16


def test_abort_while_a_step_is_launched_ahead():
    prompts, _ = _workload(2, n=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine = _engine(True)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine._ahead is None:
        engine.step()
    engine.abort(ids[1])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert ids[1] not in done and all(len(done[i].outputs[0].token_ids) == 20 for i in ids if i != ids[1])
    assert engine.manager.num_used_blocks == 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={5: 1.0}),
    SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, n=2, seed=1),
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, num_beams=2),
], ids=["logprobs", "processor", "n2-sampled", "beams"])
def test_no_overlap_for_requests_that_need_the_logits(params):
    """Logprobs, processors, n > 1 and beams keep the steps in order (and still run)."""
    if params.temperature > 0 and torch.cuda.is_available() and not interpreting():
        pytest.skip("the sampler's Triton kernel on CPU tensors needs Triton's interpreter")
    prompts, _ = _workload(3, n=4)
    overlapped, plain = _engine(True), _engine(False)
    assert _outputs(overlapped, prompts[:2], [params] * 2) == _outputs(plain, prompts[:2], [params] * 2)
    assert overlapped.stats.overlapped_steps == 0


@pytest.mark.skipif(not interpreting(), reason="the device sampler on CPU tensors runs in Triton's interpreter")
def test_overlapped_decode_samples_the_same_tokens():
    """Sampled requests draw with keys of their position: the same tokens with overlap."""
    prompts, _ = _workload(4, n=3)
    params = [SamplingParams(temperature=0.9, top_k=20, max_tokens=6, ignore_eos=True, seed=i) for i in range(3)]
    plain, overlapped = _engine(False), _engine(True)
    assert _outputs(overlapped, prompts, params) == _outputs(plain, prompts, params)
    assert overlapped.stats.overlapped_steps > 0


def test_append_pending_takes_the_slots_append_slots_would():
    """`BlockManager.append_pending` (its one-loop common case, and the general path when a
    fork shares a partly filled block) takes the same slots, copies and blocks as
    `append_slots` of real tokens."""
    from minillm.paged import BlockManager

    for fork in (False, True):
        managers = [BlockManager(32, 4, enable_prefix_caching=False) for _ in range(2)]
        for m in managers:
            m.allocate("a", [1, 2, 3, 4])          # at a block boundary: takes a new block
            m.allocate("b", [5, 6])                # partly filled: no new block
            if fork:
                m.fork("b", "c")                   # shared and partly filled: copy-on-write
        seqs = ["a", "b", "c"] if fork else ["a", "b"]
        pending = managers[0].append_pending(seqs)
        real = managers[1].append_slots(seqs, [7] * len(seqs))
        assert pending.slots == real.slots and pending.copies == real.copies and bool(real.copies) == fork
        assert [managers[0].block_table(s) for s in seqs] == [managers[1].block_table(s) for s in seqs]
        for s in seqs:
            managers[0].set_last_token(s, 7)
            assert managers[0].token_ids(s) == managers[1].token_ids(s)
