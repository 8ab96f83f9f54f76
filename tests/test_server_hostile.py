"""Chapter 9: the server against hostile requests (regressions of what users and a fuzzer found).

A live uvicorn server on loopback with the bundled model on the CPU. Every request below once
broke something: a tiny temperature or ``top_p``, or a huge beam ``length_penalty``, made the
engine step raise and failed every request in flight; a lone surrogate was a plain-text 500; a
50 MB prompt was tokenized on the engine thread for two minutes; errors came out of the
envelope. Now each is answered alone (200 or 400), the requests beside it finish exactly as
they would have alone, and a request whose own step still raises (injected here) fails alone.
"""
from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minillm.engine import BUNDLED_MODEL, EngineConfig, LLMEngine  # noqa: E402
from minillm.engine.engine import LLMEngine as EngineClass  # noqa: E402
from minillm.server import create_app  # noqa: E402
from minillm.server.tokens import PromptBound, max_token_bytes  # noqa: E402
from minillm.testing import serve_in_thread, wait_idle  # noqa: E402

PROMPT = "ROMEO:\nBut soft, what light"
MESSAGES = [{"role": "user", "content": "Hail."}]
POISON = 666   # the seed of the requests whose sampling is made to raise


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one torch thread for the module


@pytest.fixture(scope="module")
def live():
    engine = LLMEngine.from_pretrained(BUNDLED_MODEL, EngineConfig(device="cpu", num_blocks=64, seed=0))
    app = create_app(engine)
    with serve_in_thread(app) as url:
        yield engine, app, url


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live[2], timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live[2] + "/v1", api_key="none", max_retries=0, timeout=60)


def metric_values(http) -> dict:
    """``{(name, labels...): value}`` of ``/metrics``."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def failed_total(http) -> float:
    return metric_values(http)[("minillm_requests_failed_total",)]


def assert_envelope(r: httpx.Response, status: int, type: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"] == type
    return error


def greedy_text(client, max_tokens=6, prompt=PROMPT) -> str:
    return client.completions.create(model="shakespeare", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0).choices[0].text


class Background(threading.Thread):
    """A greedy stream read in a thread while hostile requests come in: its text must be the
    solo text."""

    def __init__(self, url: str, max_tokens: int = 48):
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.events, self.error = url, max_tokens, [], None
        self.started_streaming = threading.Event()
        self.start()

    def run(self):
        try:
            body = {"prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line.removeprefix("data: ")
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.started_streaming.set()
        except BaseException as e:  # noqa: BLE001
            self.error = e
        finally:
            self.started_streaming.set()

    def text(self) -> str:
        assert self.error is None and self.events[-1] == "[DONE]", (self.error, self.events[-2:])
        assert not any("error" in e for e in self.events[:-1] if isinstance(e, dict)), self.events
        return "".join(e["choices"][0]["text"] for e in self.events[:-1])


# == the table's rows ===========================================================================

@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 5e-324, 1e-6])
def test_tiny_temperature_is_greedy_and_hurts_no_one(live, client, http, temperature):
    engine, app, url = live
    solo = greedy_text(client, 48)
    before = failed_total(http)
    bystander = Background(url)
    assert bystander.started_streaming.wait(30)
    got = client.completions.create(model="shakespeare", prompt="a", max_tokens=4, temperature=temperature)
    assert got.choices[0].text == greedy_text(client, 4, "a")
    bystander.join(60)
    assert bystander.text() == solo
    assert failed_total(http) == before


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
def test_tiny_top_p_keeps_the_most_likely_token(live, client, http, top_p):
    bystander = Background(live[2])
    assert bystander.started_streaming.wait(30)
    got = client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=4, top_p=top_p, seed=3)
    assert got.choices[0].text == greedy_text(client, 4, "ROMEO:")
    bystander.join(60)
    assert bystander.text() == greedy_text(client, 48)


@pytest.mark.parametrize("length_penalty", [400, -400, 1e308, -1e308, 0])
def test_beam_length_penalty_of_any_size(live, client, http, length_penalty):
    before = failed_total(http)
    bystander = Background(live[2])
    assert bystander.started_streaming.wait(30)
    got = client.completions.create(model="shakespeare", prompt=PROMPT, max_tokens=8, n=2,
                                    extra_body={"use_beam_search": True, "best_of": 3,
                                                "length_penalty": length_penalty})
    assert len(got.choices) == 2 and all(c.finish_reason in ("stop", "length") for c in got.choices)
    bystander.join(60)
    assert bystander.text() == greedy_text(client, 48)
    assert failed_total(http) == before


LONE = [
    ("completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    ("completions", {"prompt": ["ok", "x\udfff"], "max_tokens": 2}, "prompt"),
    ("completions", {"prompt": PROMPT, "stop": ["\ud83d"], "max_tokens": 2}, "stop"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 2}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages"),
]


@pytest.mark.parametrize("endpoint, body, param", LONE, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(LONE)])
def test_lone_surrogate_is_a_400(http, endpoint, body, param):
    raw = json.dumps(body).encode()   # ensure_ascii: the surrogate travels as "\ud800", valid JSON
    r = http.post(f"/v1/{endpoint}", content=raw, headers={"content-type": "application/json"})
    error = assert_envelope(r, 400)
    assert error["param"] == param and error["code"] == "invalid_unicode"
    r = http.post("/tokenize", content=json.dumps({"prompt": "\ud800"}).encode(),
                  headers={"content-type": "application/json"})
    assert assert_envelope(r, 400)["code"] == "invalid_unicode"


def raw_request(url: str, head: bytes, body_parts=()) -> tuple[int, dict, bytes]:
    """Send ``head`` and ``body_parts`` on a plain socket, then read the response (closed by the
    server). A client that sends a body the server refuses to read races the server's close
    (a reset can eat the response), so these tests send only what the server will read."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head)
        for part in body_parts:
            s.sendall(part)
        data = b""
        while b"\r\n\r\n" not in data and (chunk := s.recv(65536)):
            data += chunk
        head_bytes, _, body = data.partition(b"\r\n\r\n")
        status_line, *lines = head_bytes.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        while len(body) < int(headers["content-length"]) and (chunk := s.recv(65536)):
            body += chunk
    return int(status_line.split()[1]), headers, body


