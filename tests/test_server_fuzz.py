"""Chapter 9: property-based fuzzing of the server's request bodies (hypothesis).

Bodies for ``/v1/completions`` and ``/v1/chat/completions`` drawn from every field's hostile
values (0, subnormals, 1e308, NaN, 2**64, negative numbers, wrong types, lone surrogates,
empty and oversized lists), sent to a live server on loopback while greedy "bystander"
streams run beside them. The properties: no response is a 5xx; every error is OpenAI's
envelope; every 200 is a well-formed body or event stream ending in ``[DONE]``; no request
fails inside the engine; and every bystander's text is exactly its solo text. The example
count is bounded so that the file runs in well under a minute on two CPU cores.
"""
from __future__ import annotations

import json
import math
import threading
import time

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis")
uvicorn = pytest.importorskip("uvicorn")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minillm.engine import BUNDLED_MODEL, EngineConfig, LLMEngine  # noqa: E402
from minillm.server import create_app  # noqa: E402
from minillm.testing import serve_in_thread  # noqa: E402

PROMPT = "ROMEO:\nBut soft, what light"
BYSTANDER = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: one torch thread for the module


@pytest.fixture(scope="module")
def live():
    engine = LLMEngine.from_pretrained(BUNDLED_MODEL, EngineConfig(device="cpu", num_blocks=48, max_model_len=128,
                                                                    seed=0))
    app = create_app(engine, max_body_bytes=2**20)
    with serve_in_thread(app) as url:
        yield engine, app, url


# == strategies ==================================================================================

NASTY_FLOATS = [0.0, -0.0, 5e-324, 1e-300, 1e-45, 1e-38, 1e-6, 0.5, 1.0, 2.0, 100.0, 1e308, -1e308, -1.0,
                math.nan, math.inf, -math.inf]
NASTY_INTS = [-(2**63), -1, 0, 1, 2, 3, 16, 17, 20, 21, 4095, 4096, 2**31, 2**62, 2**63, 2**64, 10**30]
NASTY_STRINGS = ["", "a", "ROMEO:", "\n\n", "\x00", "\ud800", "a\udfffb", "é😀", "<|endoftext|>", "x" * 3000]

floats = st.sampled_from(NASTY_FLOATS) | st.floats(-1e6, 1e6)
ints = st.sampled_from(NASTY_INTS) | st.integers(-3, 24)
small_ints = st.integers(1, 6) | st.sampled_from([0, -1, 10**30, 2**63, 100_000])
strings = st.sampled_from(NASTY_STRINGS) | st.text(max_size=12)
wrong = st.sampled_from([None, True, "1", [], {}, [1, "a"], {"a": 1}])   # wrong types for any field


def maybe_wrong(strategy):
    return strategy | wrong


COMMON = {
    "max_tokens": maybe_wrong(small_ints),
    "temperature": maybe_wrong(floats),
    "top_p": maybe_wrong(floats),
    "top_k": maybe_wrong(ints),
    "n": maybe_wrong(st.integers(1, 4) | st.sampled_from([0, 17, 10**30])),
    "best_of": maybe_wrong(st.integers(1, 5) | st.sampled_from([0, 10**30])),
    "num_beams": maybe_wrong(st.integers(1, 5) | st.sampled_from([0, 10**30])),
    "use_beam_search": st.booleans(),
    "length_penalty": maybe_wrong(floats),
    "seed": maybe_wrong(ints),
    "stop": maybe_wrong(strings | st.lists(strings, max_size=4) | st.just(["x"] * 100)),
    "stop_token_ids": maybe_wrong(st.lists(ints, max_size=4) | st.just(list(range(3000)))),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
    # the sampling parameters
    "presence_penalty": maybe_wrong(floats),
    "frequency_penalty": maybe_wrong(floats),
    "repetition_penalty": maybe_wrong(floats),
    "min_p": maybe_wrong(floats),
    "min_tokens": maybe_wrong(ints),
    "logit_bias": maybe_wrong(st.dictionaries(st.sampled_from(["0", "1", "4095", "4096", "-1", "x", str(10**30)]),
                                              floats, max_size=3)),
    "include_stop_str_in_output": st.booleans(),
    "model": st.sampled_from([None, "shakespeare", "gpt-5", "\ud800"]),
}

