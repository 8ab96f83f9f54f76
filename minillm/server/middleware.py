"""Chapter 9: two ASGI middlewares around the app: a request-body size limit, and a count of
the responses by status code.

**The body limit** costs nothing to enforce. A request that announces a larger body
(``Content-Length``) gets its 413 before a byte of the body is read; a chunked upload, which
announces nothing, is counted while it streams in and refused as soon as it passes the limit,
so the server never holds more than the limit in memory for it.

**The response count** wraps ``send`` and counts the status of every ``http.response.start``,
labelled with the route's path template (``/v1/completions``; ``other`` for unknown paths, so
that a scanner cannot blow up the number of series).
"""
from __future__ import annotations

import json
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minillm.server.errors import envelope

__all__ = ["DEFAULT_MAX_BODY_BYTES", "BodySizeLimit", "BodyTooLarge", "CountResponses"]

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a streamed body passes the limit (FastAPI lets an
    ``HTTPException`` raised while reading the body through to the error handlers)."""

    def __init__(self, limit: int):
        super().__init__(413, f"The request body is larger than this server's limit of {limit} bytes.")


class BodySizeLimit:
    """Answer 413, in OpenAI's envelope, for a request body over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            return await self._too_large(send)
        total, started = 0, False

        async def counted_receive() -> Message:
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge:
            if started:
                raise
            await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        body = json.dumps(envelope(BodyTooLarge(self.max_bytes).detail, "invalid_request_error",
                                   code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class CountResponses:
    """Call ``count(method, route, status)`` for every HTTP response."""

    def __init__(self, app: ASGIApp, count: Callable[[str, str, int], None]):
        self.app, self.count = app, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.count(scope.get("method", ""), getattr(route, "path", None) or "other", message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