def test_50mb_prompt_is_refused_at_once(live, http):
    """A request announcing a 50 MB body gets 413 before a byte of it is read."""
    start = time.perf_counter()
    status, headers, body = raw_request(live[2], b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                 b"Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n")
    assert time.perf_counter() - start < 5
    assert status == 413 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert http.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}).status_code == 200


def test_chunked_body_over_the_limit_is_413(live, http):
    """A chunked upload (no Content-Length) is refused as soon as it passes the limit."""
    limit = 8 * 2**20
    chunk = b" " * 2**20
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 8 + [b"1\r\n \r\n"]   # limit + 1 bytes, then nothing
    status, _, body = raw_request(live[2], b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                           b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
                                  parts)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert sum(len(chunk) for _ in range(8)) + 1 == limit + 1
    assert http.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}).status_code == 200


class CountingTokenizer:
    """The engine's tokenizer, counting the characters it is asked to encode."""

    def __init__(self, tokenizer):
        self.wrapped, self.chars = tokenizer, []

    def encode(self, text, *args, **kwargs):
        self.chars.append(len(text))
        return self.wrapped.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


def test_huge_prompt_under_a_big_limit_is_refused_before_tokenizing():
    """With the body limit raised to 64 MiB, a 50 MB prompt passes it, and is still refused
    (400, context_length_exceeded) without being tokenized, quickly."""
    engine = LLMEngine.from_pretrained(BUNDLED_MODEL, EngineConfig(device="cpu", num_blocks=32, seed=0))
    spy = CountingTokenizer(engine.tokenizer)
    app = create_app(engine, max_body_bytes=64 * 2**20)
    with serve_in_thread(app) as url:
        try:
            engine.tokenizer = spy
            with httpx.Client(base_url=url, timeout=60) as http:
                for endpoint, body in (("completions", {"prompt": "é" * 25_000_000, "max_tokens": 2}),
                                       ("chat/completions", {"messages": [{"role": "user", "content": "a" * 50_000_000}]})):
                    start = time.perf_counter()
                    r = http.post(f"/v1/{endpoint}", json=body)
                    seconds = time.perf_counter() - start
                    error = assert_envelope(r, 400)
                    assert error["code"] == "context_length_exceeded", error
                    assert seconds < 15, f"{endpoint}: {seconds:.1f} s"
                assert all(n < 100_000 for n in spy.chars), spy.chars
                r = http.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2})
                assert r.status_code == 200
        finally:
            engine.tokenizer = spy.wrapped