# Values the schema accepts, extreme ones included: most bodies run, so that the engine sees them.
VALID = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.sampled_from([0.0, 5e-324, 1e-300, 1e-45, 1e-38, 1e-6, 0.7, 1.0, 2.0, 1e308]),
    "top_p": st.sampled_from([5e-324, 1e-300, 1e-45, 1e-6, 0.5, 0.9, 1.0]),
    "top_k": st.sampled_from([0, 1, 2, 50, 4095, 4096, 2**63, 10**30]),
    "n": st.integers(1, 3),
    "seed": st.sampled_from([0, 1, 7, 2**31, 2**62]),
    "use_beam_search": st.booleans(),
    "best_of": st.integers(1, 4),
    "length_penalty": st.sampled_from([-1e308, -400.0, -1.0, 0.0, 1.0, 400.0, 1e308]) | st.floats(-1e3, 1e3),
    "stop": st.lists(st.sampled_from(["\n", "e", "the", "ROMEO", "é😀", "x" * 1000]), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 4095), max_size=4),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.sampled_from([-2.0, -1e-300, 0.0, 2.0]),
    "frequency_penalty": st.sampled_from([-2.0, 5e-324, 0.0, 2.0]),
    "repetition_penalty": st.sampled_from([5e-324, 1e-300, 1e-6, 0.5, 1.0, 2.0, 1e308]),
    "min_p": st.sampled_from([0.0, 5e-324, 0.1, 0.99, 1.0]),
    "min_tokens": st.integers(0, 3),
    "logit_bias": st.dictionaries(st.sampled_from(["0", "1", "198", "4095"]),
                                  st.sampled_from([-1e308, -100.0, 0.0, 5.0, 100.0, 1e308]), max_size=3),
    "include_stop_str_in_output": st.booleans(),
}
valid_prompts = st.sampled_from(["ROMEO:", PROMPT, "a", "é😀", "<|endoftext|>", "\n"]) \
    | st.lists(st.integers(0, 4095), min_size=1, max_size=8)
prompts = (strings | st.lists(ints, max_size=8) | st.lists(strings, min_size=0, max_size=3)
           | st.lists(st.lists(st.integers(0, 4095), max_size=5), max_size=2) | wrong)
completion_bodies = (
    st.fixed_dictionaries({"prompt": valid_prompts},
                          optional={**VALID, "logprobs": st.integers(0, 20), "echo": st.booleans()})
    | st.fixed_dictionaries({"prompt": valid_prompts},
                            optional={**VALID, "logprobs": st.integers(0, 20), "prompt_logprobs": st.integers(0, 5)})
    | st.fixed_dictionaries({"prompt": prompts}, optional={**COMMON, "logprobs": maybe_wrong(ints),
                                                           "echo": st.booleans(), "prompt_logprobs": maybe_wrong(ints)}))

parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": strings}), max_size=2)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard", ""]),
                                           "content": strings | parts | st.none()}), max_size=3)
valid_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": st.sampled_from(["Hail.", "", "é😀", "ROMEO"])}),
                          min_size=1, max_size=3)
VALID_CHAT = {k: v for k, v in VALID.items() if k != "max_tokens"}
chat_bodies = (
    st.fixed_dictionaries({"messages": valid_messages, "max_tokens": st.integers(1, 6)},
                          optional={**VALID_CHAT, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)})
    | st.fixed_dictionaries({"messages": valid_messages, "max_tokens": st.integers(1, 6)},
                            optional={**VALID_CHAT, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)})
    | st.fixed_dictionaries({"messages": messages | wrong},
                            optional={**COMMON, "logprobs": st.booleans() | wrong, "top_logprobs": maybe_wrong(ints),
                                      "max_completion_tokens": maybe_wrong(small_ints)}))


# == the checks ==================================================================================

def check_response(r: httpx.Response, body: dict) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]", events[-2:]
        for e in events[:-1]:
            event = json.loads(e)
            assert "error" not in event, event
            assert "choices" in event
    else:
        got = r.json()
        assert got["choices"] and "usage" in got, got


class Bystanders(threading.Thread):
    """Greedy streams one after another until stopped; records each stream's text."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.texts, self.errors = url, [], []
        self.stopped = threading.Event()
        self.start()

    def run(self):
        with httpx.Client(base_url=self.url, timeout=60) as c:
            for _ in range(200):   # bounded
                if self.stopped.is_set():
                    return
                try:
                    r = c.post("/v1/completions", json=BYSTANDER)
                    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
                    assert events[-1] == "[DONE]", r.text[-300:]
                    self.texts.append("".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]))
                except Exception as e:  # noqa: BLE001
                    self.errors.append(repr(e))


FUZZ = settings(max_examples=100, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


def fuzz(live, endpoint: str, bodies) -> None:
    engine, app, url = live
    solo = httpx.post(url + "/v1/completions", json={**BYSTANDER, "stream": False}, timeout=60).json()
    solo_text = solo["choices"][0]["text"]
    failed = app.state.runner.num_failed
    bystanders = Bystanders(url)
    start = time.monotonic()
    statuses: dict[int, int] = {}
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            @FUZZ
            @given(bodies)
            def one(body):
                raw = json.dumps(body).encode()   # ensure_ascii, NaN and Infinity as Python writes them
                r = c.post(f"/v1/{endpoint}", content=raw, headers={"content-type": "application/json"})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                check_response(r, body)
                assert app.state.runner.num_failed == failed, f"a request failed inside the engine: {body}"

            one()
    finally:
        bystanders.stopped.set()
        bystanders.join(60)
    assert not bystanders.errors, bystanders.errors[:3]
    assert bystanders.texts and set(bystanders.texts) == {solo_text}
    deadline = time.monotonic() + 10
    while engine.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.requests and engine.manager.num_used_blocks == 0
    print(f"{endpoint}: {sum(statuses.values())} bodies in {time.monotonic() - start:.1f} s, statuses {statuses}, "
          f"{len(bystanders.texts)} bystander streams")


def test_fuzz_completions(live):
    fuzz(live, "completions", completion_bodies)


def test_fuzz_chat(live):
    fuzz(live, "chat/completions", chat_bodies)
