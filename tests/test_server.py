"""Chapter 9: the OpenAI-compatible server (`minillm.server`), live on loopback.

A real uvicorn server runs in a background thread with the bundled model on the CPU and a
small KV pool, and the official ``openai`` client calls it. The oracle is the offline engine:
a greedy request through the server must give exactly what `LLM.generate` gives for the same
prompt alone in a roomy pool, whether streamed or not, alone or among 200 concurrent streams
that force preemptions. Bad input must get OpenAI's error envelope with the right status,
and the server must go on serving; a client that walks away must get its blocks freed.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minillm.engine import BUNDLED_MODEL, LLM, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from minillm.model.loader import render_chat  # noqa: E402
from minillm.server import create_app  # noqa: E402
from minillm.server.launch import banner  # noqa: E402
from minillm.testing import serve_in_thread, wait_idle  # noqa: E402

NUM_BLOCKS = 32        # 512 token slots: 200 concurrent streams must preempt
API_KEY = "sekret"
PROMPT = "ROMEO:\nBut soft, what light"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one torch thread for the module


def make_engine(num_blocks: int) -> LLMEngine:
    return LLMEngine.from_pretrained(BUNDLED_MODEL, EngineConfig(device="cpu", num_blocks=num_blocks, seed=0))


@pytest.fixture(scope="module")
def live():
    """``(engine, app, base_url)`` of the server the tests share."""
    engine = make_engine(NUM_BLOCKS)
    app = create_app(engine)
    with serve_in_thread(app, log_level="warning") as url:
        yield engine, app, url


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live[2] + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live[2], timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    """The oracle: the offline API in a roomy pool, one request at a time."""
    return LLM(BUNDLED_MODEL, device="cpu", num_blocks=256)


def alone(offline, prompt, **params):
    return offline.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def greedy(offline, prompt, max_tokens, **params) -> str:
    return alone(offline, prompt, temperature=0, max_tokens=max_tokens, **params).outputs[0].text


def sse_events(text: str) -> list:
    """The ``data:`` payloads of an event stream (``[DONE]`` kept as a string)."""
    events = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


# == the endpoints ================================================================================

def test_models_health_metrics(live, client, http):
    engine, _, _ = live
    [model] = client.models.list().data
    assert model.id == engine.model_name == "shakespeare"
    assert model.max_model_len == engine.max_model_len == NUM_BLOCKS * 16
    assert http.get("/health").json() == {"status": "ok"}
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in ("minillm_num_requests_running", "minillm_num_requests_waiting", "minillm_kv_blocks_used",
                 "minillm_kv_blocks_free", "minillm_prefix_cache_hit_rate", "minillm_num_preemptions",
                 "minillm_generation_tokens", "minillm_prompt_tokens_computed", "minillm_time_to_first_token_seconds",
                 "minillm_time_per_output_token_seconds", "minillm_e2e_request_latency_seconds"):
        assert name in families, name
    assert families["minillm_kv_blocks_free"].samples[0].value + families["minillm_kv_blocks_used"].samples[0].value \
        <= NUM_BLOCKS


def test_completion_is_the_offline_greedy_text(live, client, offline):
    want = alone(offline, PROMPT, temperature=0, max_tokens=12)
    got = client.completions.create(model="shakespeare", prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.object == "text_completion" and got.model == "shakespeare"
    [choice] = got.choices
    assert choice.text == want.outputs[0].text and choice.finish_reason == "length" and choice.index == 0
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids), 12)
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12
    # token ids, a list of one prompt, and no model name: the same request
    ids = offline.tokenizer.encode(PROMPT).ids
    for prompt in (ids, [PROMPT], [ids]):
        again = client.completions.create(model="shakespeare", prompt=prompt, max_tokens=12, temperature=0)
        assert again.choices[0].text == choice.text
    raw = live[2] + "/v1/completions"
    assert httpx.post(raw, json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"] \
        == choice.text


def test_usage_reports_prefix_cache_hits(client):
    prompt = "KING HENRY V:\nOnce more unto the breach, dear friends, once more; or close the wall up with our " \
             "English dead."
    first, second = (client.completions.create(model="shakespeare", prompt=prompt, max_tokens=2).usage
                     for _ in range(2))
    assert first.prompt_tokens == second.prompt_tokens > 16
    assert second.prompt_tokens_details.cached_tokens == 16 * (first.prompt_tokens // 16)
    assert first.prompt_tokens_details.cached_tokens < second.prompt_tokens_details.cached_tokens


def test_chat_uses_the_checkpoint_template(client, offline):
    messages = [{"role": "system", "content": "Verona. A street."}, {"role": "user", "content": "Good morrow, lady."}]
    prompt = render_chat(offline.engine.chat_template, messages)
    assert prompt == "Verona. A street.\n\nROMEO:\nGood morrow, lady.\n\nJULIET:\n"
    want = greedy(offline, prompt, 40, stop=["\n\n"])
    got = client.chat.completions.create(model="shakespeare", messages=messages, temperature=0, stop=["\n\n"])
    [choice] = got.choices          # no max_tokens: up to the context's end, but the stop string ends it
    assert got.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == want and choice.finish_reason == "stop" and want
    assert got.usage.prompt_tokens == len(offline.tokenizer.encode(prompt).ids)


def test_streaming_deltas_join_to_the_whole_text(client, offline):
    want = alone(offline, PROMPT, temperature=0, max_tokens=16)
    chunks = list(client.completions.create(model="shakespeare", prompt=PROMPT, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    *deltas, usage = chunks
    assert all(c.object == "text_completion" and len(c.choices) == 1 for c in deltas)
    assert "".join(c.choices[0].text for c in deltas) == want.outputs[0].text
    assert [c.choices[0].finish_reason for c in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert len(deltas) > 3, "the text must arrive in pieces"
    assert usage.choices == [] and usage.usage.completion_tokens == 16
    assert usage.usage.prompt_tokens == len(want.prompt_token_ids)

    messages = [{"role": "user", "content": "What light through yonder window breaks?"}]
    want = greedy(offline, render_chat(offline.engine.chat_template, messages), 16)
    chunks = list(client.chat.completions.create(model="shakespeare", messages=messages, max_tokens=16,
                                                 temperature=0, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_is_terminated_by_done(http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])


def test_n2_samples_are_the_offline_samples(client, offline):
    want = alone(offline, PROMPT, temperature=1.0, top_k=50, max_tokens=10, n=2, seed=7)
    got = client.completions.create(model="shakespeare", prompt=PROMPT, max_tokens=10, n=2, seed=7,
                                    extra_body={"top_k": 50})
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [o.text for o in want.outputs]
    assert got.choices[0].text != got.choices[1].text
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)
    # streamed: each choice's deltas join to its text and it ends with its own finish_reason
    texts, reasons = ["", ""], [None, None]
    for chunk in client.completions.create(model="shakespeare", prompt=PROMPT, max_tokens=10, n=2, seed=7,
                                           extra_body={"top_k": 50}, stream=True):
        [c] = chunk.choices
        assert reasons[c.index] is None, "nothing may follow a choice's last chunk"
        texts[c.index] += c.text
        reasons[c.index] = c.finish_reason
    assert texts == [o.text for o in want.outputs]
    assert reasons == [o.finish_reason for o in want.outputs]


def test_stop_strings_cut_the_text(client, offline):
    full = greedy(offline, PROMPT, 30)
    stop = full[12:16]
    want = full[:full.find(stop)]
    got = client.completions.create(model="shakespeare", prompt=PROMPT, max_tokens=30, temperature=0,
                                    stop=[stop, "zzz"])
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="shakespeare", prompt=PROMPT, max_tokens=30, temperature=0, stop=stop,
                                         stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client, offline):
    want = alone(offline, PROMPT, temperature=0, max_tokens=8, logprobs=3).outputs[0]
    got = client.completions.create(model="shakespeare", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert "".join(lp.tokens) == got.choices[0].text == want.text
    assert lp.token_logprobs == pytest.approx([t.logprob for t in want.logprobs], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[token] == value == max(top.values())   # greedy: the best token
    # streamed, the same log-probabilities arrive with the deltas
    chunks = list(client.completions.create(model="shakespeare", prompt=PROMPT, max_tokens=8, temperature=0,
                                            logprobs=0, stream=True))
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_chat_logprobs(client):
    got = client.chat.completions.create(model="shakespeare", messages=[{"role": "user", "content": "Speak."}],
                                         max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == got.choices[0].message.content
    for t in content:
        assert bytes(t.bytes).decode() == t.token and t.logprob <= 0
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.logprob >= t.top_logprobs[1].logprob


def test_beam_search_extra_field(client, offline):
    want = alone(offline, PROMPT, max_tokens=8, num_beams=3, n=2)
    for extra in ({"use_beam_search": True, "best_of": 3}, {"num_beams": 3}):
        got = client.completions.create(model="shakespeare", prompt=PROMPT, max_tokens=8, n=2, extra_body=extra)
        assert [c.text for c in got.choices] == [o.text for o in want.outputs]
    assert want.outputs[0].cumulative_logprob >= want.outputs[1].cumulative_logprob


# == bad input ====================================================================================

P = {"prompt": PROMPT, "max_tokens": 4}
M = {"messages": [{"role": "user", "content": "Hail."}], "max_tokens": 4}
BAD = [
    # (endpoint, body, status, param)
    ("completions", {**P, "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {**P, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {**P, "max_tokens": 2.5}, 400, "max_tokens"),
    ("completions", {**P, "max_tokens": "4"}, 400, "max_tokens"),
    ("completions", {**P, "temperature": -0.5}, 400, "temperature"),
    ("completions", {**P, "top_p": 0}, 400, "top_p"),
    ("completions", {**P, "top_p": 1.5}, 400, "top_p"),
    ("completions", {**P, "n": 0}, 400, "n"),
    ("completions", {**P, "n": 17}, 400, "n"),
    ("completions", {**P, "logprobs": 21}, 400, "logprobs"),
    ("completions", {**P, "prompt": ""}, 400, "prompt"),
    ("completions", {**P, "prompt": []}, 400, "prompt"),
    ("completions", {**P, "prompt": [PROMPT, ""]}, 400, "prompt"),   # the second prompt is empty
    ("completions", {**P, "prompt": [10**6]}, 400, "prompt"),
    ("completions", {"max_tokens": 4}, 400, "prompt"),
    ("completions", {**P, "stop": [""]}, 400, "stop"),
    ("completions", {**P, "use_beam_search": True, "best_of": 2, "n": 3}, 400, "n"),
    ("chat/completions", {**M, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
    ("chat/completions", {**M, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {**M, "messages": []}, 400, "messages"),
    ("chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("chat/completions", {**M, "messages": [{"role": "wizard", "content": "Abracadabra"}]}, 400, "messages"),
    ("chat/completions", {**M, "max_tokens": -3}, 400, "max_tokens"),
    ("completions", {**P, "model": "gpt-5"}, 404, "model"),
    ("chat/completions", {**M, "model": "gpt-5"}, 404, "model"),
]


@pytest.mark.parametrize("endpoint, body, status, param", BAD,
                         ids=[f"{i}-{e}-{p}" for i, (e, _, _, p) in enumerate(BAD)])
def test_bad_input_gets_the_error_envelope(http, endpoint, body, status, param):
    r = http.post(f"/v1/{endpoint}", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if status == 404:
        assert error["code"] == "model_not_found"
    assert http.post("/v1/completions", json=P).status_code == 200, "the next valid request must succeed"


def test_malformed_json_and_too_long(live, http, client):
    for raw in (b'{"prompt": "ROMEO:", ', b"not json", b""):
        r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = http.post("/v1/completions", json={**P, "max_tokens": 1000})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert f"maximum context length is {live[0].max_model_len} tokens" in error["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model="shakespeare", messages=M["messages"], max_tokens=10_000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="ROMEO:")
    assert http.get("/v1/nowhere").json()["error"]["type"] == "not_found_error"
    assert client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=3).usage.completion_tokens == 3


def test_api_key():
    engine = make_engine(16)
    with serve_in_thread(create_app(engine, api_key=API_KEY), log_level="warning") as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = httpx.post(url + "/v1/completions", json=P, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert httpx.get(url + "/health").status_code == 200     # health and metrics stay open
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        assert good.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=3).usage.completion_tokens == 3
        assert "Authorization: Bearer $API_KEY" in banner(engine, "127.0.0.1", 8000, with_key=True)


def test_banner_shows_curl_and_openai(live):
    text = banner(live[0], "127.0.0.1", 8000, with_key=False)
    assert "http://127.0.0.1:8000/v1" in text and "curl http://127.0.0.1:8000/v1/completions" in text
    assert 'OpenAI(base_url="http://127.0.0.1:8000/v1"' in text and "chat.completions" in text


# == disconnects and load =========================================================================

def test_client_abort_frees_its_blocks(live, client):
    engine, app, _ = live
    wait_idle(app)
    aborted = engine.stats.requests_aborted
    stream = client.completions.create(model="shakespeare", prompt=PROMPT, max_tokens=300, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text and first.choices[0].finish_reason is None
    deadline = time.monotonic() + 5
    while app.state.runner.snapshot.blocks_used == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert app.state.runner.snapshot.blocks_used > 0
    stream.close()
    wait_idle(app)
    assert engine.stats.requests_aborted == aborted + 1
    assert not engine.requests


def test_client_gone_before_a_whole_response_aborts(live, http):
    engine, app, url = live
    wait_idle(app)
    aborted = engine.stats.requests_aborted
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={**P, "max_tokens": 500, "ignore_eos": True}, timeout=0.3)
    wait_idle(app)
    assert engine.stats.requests_aborted == aborted + 1


PROMPTS = [f"{who}:\n{line}" for who in ("ROMEO", "JULIET", "HAMLET", "KING LEAR", "LADY MACBETH")
           for line in ("But soft, what light", "O, that this too too solid flesh would melt",
                        "Is this a dagger which I see before me", "Now is the winter of our discontent",
                        "Friends, Romans, countrymen, lend me your ears")]


def test_200_concurrent_streams(live, offline):
    """200 greedy streams at once in a 32-block pool (preemptions), 25 prompts of 8-16 tokens
    each: every stream complete, exactly its text, every block free at the end."""
    engine, app, url = live
    wait_idle(app)
    preemptions = engine.scheduler.num_preemptions
    lengths = [8 + i % 9 for i in range(len(PROMPTS))]
    want = [greedy(offline, p, n, ignore_eos=True) for p, n in zip(PROMPTS, lengths)]

    async def one(client, i):
        k = i % len(PROMPTS)
        stream = await client.completions.create(
            model="shakespeare", prompt=PROMPTS[k], max_tokens=lengths[k], temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, reasons, usage = "", [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.text
                reasons.append(c.finish_reason)
        return k, text, reasons, usage

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(200))), timeout=240)

    start = time.perf_counter()
    results = asyncio.run(all_of_them())
    seconds = time.perf_counter() - start
    assert len(results) == 200
    for k, text, reasons, usage in results:
        assert text == want[k], f"prompt {k}"
        assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
        assert usage.completion_tokens == lengths[k]
    wait_idle(app)
    assert engine.manager.num_used_blocks == 0 and not engine.requests
    assert engine.scheduler.num_preemptions > preemptions, "the pool was meant to be too small"
    metrics = {s.name: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
               for s in f.samples}
    assert metrics["minillm_num_preemptions_total"] == engine.scheduler.num_preemptions > 0
    assert metrics["minillm_kv_blocks_used"] == 0 and metrics["minillm_num_requests_running"] == 0
    assert metrics["minillm_time_to_first_token_seconds_count"] >= 200
    assert metrics["minillm_e2e_request_latency_seconds_count"] >= 200
    assert metrics["minillm_prefix_cache_hit_rate"] > 0
    print(f"200 streams in {seconds:.1f} s, {engine.scheduler.num_preemptions - preemptions} preemptions")