def test_short_request_latency_while_big_prompts_are_refused(live, http):
    """A short request stays fast while multi-megabyte prompts (under the body limit, over the
    context) are being refused beside it: nothing tokenizes them, nothing on the engine thread
    waits for them."""
    url = live[2]
    body = {"prompt": "ROMEO:", "max_tokens": 2, "temperature": 0}

    def latency() -> float:
        start = time.perf_counter()
        assert http.post("/v1/completions", json=body).status_code == 200
        return time.perf_counter() - start

    solo = statistics.median(latency() for _ in range(5))
    big = json.dumps({"prompt": "ROMEO: " * 900_000, "max_tokens": 2}).encode()   # 6.3 MB
    stop = threading.Event()
    refused = []

    def hammer():
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(8):
                if stop.is_set():
                    break
                r = c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
                refused.append(r.status_code)

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    try:
        during = [latency() for _ in range(10)]
    finally:
        stop.set()
        thread.join(60)
    assert refused and set(refused) == {400}
    assert max(during) < max(2.0, 25 * solo), f"solo {solo * 1e3:.0f} ms, during {max(during) * 1e3:.0f} ms"


def test_error_envelope_everywhere(live, http, monkeypatch):
    # a bug in a route: a 500, still in the envelope
    from minillm.server import responses

    def broken(self, output):
        raise RuntimeError("a bug")

    monkeypatch.setattr(responses.Formatter, "response", broken)
    key = ("minillm_http_responses_total", ("method", "POST"), ("route", "/v1/completions"), ("status", "500"))
    before = metric_values(http).get(key, 0)
    error = assert_envelope(http.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}), 500,
                            "server_error")
    assert "a bug" in error["message"]
    assert metric_values(http)[key] == before + 1
    monkeypatch.undo()
    # undecodable bodies
    for raw in (b'{"prompt": "\xff\xfe", "max_tokens": 2}', b'{"prompt": "\xed\xa0\x80"}', b"\x80"):
        r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_envelope(r, 400)
    # NaN and Infinity are JSON to Python, not to the API
    for raw in (b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "a", "length_penalty": Infinity}'):
        r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_envelope(r, 400)
    # 405 names the allowed methods
    r = http.get("/v1/completions")
    assert_envelope(r, 405)
    assert r.headers["allow"] == "POST"
    r = http.delete("/v1/models")
    assert_envelope(r, 405)
    assert r.headers["allow"] == "GET"
    assert_envelope(http.get("/nowhere"), 404, "not_found_error")
    assert http.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}).status_code == 200


# == every numeric field ========================================================================

