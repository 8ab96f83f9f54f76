"""Chapter 9: the sampling parameters end to end through `LLMEngine` on the bundled model (CPU).

The oracle is a plain loop: the model's contiguous forward over prompt + output so far, the
NumPy reference (`minillm.reference.ch09_sampling`) for greedy, the torch processors and
`sample_token` with the completion's generator for sampling. The engine must give the same
tokens, for each request alone and for all of them batched together.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minillm.decoding.logits_processors import apply_logits_processors
from minillm.decoding.sampling import completion_generator, sample_token
from minillm.engine import BUNDLED_MODEL, EngineConfig, InvalidRequest, LLMEngine, SamplingParams
from minillm.model import load_model, load_tokenizer
from minillm.reference.ch09_sampling import process_logits
from minillm.testing import run_to_completion as run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


@pytest.fixture(scope="module")
def engine():
    model, _ = load_model(BUNDLED_MODEL, dtype="float32")
    return LLMEngine(model, load_tokenizer(BUNDLED_MODEL)[0], EngineConfig(device="cpu", num_blocks=128, seed=0))





def one(engine, prompt, **params):
    return run(engine, [prompt], SamplingParams(**params))[0]


@torch.inference_mode()
def loop(engine, prompt_ids, params: SamplingParams, index: int = 0) -> list[int]:
    """The oracle: one token at a time, the whole sequence through the model each step."""
    stops = set(engine.eos_token_ids) | set(params.stop_token_ids)
    generator = None if params.greedy else completion_generator(params, index)
    out: list[int] = []
    while len(out) < params.max_tokens:
        logits = engine.model(torch.tensor([prompt_ids + out]))[0, -1].float()
        if params.greedy:
            token = int(np.argmax(process_logits(logits.numpy(), prompt_ids, out, params, stops)))
        else:
            row = apply_logits_processors(logits[None], [params], [prompt_ids], [out], [stops])[0]
            token = sample_token(row, params, generator)
        out.append(token)
        if token in stops:
            break
    return out


def test_logit_bias_forces_and_forbids(engine):
    free = one(engine, PROMPT, temperature=0, max_tokens=6).outputs[0].token_ids
    forced = one(engine, PROMPT, temperature=0, max_tokens=6, logit_bias={1234: 100.0}).outputs[0]
    assert forced.token_ids == [1234] * 6
    banned = one(engine, PROMPT, temperature=0, max_tokens=6, logit_bias={free[0]: -100.0}).outputs[0].token_ids
    assert banned[0] != free[0] and free[0] not in banned
    # sampled too: +100 leaves nothing else to draw
    assert one(engine, PROMPT, max_tokens=4, seed=3, logit_bias={77: 100}).outputs[0].token_ids == [77] * 4


def test_min_tokens_holds_back_eos_and_stop_tokens(engine):
    eos = engine.eos_token_ids[0]
    # eos pushed to the top: without min_tokens it is the first token
    out = one(engine, PROMPT, temperature=0, max_tokens=10, logit_bias={eos: 100}).outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = one(engine, PROMPT, temperature=0, max_tokens=10, min_tokens=4, logit_bias={eos: 100}).outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]
    assert out.finish_reason == "stop"
    # a stop token id, sampled
    out = one(engine, PROMPT, max_tokens=10, seed=1, min_tokens=3, stop_token_ids=[99], logit_bias={99: 100})
    assert out.outputs[0].token_ids[3:] == [99] and 99 not in out.outputs[0].token_ids[:3]
    # ignore_eos: min_tokens masks only the stop token ids then
    out = one(engine, PROMPT, temperature=0, max_tokens=3, min_tokens=2, ignore_eos=True, logit_bias={eos: 100})
    assert out.outputs[0].token_ids == [eos] * 3


def test_min_tokens_ignores_earlier_stop_strings(engine):
    free = one(engine, PROMPT, temperature=0, max_tokens=20, ignore_eos=True).outputs[0]
    stop = free.text[:3]
    assert one(engine, PROMPT, temperature=0, max_tokens=20, stop=[stop]).outputs[0].text == ""
    first_two = one(engine, PROMPT, temperature=0, max_tokens=2, ignore_eos=True).outputs[0].text
    assert first_two.startswith(stop)
    late = one(engine, PROMPT, temperature=0, max_tokens=20, stop=[stop], min_tokens=2, ignore_eos=True).outputs[0]
    # the first match ends within the first 2 tokens: it never counts; a later one does
    again = free.text.find(stop, len(first_two) - len(stop) + 1)
    assert again > 0 and late.text == free.text[:again] and late.finish_reason == "stop"


def test_include_stop_str_in_output(engine):
    free = one(engine, PROMPT, temperature=0, max_tokens=20, ignore_eos=True).outputs[0]
    stop = free.text[8:11]
    cut = one(engine, PROMPT, temperature=0, max_tokens=20, stop=[stop]).outputs[0]
    kept = one(engine, PROMPT, temperature=0, max_tokens=20, stop=[stop], include_stop_str_in_output=True).outputs[0]
    at = free.text.index(stop)
    assert (cut.text, kept.text) == (free.text[:at], free.text[:at + len(stop)])
    assert kept.stop_reason == cut.stop_reason == stop
    # a stop token's text: left out unless asked for (vLLM)
    token = free.token_ids[2]
    by_id = one(engine, PROMPT, temperature=0, max_tokens=20, stop_token_ids=[token]).outputs[0]
    with_id = one(engine, PROMPT, temperature=0, max_tokens=20, stop_token_ids=[token],
                  include_stop_str_in_output=True).outputs[0]
    assert by_id.token_ids == with_id.token_ids == free.token_ids[:3]
    assert with_id.text.startswith(by_id.text) and len(with_id.text) > len(by_id.text)
    assert free.text.startswith(with_id.text)


PENALIZED = [
    dict(temperature=0, repetition_penalty=1.8),
    dict(temperature=0, frequency_penalty=1.5, presence_penalty=0.5),
    dict(temperature=0, repetition_penalty=0.7, presence_penalty=-1.0),
    dict(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.8, seed=11),
    dict(temperature=1.0, min_p=0.1, presence_penalty=2.0, seed=5, top_k=40),
    dict(temperature=0.8, top_p=0.9, min_p=0.05, seed=2),
    dict(temperature=0),
]


def test_penalties_match_the_oracle_alone_and_batched(engine):
    ids = engine.tokenizer.encode(PROMPT).ids
    params = [SamplingParams(max_tokens=12, ignore_eos=True, **kw) for kw in PENALIZED]
    want = [loop(engine, ids, p) for p in params]
    assert want[0] != want[-1] and want[1] != want[-1], "the penalties change the greedy text"
    alone = [run(engine, [ids], p)[0].outputs[0].token_ids for p in params]
    assert alone == want
    together = run(engine, [ids] * len(params), params)     # one batch, rows with and without penalties
    assert [o.outputs[0].token_ids for o in together] == want


def test_penalties_with_n_samples(engine):
    ids = engine.tokenizer.encode(PROMPT).ids
    params = SamplingParams(max_tokens=8, n=3, seed=4, ignore_eos=True, frequency_penalty=1.0,
                            repetition_penalty=1.2, min_p=0.05)
    got = [c.token_ids for c in run(engine, [ids], params)[0].outputs]
    assert got == [loop(engine, ids, params, i) for i in range(3)]


def test_prompt_logprobs(engine):
    ids = engine.tokenizer.encode(PROMPT).ids
    out = one(engine, PROMPT, temperature=0, max_tokens=2, prompt_logprobs=3)
    assert out.outputs[0].logprobs is None
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    with torch.inference_mode():
        want = torch.log_softmax(engine.model(torch.tensor([ids]))[0].float(), -1)
    for i, lp in enumerate(lps[1:], start=1):
        assert lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(float(want[i - 1, ids[i]]), abs=1e-4)
        assert lp.rank == int((want[i - 1] > want[i - 1, ids[i]]).sum()) + 1
        assert [t for t, _ in lp.top] == want[i - 1].topk(3).indices.tolist()
    # in chunks of max_num_batched_tokens, and through the prefix cache: the same
    config = EngineConfig(device="cpu", num_blocks=64, max_num_batched_tokens=5, max_num_seqs=4, max_n=4)
    small = LLMEngine(engine.model, engine.tokenizer, config)
    again = [run(small, [ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0] for _ in range(2)]
    assert again[1].num_cached_tokens > 0
    for o in again:
        assert [lp.token_id for lp in o.prompt_logprobs[1:]] == ids[1:]
        assert [lp.logprob for lp in o.prompt_logprobs[1:]] == pytest.approx([lp.logprob for lp in lps[1:]], abs=1e-4)
        assert all(lp.top == () for lp in o.prompt_logprobs[1:])


def test_logit_bias_outside_the_vocabulary(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidRequest, match="logit_bias") as e:
        engine.add_request(PROMPT, SamplingParams(logit_bias={vocab: 1.0}))
    assert e.value.param == "logit_bias"
    assert not engine.has_unfinished_requests()


def test_parallel_sampler_applies_them_too(engine):
    """Chapter 6's `parallel_sample` over its own pool: the same tokens as the engine."""
    from minillm.decoding.sampling import parallel_sample

    ids = engine.tokenizer.encode(PROMPT).ids
    params = SamplingParams(max_tokens=8, n=2, seed=4, frequency_penalty=1.0, repetition_penalty=1.3,
                            logit_bias={5: 3.0}, min_tokens=2, stop_token_ids=(7,))
    got = parallel_sample(engine.model, ids, 2, params, block_size=16)
    engine_params = SamplingParams(**{**params.__dict__, "ignore_eos": True})
    want = [c.token_ids for c in run(engine, [ids], engine_params)[0].outputs]
    assert [c.token_ids for c in got.completions] == want
