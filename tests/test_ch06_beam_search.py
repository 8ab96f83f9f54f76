"""Chapter 6: beam search over a paged KV cache against Hugging Face transformers.

The oracle is ``model.generate(num_beams=k, do_sample=False, ...)`` on tiny random Llama
models built with transformers' `LlamaConfig` (float32, CPU), whose weights our model loads:
the returned sequences must be identical and the scores (``sequences_scores``) equal to
float32 rounding. Every grid case returns all ``k`` hypotheses, so the whole ranking is
compared, not only the winner.

For the comparison to reach the interesting paths (beams finishing early, the kept
hypotheses filling up, each ``early_stopping`` rule stopping the search), the models make
their eos token likely: its output embedding points along the mean final hidden state.
`test_the_grid_reaches_every_stopping_rule` checks that the grid does reach them.
"""
from __future__ import annotations

import collections
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from minillm.decoding import BeamSearchParams, FinishedHypotheses, beam_search  # noqa: E402
from minillm.model import LlamaForCausalLM, ModelConfig, load_model, load_tokenizer  # noqa: E402
from minillm.paged import BlockManager, OutOfBlocks  # noqa: E402

import minillm.decoding.beams as beam_search_module  # noqa: E402

VOCAB = 128
EOS = 7
PAD = VOCAB - 1          # never in a prompt: transformers would take it for padding
MAX_NEW = 10
BUNDLED = Path(__file__).resolve().parents[1] / "minillm" / "checkpoints" / "shakespeare"


