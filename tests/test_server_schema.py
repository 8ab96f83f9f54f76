"""Chapter 9: the server against its own OpenAPI document (schemathesis).

schemathesis reads ``/openapi.json`` from a live server on loopback and, for every operation,
generates requests that fit the schema (positive) and requests that break it (negative), then
checks each response: never a 5xx, a status the document lists, the content type it lists,
a body that matches the listed schema (OpenAI's error envelope for 400/404/413/...), and
schema-breaking requests refused. It does not require every schema-valid request to succeed:
some fail on what only the model knows (an empty prompt, a context too long), with a 400 the
document lists. The engine runs with a short context and ``max_n=4`` and the examples are few,
so the whole file takes well under a minute on two CPU cores.
"""
from __future__ import annotations

import time

import pytest
import torch

schemathesis = pytest.importorskip("schemathesis")
uvicorn = pytest.importorskip("uvicorn")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from minillm.engine import BUNDLED_MODEL, EngineConfig, LLMEngine  # noqa: E402
from minillm.server import create_app  # noqa: E402
from minillm.testing import serve_in_thread  # noqa: E402

try:
    from schemathesis.specs.openapi.checks import positive_data_acceptance
except ImportError:  # pragma: no cover - schemathesis moved it
    positive_data_acceptance = None


@pytest.fixture(scope="module")
def url():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(BUNDLED_MODEL, EngineConfig(device="cpu", num_blocks=32, max_model_len=48,
                                                                    max_n=4, max_num_seqs=16, seed=0))
    app = create_app(engine, max_body_bytes=2**20)
    with serve_in_thread(app) as url:
        yield url
    torch.set_num_threads(before)


def test_openapi_documents_the_error_responses(url):
    import httpx

    doc = httpx.get(url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "500", "503"} <= set(responses), responses
        assert "422" not in responses       # the server answers validation errors with 400
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert "text/event-stream" in responses["200"]["content"]
    for path in ("/tokenize", "/detokenize"):
        assert {"200", "400", "413"} <= set(doc["paths"][path]["post"]["responses"])
    assert {"/version", "/health", "/metrics", "/v1/models"} <= set(doc["paths"])


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis(url, mode):
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    generation = schemathesis.GenerationMode.POSITIVE if mode == "positive" else schemathesis.GenerationMode.NEGATIVE
    excluded = [positive_data_acceptance] if positive_data_acceptance is not None else []
    ran = {}
    start = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        examples = 40 if operation.method.upper() == "POST" else 2
        calls = []

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=generation))
        def check(case):
            response = case.call_and_validate(base_url=url, timeout=60, excluded_checks=excluded)
            calls.append(response.status_code)

        try:
            check()
        except Unsatisfiable:   # no way to break the schema of an operation without parameters
            assert mode == "negative" and operation.method.upper() == "GET", operation.label
        ran[operation.label] = calls
    seconds = time.monotonic() - start
    assert all(status < 500 for calls in ran.values() for status in calls)
    assert sum(len(c) for c in ran.values()) > 20
    print(f"schemathesis ({mode}): {sum(len(c) for c in ran.values())} requests in {seconds:.1f} s")