P = {"prompt": PROMPT, "max_tokens": 3}
HOSTILE = [
    # (body, statuses allowed)
    ({**P, "temperature": 1e308}, {200}),
    ({**P, "temperature": 0.0, "top_p": 5e-324}, {200}),
    ({**P, "top_k": 10**30}, {200}),
    ({**P, "top_k": 2**63}, {200}),
    ({**P, "n": 10**30}, {400}),
    ({**P, "best_of": 10**30}, {400}),
    ({**P, "num_beams": 10**30}, {400}),
    ({**P, "use_beam_search": True, "best_of": 16, "n": 16, "max_tokens": 2}, {200}),
    ({**P, "max_tokens": 10**30}, {400}),
    ({**P, "max_tokens": 2**63}, {400}),
    ({**P, "seed": -1}, {400}),
    ({**P, "seed": 2**62}, {200}),
    ({**P, "seed": 2**64}, {400}),
    ({**P, "seed": 10**40}, {400}),
    ({**P, "logprobs": 20}, {200}),
    ({**P, "logprobs": 10**30}, {400}),
    ({**P, "stop": ["x"] * 65}, {400}),
    ({**P, "stop": ["x" * 2000]}, {400}),
    ({**P, "stop": ["x" * 1000] * 64}, {200}),
    ({**P, "stop_token_ids": list(range(2000))}, {400}),
    ({**P, "stop_token_ids": [-1]}, {400}),
    ({**P, "stop_token_ids": [10**30]}, {400}),
    ({**P, "use_beam_search": True, "best_of": 16, "stop_token_ids": list(range(1000))}, {400}),
    ({**P, "use_beam_search": True, "best_of": 4, "length_penalty": -1e308}, {200}),
    ({**P, "prompt": [0] * 100_000}, {400}),
    ({**P, "prompt": [2**63]}, {400}),
    ({**P, "prompt": [-1]}, {400}),
    ({**P, "presence_penalty": 2, "frequency_penalty": -2}, {200}),
    ({**P, "repetition_penalty": 1e-300}, {200, 400}),
    ({**P, "repetition_penalty": 1e308}, {200}),
    ({**P, "logit_bias": {"0": 1e308, "5": -1e308}}, {200, 400}),
    ({**P, "logit_bias": {str(10**30): 1}}, {400}),
    ({**P, "min_p": 1.0}, {200}),
    ({**P, "min_tokens": 10**30}, {400}),
    ({**P, "temperature": 1e-30, "min_p": 0.5, "top_k": 1, "top_p": 1e-300}, {200}),
]


@pytest.mark.parametrize("body, allowed", HOSTILE, ids=[f"{i}-{'-'.join(k for k in b if k not in P)}"
                                                         for i, (b, _) in enumerate(HOSTILE)])
def test_every_numeric_field_is_guarded(live, http, body, allowed):
    before = failed_total(http)
    r = http.post("/v1/completions", json=body)
    assert r.status_code in allowed, r.text
    if r.status_code == 400:
        assert_envelope(r, 400)
    assert failed_total(http) == before, "a request failed inside the engine"


# == isolation ==================================================================================

def poison_sampling(monkeypatch):
    """Make the sampling of requests with ``seed == POISON`` raise inside the engine step."""
    original = EngineClass.advance_samples

    def advance(self, request, *args, **kwargs):
        if request.params.seed == POISON:
            raise RuntimeError("poisoned sampling")
        return original(self, request, *args, **kwargs)

    monkeypatch.setattr(EngineClass, "advance_samples", advance)


def poison_batch(monkeypatch):
    """Make a batched part of sampling raise whenever a poisoned request is in the batch (the
    engine must then find the culprit by sampling one request at a time)."""
    original = EngineClass.sample

    def sample(self, sched, logits, *args, **kwargs):
        if any(r.params.seed == POISON and r.ready_to_sample() for r in sched.requests):
            raise RuntimeError("poisoned batch")
        return original(self, sched, logits, *args, **kwargs)

    monkeypatch.setattr(EngineClass, "sample", sample)


GOOD = [
    {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True},
    {"prompt": "JULIET:\nO Romeo", "max_tokens": 20, "temperature": 1.0, "top_k": 50, "seed": 7, "n": 2},
    {"prompt": "HAMLET:\nTo be", "max_tokens": 16, "temperature": 0.8, "seed": 11, "ignore_eos": True},
]
BAD = {"prompt": "KING LEAR:\nBlow, winds", "max_tokens": 16, "temperature": 1.0, "seed": POISON}


