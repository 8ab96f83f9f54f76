"""Chapter 13: send one request to an instance and relay its answer, retrying elsewhere on failure.

`forward` tries the instances in the order the policy gave. An instance that refuses the
connection, drops it, or answers 503 (shutting down, or its engine failed) is marked down and
the request goes to the next one, as long as nothing of the answer has reached the client: a
whole (non-streamed) answer is read completely before it is relayed, and a stream is relayed
only once its first chunk has arrived. So a request fails only if every instance fails it, or
if its instance dies in the middle of a stream: then the client gets an error event in
OpenAI's envelope and ``data: [DONE]``, as the server itself does for a stream that breaks.

Any other answer, errors included (400, 404, 413, ...), is the instance's, relayed unchanged:
it already is in OpenAI's envelope. A stream is relayed chunk by chunk as httpx reads it
(``aiter_raw``), never buffered. Every answer carries the header ``x-minillm-instance`` (the
index of the instance that served it).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from minillm.router.instances import Instance, InstanceSet
from minillm.server.errors import envelope

__all__ = ["INSTANCE_HEADER", "forward", "unavailable"]

INSTANCE_HEADER = "x-minillm-instance"
_REQUEST_HEADERS = ("authorization", "content-type", "accept")
_RESPONSE_HEADERS = ("content-type", "cache-control", "retry-after", "x-should-retry", "allow")


def unavailable(message: str = "no engine instance is available: all are down or failed this request") -> Response:
    """The router's own 503, in OpenAI's envelope."""
    return JSONResponse(envelope(message, "server_error", code="service_unavailable"), status_code=503,
                        headers={"Retry-After": "1"})


def _headers(response: httpx.Response, instance: Instance) -> dict:
    out = {k: response.headers[k] for k in _RESPONSE_HEADERS if k in response.headers}
    out[INSTANCE_HEADER] = str(instance.index)
    return out


async def forward(pool: InstanceSet, client: httpx.AsyncClient, method: str, path: str, *,
                  content: bytes | None = None, headers=None, keys: Sequence[bytes] = (),
                  stream: bool = False, order: Sequence[Instance] | None = None) -> Response:
    """Send the request to the first instance of ``order`` that serves it; ``stream``: relay
    the answer as it comes. ``order=None``: a generation request, tried in the policy's order
    for ``keys`` and recorded in the instances' prefix indexes; else a side request
    (``/v1/models``), which is not."""
    sent_headers = {k: v for k, v in (headers or {}).items() if k.lower() in _REQUEST_HEADERS}
    last_503: tuple[bytes, dict] | None = None
    for instance in pool.order(keys) if order is None else order:
        pool.sent(instance, keys, generation=order is None)
        try:
            response = await client.send(client.build_request(method, instance.url + path, content=content,
                                                              headers=sent_headers), stream=True)
        except httpx.TransportError:
            pool.done(instance)
            pool.mark_down(instance)
            continue
        try:
            if stream and response.status_code == 200:
                chunks = response.aiter_raw()
                first = await anext(chunks, b"")
            else:
                body = await response.aread()
        except httpx.TransportError:   # it died before anything reached the client: try the next
            await response.aclose()
            pool.done(instance)
            pool.mark_down(instance)
            continue
        if response.status_code == 503:   # shutting down or broken: its health check will tell
            last_503 = (body, _headers(response, instance))
            await response.aclose()
            pool.done(instance)
            pool.mark_down(instance)
            continue
        if not (stream and response.status_code == 200):
            await response.aclose()
            pool.done(instance)
            return Response(body, status_code=response.status_code, headers=_headers(response, instance))
        return _Relay(_relay(first, chunks, lambda: pool.mark_down(instance)), _headers(response, instance),
                      on_close=_closer(pool, instance, response))
    if last_503 is not None:
        return Response(last_503[0], status_code=503, headers=last_503[1])
    return unavailable()


def _closer(pool: InstanceSet, instance: Instance, response: httpx.Response):
    closed = False

    async def close() -> None:
        nonlocal closed
        if not closed:
            closed = True
            pool.done(instance)
            await response.aclose()
    return close


async def _relay(first: bytes, chunks: AsyncIterator[bytes], on_fail) -> AsyncIterator[bytes]:
    if first:
        yield first
    try:
        async for chunk in chunks:
            yield chunk
    except httpx.TransportError as e:   # the instance died mid-stream: too late to retry
        on_fail()
        error = envelope(f"the engine instance serving this stream failed: {type(e).__name__}", "server_error",
                         code="instance_failed")
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


class _Relay(StreamingResponse):
    """A relayed stream that releases its instance however it ends (finished, client gone)."""

    def __init__(self, chunks, headers: dict, on_close):
        super().__init__(chunks, status_code=200, headers={k: v for k, v in headers.items() if k != "content-type"},
                         media_type=headers.get("content-type", "text/event-stream"))
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()
