"""Chapter 9: the sampling parameters through the OpenAI-compatible server.

The app runs in-process (FastAPI's TestClient: its lifespan starts the engine thread), the
bundled model on the CPU. The oracle is the offline engine given the same `SamplingParams`:
every parameter must reach the engine (a server answer equals the offline one), echo and
several prompts per request must be shaped as OpenAI's API shapes them (streamed too), and
what minillm does not implement must get a 400 naming the field, never be ignored.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from minillm.engine import BUNDLED_MODEL, LLM, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from minillm.server import create_app  # noqa: E402

PROMPT = "ROMEO:\nBut soft, what light"
OTHER = "JULIET:\nO Romeo, Romeo"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one torch thread for the module


@pytest.fixture(scope="module")
def http():
    engine = LLMEngine.from_pretrained(BUNDLED_MODEL, EngineConfig(device="cpu", num_blocks=64, seed=0))
    with TestClient(create_app(engine)) as client:
        yield client


@pytest.fixture(scope="module")
def offline():
    return LLM(BUNDLED_MODEL, device="cpu", num_blocks=256)


def alone(offline, prompt, **params):
    return offline.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(http, path="/v1/completions", **body) -> list[dict]:
    r = http.post(path, json={"prompt": PROMPT, "max_tokens": 8, **body, "stream": True})
    assert r.status_code == 200, r.text
    events = [b.removeprefix("data: ") for b in r.text.split("\n\n") if b]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def error(http, path="/v1/completions", **body) -> dict:
    base = {"prompt": PROMPT} if "completions" in path and "chat" not in path else \
        {"messages": [{"role": "user", "content": "Hail."}]}
    r = http.post(path, json={**base, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


# == each parameter reaches the engine ==============================================================

CASES = [
    dict(temperature=0, presence_penalty=1.5),
    dict(temperature=0, frequency_penalty=2.0),
    dict(temperature=0, repetition_penalty=1.7),
    dict(temperature=0.9, min_p=0.2, seed=3),
    dict(temperature=1.0, presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=1.2, top_k=30, seed=9),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(p))
def test_parameters_match_the_offline_engine(http, offline, params):
    want = alone(offline, PROMPT, max_tokens=12, ignore_eos=True, **params).outputs[0]
    got = complete(http, max_tokens=12, ignore_eos=True, **params)["choices"][0]
    assert got["text"] == want.text


def test_penalties_change_the_text(http):
    plain = complete(http, temperature=0, max_tokens=16, ignore_eos=True)["choices"][0]["text"]
    for extra in ({"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}):
        assert complete(http, temperature=0, max_tokens=16, ignore_eos=True, **extra)["choices"][0]["text"] != plain


def test_logit_bias(http, offline):
    token = 1234
    text = offline.tokenizer.decode([token] * 4)
    got = complete(http, temperature=0, max_tokens=4, logit_bias={str(token): 100})
    assert got["choices"][0]["text"] == text
    got = complete(http, temperature=0.8, seed=1, max_tokens=4, logit_bias={str(token): 5000})   # clamped to 100
    assert got["choices"][0]["text"] == text
    first = offline.tokenizer.encode(complete(http, temperature=0, max_tokens=1)["choices"][0]["text"]).ids[0]
    banned = complete(http, temperature=0, max_tokens=1, logit_bias={str(first): -100})["choices"][0]["text"]
    assert offline.tokenizer.encode(banned).ids[0] != first
    # chat too
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 3,
                                                "temperature": 0, "logit_bias": {str(token): 100}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == offline.tokenizer.decode([token] * 3)


def test_min_tokens(http, offline):
    eos = offline.engine.eos_token_ids[0]
    got = complete(http, temperature=0, max_tokens=10, logit_bias={str(eos): 100})
    assert got["usage"]["completion_tokens"] == 1 and got["choices"][0]["finish_reason"] == "stop"
    got = complete(http, temperature=0, max_tokens=10, min_tokens=4, logit_bias={str(eos): 100})
    assert got["usage"]["completion_tokens"] == 5 and got["choices"][0]["finish_reason"] == "stop"


def test_include_stop_str_in_output(http, offline):
    full = alone(offline, PROMPT, temperature=0, max_tokens=20, ignore_eos=True).outputs[0].text
    stop = full[6:9]
    at = full.index(stop)
    cut = complete(http, temperature=0, max_tokens=20, stop=[stop])["choices"][0]
    kept = complete(http, temperature=0, max_tokens=20, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert (cut["text"], kept["text"]) == (full[:at], full[:at + len(stop)])
    assert kept["finish_reason"] == "stop"
    chunks = stream(http, temperature=0, max_tokens=20, stop=[stop], include_stop_str_in_output=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[:at + len(stop)]


# == echo ===========================================================================================

def test_echo(http, offline):
    want = alone(offline, PROMPT, temperature=0, max_tokens=6).outputs[0]
    got = complete(http, temperature=0, max_tokens=6, echo=True)
    assert got["choices"][0]["text"] == PROMPT + want.text
    ids = offline.tokenizer.encode(PROMPT).ids
    got = complete(http, prompt=ids, temperature=0, max_tokens=6, echo=True)
    assert got["choices"][0]["text"] == offline.tokenizer.decode(ids) + want.text
    chunks = stream(http, temperature=0, max_tokens=6, echo=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + want.text
    # max_tokens 0: the prompt alone
    only = complete(http, max_tokens=0, echo=True)
    assert only["choices"][0]["text"] == PROMPT and only["usage"]["completion_tokens"] == 0
    assert error(http, max_tokens=0)["param"] == "max_tokens"


def test_echo_with_logprobs(http, offline):
    ids = offline.tokenizer.encode(PROMPT).ids
    want = alone(offline, PROMPT, temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2)
    got = complete(http, temperature=0, max_tokens=4, echo=True, logprobs=2)["choices"][0]
    lp = got["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4 and "".join(lp["tokens"]) == got["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    prompt_want = [t.logprob for t in want.prompt_logprobs[1:]]
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(prompt_want, abs=1e-4)
    assert lp["token_logprobs"][len(ids):] == pytest.approx([t.logprob for t in want.outputs[0].logprobs], abs=1e-4)
    assert all(len(top) in (2, 3) for top in lp["top_logprobs"][1:])       # the token itself + 2 most likely
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert "prompt_logprobs" not in got
    # streamed: the same, in pieces
    chunks = stream(http, temperature=0, max_tokens=4, echo=True, logprobs=2)
    streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)
    # echo only: the prompt's log-probabilities alone
    only = complete(http, max_tokens=0, echo=True, logprobs=0)["choices"][0]["logprobs"]
    assert len(only["tokens"]) == len(ids) and only["token_logprobs"][1:] == pytest.approx(prompt_want, abs=1e-4)


def test_prompt_logprobs(http, offline):
    ids = offline.tokenizer.encode(PROMPT).ids
    want = alone(offline, PROMPT, temperature=0, max_tokens=2, prompt_logprobs=1).prompt_logprobs
    for chunks in (None, stream(http, temperature=0, max_tokens=2, prompt_logprobs=1)):
        choice = complete(http, temperature=0, max_tokens=2, prompt_logprobs=1)["choices"][0] if chunks is None \
            else chunks[0]["choices"][0]
        got = choice["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        for token, entry, w in zip(ids[1:], got[1:], want[1:]):
            assert entry[str(token)]["logprob"] == pytest.approx(w.logprob, abs=1e-4)
            assert entry[str(token)]["rank"] == w.rank and entry[str(token)]["decoded_token"]
            assert 1 <= len(entry) <= 2 and min(e["rank"] for e in entry.values()) == 1
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 2,
                                                "prompt_logprobs": 0})
    body = r.json()
    assert r.status_code == 200 and body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) > 3
    assert all(len(e) == 1 for e in body["prompt_logprobs"][1:])


# == several prompts ================================================================================

def test_several_prompts(http, offline):
    wants = [alone(offline, p, max_tokens=6, n=2, seed=5, temperature=0.9) for p in (PROMPT, OTHER)]
    got = complete(http, prompt=[PROMPT, OTHER], max_tokens=6, n=2, seed=5, temperature=0.9)
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in got["choices"]] == [o.text for w in wants for o in w.outputs]
    assert got["usage"]["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in wants)
    assert got["usage"]["completion_tokens"] == sum(len(o.token_ids) for w in wants for o in w.outputs)
    # token-id lists, with echo
    ids = [offline.tokenizer.encode(p).ids for p in (PROMPT, OTHER)]
    greedy = [alone(offline, p, max_tokens=5, temperature=0).outputs[0].text for p in (PROMPT, OTHER)]
    got = complete(http, prompt=ids, max_tokens=5, temperature=0, echo=True)
    assert [c["text"] for c in got["choices"]] == [offline.tokenizer.decode(i) + g for i, g in zip(ids, greedy)]


def test_several_prompts_streamed(http, offline):
    wants = [alone(offline, p, max_tokens=6, n=2, seed=5, temperature=0.9) for p in (PROMPT, OTHER)]
    texts, reasons = [""] * 4, [None] * 4
    chunks = stream(http, prompt=[PROMPT, OTHER], max_tokens=6, n=2, seed=5, temperature=0.9,
                    stream_options={"include_usage": True})
    *chunks, usage = chunks
    for chunk in chunks:
        [c] = chunk["choices"]
        assert reasons[c["index"]] is None, "nothing may follow a choice's last chunk"
        texts[c["index"]] += c["text"]
        reasons[c["index"]] = c["finish_reason"]
    assert texts == [o.text for w in wants for o in w.outputs]
    assert reasons == [o.finish_reason for w in wants for o in w.outputs]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == sum(
        len(o.token_ids) for w in wants for o in w.outputs)
    assert len({c["id"] for c in chunks}) == 1


# == refused ========================================================================================

@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"min_tokens": 5}, "min_tokens"),                  # > max_tokens (4)
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),     # outside the vocabulary
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"suffix": "and so on"}, "suffix"),
    ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"use_beam_search": True, "best_of": 2, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"num_beams": 2, "repetition_penalty": 1.2}, "repetition_penalty"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"presence_penalty": 9}, "presence_penalty"),
    ("/v1/completions", {"prompt": ["a"] * 257}, "prompt"),                 # over MAX_PROMPTS
])
def test_refused_with_the_field_named(http, path, body, param):
    assert error(http, path, **body)["param"] == param
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_harmless_values_and_unknown_fields_pass(http):
    for extra in ({"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"tools": []}, {"user": "me"},
                  {"some_vendor_extra": 1}, {"suffix": None}):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **extra})
        assert r.status_code == 200, (extra, r.text)