async def stream_texts(client: httpx.AsyncClient, body: dict) -> tuple[list, dict | None]:
    """A streamed completion: the texts per choice and the error event, if any (``[DONE]`` must end it)."""
    texts, error, last = {}, None, None
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            last = line.removeprefix("data: ")
            if last == "[DONE]":
                continue
            event = json.loads(last)
            if "error" in event:
                error = event["error"]
            for c in event.get("choices", ()):
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert last == "[DONE]"
    return [texts[i] for i in sorted(texts)], error


@pytest.mark.parametrize("poison", [poison_sampling, poison_batch], ids=["own-sampling", "batched-sampling"])
def test_a_failing_request_fails_alone(live, http, monkeypatch, poison):
    engine, app, url = live
    solo = [[c["text"] for c in http.post("/v1/completions", json=g).json()["choices"]] for g in GOOD]
    before = failed_total(http)
    poison(monkeypatch)

    async def everything():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async def bad_whole():
                await asyncio.sleep(0.05)
                return await c.post("/v1/completions", json=BAD)

            async def bad_stream():
                await asyncio.sleep(0.1)
                return await stream_texts(c, BAD)

            return await asyncio.gather(*(stream_texts(c, g) for g in GOOD), *(stream_texts(c, g) for g in GOOD),
                                        bad_whole(), bad_stream(), bad_whole())

    *good, whole, (_, stream_error), whole2 = asyncio.run(asyncio.wait_for(everything(), 120))
    for (texts, error), want in zip(good, solo + solo):
        assert error is None and texts == want
    for r in (whole, whole2):
        assert assert_envelope(r, 500, "server_error")["code"] == "request_failed"
        assert r.headers["x-should-retry"] == "false"     # the openai client would not retry it
    assert stream_error["code"] == "request_failed" and stream_error["type"] == "server_error"
    wait_idle(app)       # the snapshot /metrics reads is taken just after the failures are delivered
    assert failed_total(http) == before + 3
    assert not engine.requests and engine.manager.num_used_blocks == 0, "a failed request leaked blocks"
    monkeypatch.undo()
    assert [c["text"] for c in http.post("/v1/completions", json=GOOD[0]).json()["choices"]] == solo[0]


HOSTILE_ROWS = [
    {"prompt": "a", "max_tokens": 4, "temperature": 1e-45},
    {"prompt": "ROMEO:", "max_tokens": 4, "top_p": 1e-300},
    {"prompt": PROMPT, "max_tokens": 6, "n": 2, "use_beam_search": True, "best_of": 3, "length_penalty": 400},
    {"prompt": PROMPT, "max_tokens": 4, "repetition_penalty": 5e-324, "temperature": 1e-300},
]


def test_hostile_rows_beside_good_streams(live, http):
    """The table's hostile requests, sent while good streams (greedy and seeded samples) run:
    every good stream is exactly its solo output, every hostile request a 200."""
    url = live[2]
    solo = [[c["text"] for c in http.post("/v1/completions", json=g).json()["choices"]] for g in GOOD]
    before = failed_total(http)

    async def everything():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async def hostile(body, delay):
                await asyncio.sleep(delay)
                return await c.post("/v1/completions", json=body)

            return await asyncio.gather(*(stream_texts(c, g) for g in GOOD),
                                        *(hostile(b, 0.03 * i) for i, b in enumerate(HOSTILE_ROWS * 2)))

    results = asyncio.run(asyncio.wait_for(everything(), 120))
    good, hostile = results[:len(GOOD)], results[len(GOOD):]
    for (texts, error), want in zip(good, solo):
        assert error is None and texts == want
    assert [r.status_code for r in hostile] == [200] * len(hostile), [r.text for r in hostile if r.status_code != 200]
    assert failed_total(http) == before


