"""Chapter 9: minillm's OpenAI-compatible server (FastAPI + uvicorn).

    minillm serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed with ``"stream":
true``), ``GET /v1/models``, vLLM's ``POST /tokenize`` and ``POST /detokenize``, ``GET /version``,
``GET /health``, ``GET /metrics`` (Prometheus, minillm's and vLLM's names). Any OpenAI client
works, e.g. ``OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")``. ``docs/server.md``
lists every endpoint and request field.

The modules, in the order a request meets them:

- `minillm.server.app`: the routes, the error envelope, the event stream.
- `minillm.server.protocol`: the request bodies, their checks, and the extra fields beyond
  the OpenAI API (``top_k``, ``ignore_eos``, ``stop_token_ids``, and beam search with
  ``"use_beam_search": true, "best_of": k``).
- `minillm.server.async_engine`: the engine loop in one background thread, an inbox in and a
  queue per request out.
- `minillm.server.responses`: engine outputs as OpenAI response bodies and stream chunks.
- `minillm.server.metrics`: ``/metrics``.
- `minillm.server.errors`, `minillm.server.middleware`, `minillm.server.tokens`: the error
  envelope, the body-size limit and response counts, the free prompt-length bound.
- `minillm.server.launch`, `minillm.server.shutdown`: ``minillm serve`` and its graceful
  shutdown.
"""
from minillm.server.app import create_app
from minillm.server.launch import serve

__all__ = ["create_app", "serve"]