# Tiny models: one torch thread for this module (see `one_torch_thread` in conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@torch.no_grad()
def make_models(seed: int) -> tuple:
    """``(hf_model, our_model)`` with the same random weights, eos made likely."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.generation_config.eos_token_id = None
    # eos's output embedding along the mean final hidden state, scaled so that its logit is
    # about a typical best logit: it wins often, but not always.
    ids = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(seed))
    hidden = hf.model(ids).last_hidden_state.reshape(-1, config.hidden_size)
    best_logit = (hidden @ hf.lm_head.weight.T).max(-1).values.mean()
    mean = hidden.mean(0)
    hf.lm_head.weight[EOS] = mean / (mean @ mean) * best_logit
    ours = LlamaForCausalLM(ModelConfig.from_dict(hf.config.to_dict()))
    ours.load_state_dict(hf.state_dict())
    return hf, ours.eval()


_models: dict[int, tuple] = {}


def models(seed: int) -> tuple:
    if seed not in _models:
        _models[seed] = make_models(seed)
    return _models[seed]


def prompt_for(seed: int) -> list[int]:
    return torch.randint(0, PAD, (5 + seed,), generator=torch.Generator().manual_seed(100 + seed)).tolist()


def hf_beam_search(hf, prompt: list[int], params: BeamSearchParams):
    ids = torch.tensor([prompt])
    return hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=params.num_beams, do_sample=False,
                       max_new_tokens=params.max_new_tokens, early_stopping=params.early_stopping,
                       length_penalty=params.length_penalty, num_return_sequences=params.num_return_sequences,
                       eos_token_id=list(params.eos_token_ids) or None, pad_token_id=PAD,
                       output_scores=True, return_dict_in_generate=True)


def assert_same_as_transformers(ours, hf_out) -> None:
    assert ours.padded(PAD).tolist() == hf_out.sequences.tolist()
    want = hf_out.sequences_scores.double()
    got = torch.tensor(ours.scores, dtype=torch.float64)
    # float32 sums of log-probs from two implementations: rounding-level differences only
    assert torch.all((got - want).abs() <= 1e-5 * want.abs().clamp(min=1)), (got, want)


GRID = list(itertools.product([0, 1, 2], [2, 4], [1.0, 0.0, 2.0, -1.0], [False, True, "never"]))
BLOCK_SIZES = {0: 1, 1: 3, 2: 16}  # one per seed: block size 1 never copies, 3 copies often


@pytest.mark.parametrize("seed, k, length_penalty, early_stopping", GRID,
                         ids=[f"seed{s}-k{k}-lp{lp}-es{es}" for s, k, lp, es in GRID])
def test_matches_transformers_with_eos(seed, k, length_penalty, early_stopping):
    hf, ours = models(seed)
    params = BeamSearchParams(k, MAX_NEW, length_penalty, early_stopping, num_return_sequences=k,
                              eos_token_ids=(EOS,))
    prompt = prompt_for(seed)
    out = beam_search(ours, prompt, params, block_size=BLOCK_SIZES[seed])
    assert_same_as_transformers(out, hf_beam_search(hf, prompt, params))


@pytest.mark.parametrize("seed, k, length_penalty", [(0, 2, 1.0), (1, 4, 2.0), (2, 4, -1.0), (1, 3, 0.0)])
def test_matches_transformers_without_eos(seed, k, length_penalty):
    hf, ours = models(seed)
    params = BeamSearchParams(k, MAX_NEW, length_penalty, num_return_sequences=k)
    prompt = prompt_for(seed)
    out = beam_search(ours, prompt, params, block_size=BLOCK_SIZES[seed])
    assert all(len(h.token_ids) == MAX_NEW for h in out.hypotheses)
    assert_same_as_transformers(out, hf_beam_search(hf, prompt, params))


@pytest.mark.parametrize("num_return_sequences", [1, 3])
def test_matches_transformers_two_eos_ids_and_fewer_returns(num_return_sequences):
    """Two eos ids: 3k candidates a step; and only the best hypotheses returned."""
    hf, ours = models(1)
    prompt = prompt_for(1)
    second_eos = beam_search(ours, prompt, BeamSearchParams(4, MAX_NEW)).hypotheses[0].token_ids[2]
    params = BeamSearchParams(4, MAX_NEW, 1.0, False, num_return_sequences, eos_token_ids=(EOS, second_eos))
    assert params.num_candidates == 12
    out = beam_search(ours, prompt, params, block_size=2)
    assert len(out.hypotheses) == num_return_sequences
    assert_same_as_transformers(out, hf_beam_search(hf, prompt, params))


@pytest.mark.parametrize("early_stopping", [True, False])
def test_width_one(early_stopping):
    """transformers runs ``num_beams=1`` as greedy search. One beam is greedy too, except that
    a beam search keeps going after eos unless ``early_stopping=True``."""
    hf, ours = models(0)
    prompt = prompt_for(0)
    ids = torch.tensor([prompt])
    for eos in ((EOS,), ()) if early_stopping else ((),):
        params = BeamSearchParams(1, MAX_NEW, length_penalty=2.0, early_stopping=early_stopping, eos_token_ids=eos)
        greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                             eos_token_id=list(eos) or None, pad_token_id=PAD, output_scores=True,
                             return_dict_in_generate=True)
        out = beam_search(ours, prompt, params, block_size=3)
        assert out.sequences == greedy.sequences.tolist()
        new = greedy.sequences[0, len(prompt):]
        logprobs = torch.stack(greedy.scores)[:, 0].log_softmax(-1)       # greedy's scores are logits
        want = float(logprobs.gather(1, new[:, None]).sum() / len(new) ** 2.0)
        assert out.scores[0] == pytest.approx(want, rel=1e-5)
        if eos:
            assert out.sequences[0][-1] == EOS and len(new) < MAX_NEW   # eos ended it early


def test_matches_transformers_on_the_bundled_model():
    pytest.importorskip("safetensors")
    hf = transformers.LlamaForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    ours, config = load_model(BUNDLED, dtype=torch.float32)
    tokenizer, _ = load_tokenizer(BUNDLED)
    prompt = tokenizer.encode("ROMEO:\nWhat light through yonder").ids
    assert PAD not in prompt
    params = BeamSearchParams(4, 12, num_return_sequences=4, eos_token_ids=tuple(config.eos_token_ids))
    out = beam_search(ours, prompt, params, block_size=4)
    assert_same_as_transformers(out, hf_beam_search(hf, prompt, params))


def test_the_grid_reaches_every_stopping_rule(monkeypatch):
    """Not vacuous: over the grid, beams finish early, searches stop before ``max_new_tokens``,
    and every ``early_stopping`` rule both continues and stops a search with full hypotheses."""
    decisions = collections.Counter()
    rule = beam_search_module.search_is_over

    def spy(finished, best_live_sum, cur_len, params):
        over = rule(finished, best_live_sum, cur_len, params)
        if finished.is_full:
            decisions[params.early_stopping, params.length_penalty > 0, over] += 1
        return over

    monkeypatch.setattr(beam_search_module, "search_is_over", spy)
    early_finish = early_stop = 0
    for seed, k, lp, es in GRID:
        out = beam_search(models(seed)[1], prompt_for(seed), BeamSearchParams(k, MAX_NEW, lp, es, k, (EOS,)))
        early_finish += any(len(h.token_ids) < MAX_NEW for h in out.hypotheses)
        early_stop += len(out.trace.shared) < MAX_NEW
    assert early_finish >= len(GRID) // 4 and early_stop >= len(GRID) // 8
    for es in (False, "never"):  # with length_penalty > 0, where the two rules differ: both answers
        assert decisions[es, True, True] and decisions[es, True, False], (es, decisions)
    for es, lp_positive in itertools.product([False, True, "never"], [False, True]):
        assert decisions[es, lp_positive, True], (es, lp_positive, decisions)


def test_search_is_over_rules():
    """The stopping rules on hand-made numbers (the branches the grid does not reach too)."""
    def over(early_stopping, length_penalty, finished_sums, best_live_sum, cur_len=4, max_new_tokens=10):
        finished = FinishedHypotheses(2, length_penalty)
        for s in finished_sums:
            finished.add([1, 2], torch.tensor(s))                # 2 tokens each
        params = BeamSearchParams(2, max_new_tokens, length_penalty, early_stopping)
        return beam_search_module.search_is_over(finished, torch.tensor(best_live_sum), cur_len, params)

    for es in (False, True, "never"):
        assert not over(es, 1.0, [-1.0], -0.1)                   # fewer than k hypotheses: go on
    assert over(True, 1.0, [-2.0, -4.0], -0.1)                   # k hypotheses: stop at once
    # worst kept: -4 / 2 = -2. A live beam of sum -6 after 4 tokens scores -1.5 now: go on ...
    assert not over(False, 1.0, [-2.0, -4.0], -6.0)
    # ... of sum -10, -2.5 now: False stops, though 10 tokens could reach -1.0; "never" sees that
    assert over(False, 1.0, [-2.0, -4.0], -10.0) and not over("never", 1.0, [-2.0, -4.0], -10.0)
    assert over("never", 1.0, [-2.0, -4.0], -30.0)               # -3.0 even at 10 tokens
    # length_penalty <= 0: a longer beam cannot score better, so "never" uses cur_len too
    assert not over(False, 0.0, [-2.0, -4.0], -3.0) and over("never", 0.0, [-2.0, -4.0], -5.0)
    assert over("never", -1.0, [-2.0, -4.0], -3.0) and not over("never", -1.0, [-2.0, -4.0], -1.9)


# --- the paged cache: sharing, and every block back ----------------------------------------

def test_beams_share_blocks_and_free_them_all():
    _, ours = models(1)
    prompt = prompt_for(1)
    params = BeamSearchParams(4, MAX_NEW, num_return_sequences=4)
    manager = BlockManager(64, 3, enable_prefix_caching=False)
    cache = ours.new_paged_cache(64, 3)
    out = beam_search(ours, prompt, params, manager=manager, cache=cache)
    assert len(manager) == 0 and manager.num_used_blocks == 0 and manager.num_free_blocks == 64
    shared, unshared = out.trace.shared, out.trace.unshared
    assert len(shared) == MAX_NEW                                  # the prefill, then one step per token but the last
    assert shared[0] == unshared[0] == 2                           # 6 prompt tokens, one sequence
    assert np.all(shared <= unshared) and np.all(shared[1:] < unshared[1:])
    assert out.trace.saving > 0.2 and out.trace.copies > 0
    assert out.sequences == beam_search(ours, prompt, params, block_size=3).sequences  # a private pool agrees

    one = beam_search(ours, prompt, params, block_size=1)         # full blocks only: nothing to copy
    assert one.trace.copies == 0 and one.sequences == out.sequences


def test_second_search_hits_the_prefix_cache():
    """In an engine's pool with prefix caching, the same prompt again prefills only its last
    block, and the search is unchanged."""
    _, ours = models(2)
    prompt = prompt_for(2)                                         # 7 tokens: one full block of 4 is cacheable
    params = BeamSearchParams(2, 6, num_return_sequences=2, eos_token_ids=(EOS,))
    manager, cache = BlockManager(32, 4, enable_prefix_caching=True), ours.new_paged_cache(32, 4)
    first = beam_search(ours, prompt, params, manager=manager, cache=cache)
    second = beam_search(ours, prompt, params, manager=manager, cache=cache)
    assert manager.stats.cached_prompt_tokens == 4 and manager.num_used_blocks == 0
    assert second.sequences == first.sequences
    assert second.scores == pytest.approx(first.scores, rel=1e-5)  # the prefill ran in two pieces: rounding differs


def test_blocks_are_freed_when_the_pool_runs_out():
    _, ours = models(0)
    manager, cache = BlockManager(3, 2, enable_prefix_caching=False), ours.new_paged_cache(3, 2)
    with pytest.raises(OutOfBlocks):
        beam_search(ours, prompt_for(0), BeamSearchParams(4, MAX_NEW), manager=manager, cache=cache)
    assert len(manager) == 0 and manager.num_used_blocks == 0


# --- the pieces -----------------------------------------------------------------------------

def test_finished_hypotheses_keep_the_best():
    finished = FinishedHypotheses(num_beams=2, length_penalty=2.0)
    finished.add([1, 2], torch.tensor(-4.0))                      # -4 / 2**2 = -1
    assert not finished.is_full and finished.worst_score == -1.0
    finished.add([3], torch.tensor(-2.0))                         # -2
    finished.add([4, 5, 6, 7], torch.tensor(-8.0))                # -0.5: the best, drops -2
    assert finished.is_full
    assert [(h.token_ids, h.score) for h in finished.best(2)] == [((4, 5, 6, 7), -0.5), ((1, 2), -1.0)]
    finished.add([9], torch.tensor(-3.0))                         # worse than both: not kept
    assert [h.token_ids for h in finished.best(5)] == [(4, 5, 6, 7), (1, 2)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(early_stopping="always"), "early_stopping"),
    (dict(early_stopping=1), "early_stopping"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_params_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_vocabulary_must_hold_the_candidates():
    _, ours = models(0)
    with pytest.raises(ValueError, match="candidates"):
        beam_search(ours, [1, 2], BeamSearchParams(num_beams=VOCAB // 2 + 1))