def test_a_global_fault_ends_the_step_with_503_and_serving_goes_on(live, http, monkeypatch):
    engine, app, url = live
    original = engine.runner.forward
    armed = threading.Event()

    def forward(batch):
        if armed.is_set():
            armed.clear()
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(batch)

    monkeypatch.setattr(engine.runner, "forward", forward)
    bystander = Background(url, max_tokens=200)
    assert bystander.started_streaming.wait(30)
    armed.set()
    bystander.join(60)
    assert bystander.error is None and bystander.events[-1] == "[DONE]"
    error = bystander.events[-2]["error"]
    assert error["code"] == "engine_error" and "OutOfMemoryError" in error["message"]
    assert http.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3}).status_code == 200
    assert http.get("/health").status_code == 200


# == endpoints and metrics ======================================================================

def test_tokenize_detokenize_version(live, http, client):
    engine = live[0]
    r = http.post("/tokenize", json={"model": "shakespeare", "prompt": PROMPT})
    assert r.status_code == 200
    got = r.json()
    assert got == {"tokens": engine.tokenizer.encode(PROMPT).ids, "count": len(got["tokens"]),
                   "max_model_len": engine.max_model_len}
    assert http.post("/detokenize", json={"tokens": got["tokens"]}).json() == {"prompt": PROMPT}
    usage = client.completions.create(model="shakespeare", prompt=PROMPT, max_tokens=1).usage
    assert usage.prompt_tokens == got["count"]
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] == client.chat.completions.create(model="shakespeare", messages=MESSAGES,
                                                           max_tokens=1).usage.prompt_tokens
    assert_envelope(http.post("/detokenize", json={"tokens": [10**9]}), 400)
    assert_envelope(http.post("/detokenize", json={"tokens": [-1]}), 400)
    assert_envelope(http.post("/tokenize", json={"model": "gpt-5", "prompt": "a"}), 404, "not_found_error")
    assert_envelope(http.post("/tokenize", json={}), 400)
    version = http.get("/version").json()["version"]
    assert isinstance(version, str) and version


def test_vllm_metric_names(live, http, client):
    engine, app, _ = live
    client.completions.create(model="shakespeare", prompt=PROMPT, max_tokens=3, temperature=0)
    http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "model": "nope"})
    wait_idle(app)     # an earlier test's stream may still be decoding its last tokens
    values = metric_values(http)
    label = ("model_name", engine.model_name)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert (name, label) in values, name
    assert values[("vllm:generation_tokens_total", label)] == engine.stats.generation_tokens
    assert 0 <= values[("vllm:kv_cache_usage_perc", label)] <= 1
    assert values[("vllm:request_success_total", ("finished_reason", "length"), label)] >= 1
    status = {k[-1][1]: v for k, v in values.items() if k[0] == "minillm_http_responses_total"
              and ("route", "/v1/completions") in k}
    assert status["200"] >= 1 and status["404"] >= 1
    assert ("minillm_requests_aborted_total",) in values and ("minillm_requests_failed_total",) in values
    assert ("minillm_num_requests_running",) in values     # minillm's own names stay


# == the lower bound the early refusal relies on ==================================================

def test_prompt_bound_never_exceeds_the_token_count(live):
    """``PromptBound`` is a true lower bound for the bundled byte-level BPE tokenizer: every
    token covers at most ``max_token_bytes`` bytes (checked on the tokens that are longest,
    special tokens, multi-byte characters and random text)."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    tokenizer = live[0].tokenizer
    assert max_token_bytes(tokenizer) == len("NORTHUMBERLAND") == 14   # its longest token
    assert len(tokenizer.encode("NORTHUMBERLAND" * 10).ids) == 10           # so the bound is tight
    bound = PromptBound(tokenizer)

    @hypothesis.settings(max_examples=200, deadline=None, database=None)
    @hypothesis.given(st.lists(st.sampled_from(["NORTHUMBERLAND", "<|endoftext|>", " BOLINGBROKE", "é", "😀", "\n",
                                                "a", " the", "ROMEO:"]) | st.text(), max_size=40).map("".join),
                      st.integers(0, 600))
    def check(text, limit):
        assert bound.at_least(text, limit) <= len(tokenizer.encode(text).ids)

    check()
