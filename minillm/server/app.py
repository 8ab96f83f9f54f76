"""Chapter 9: the HTTP routes of the OpenAI-compatible server.

A request's path: FastAPI parses the JSON body into a `minillm.server.protocol` model; the
route checks the model name, builds the prompt (chat: the checkpoint's chat template) and the
`SamplingParams`, and hands both to the `AsyncEngine`, which answers once the engine has
accepted the request (or refused it: HTTP 400). Then either the route waits for the finished
output and returns one JSON body, or it returns a server-sent-event stream: one ``data:
{json}`` event per chunk (`minillm.server.responses`), an optional usage chunk, and ``data:
[DONE]``.

Every error is OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``: 400 for
a bad body (FastAPI's own 422 for validation errors becomes a 400 here, malformed JSON
included) or a request the engine refuses, 404 for an unknown model or path, 401 for a wrong
or missing API key (``/v1/*`` only; ``/health`` and ``/metrics`` stay open).

A request whose client goes away is aborted: its abort goes through the engine's inbox, and
its KV blocks are freed before the next step. A streamed response calls `RequestStream.abort`
however it ends (Starlette stops it when the client disconnects); a whole response polls
the connection while it waits.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from minillm.engine.config import InvalidRequest
from minillm.engine.engine import LLMEngine
from minillm.model.loader import render_chat
from minillm.server.async_engine import AsyncEngine, RequestStream
from minillm.server.metrics import CONTENT_TYPE_LATEST, Metrics
from minillm.server.protocol import ChatCompletionRequest, CompletionRequest
from minillm.server.responses import Formatter

__all__ = ["APIError", "create_app"]


class APIError(Exception):
    """An error answered in OpenAI's envelope."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def create_app(engine: LLMEngine, api_key: str | None = None) -> FastAPI:
    """The server around ``engine``; the engine thread runs while the app does (its lifespan).
    With ``api_key``, ``/v1/*`` requires the header ``Authorization: Bearer <api_key>``."""
    runner = AsyncEngine(engine)
    metrics = Metrics(lambda: runner.snapshot)
    runner.on_finished = metrics.observe

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start()
        try:
            yield
        finally:
            runner.stop()

    app = FastAPI(title="minillm", summary="An OpenAI-compatible server for the minillm engine", lifespan=lifespan)
    app.state.engine, app.state.runner, app.state.metrics = engine, runner, metrics
    _add_error_handlers(app)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name not in (None, engine.model_name):
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{engine.model_name}'.",
                           type="not_found_error", param="model", code="model_not_found")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "minillm", "max_model_len": engine.max_model_len}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompt = body.single_prompt()
        return await respond(prompt, body.to_sampling_params(), body, request, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if engine.chat_template is None:
            raise InvalidRequest(f"the model '{engine.model_name}' has no chat template: use /v1/completions",
                                 param="messages")
        try:
            text = render_chat(engine.chat_template, [m.as_dict() for m in body.messages])
        except TemplateError as e:
            raise InvalidRequest(f"the chat template refused these messages: {e}", param="messages") from None
        ids = engine.tokenizer.encode(text).ids
        return await respond(ids, body.to_sampling_params(len(ids), engine.max_model_len), body, request, chat=True)

    async def respond(prompt, params, body, request: Request, chat: bool):
        stream = await runner.add(prompt, params)
        fmt = Formatter(chat, engine.model_name, engine.tokenizer, stream.request_id)
        if body.stream:
            return EventStream(_events(stream, fmt, body.include_usage), on_close=stream.abort)
        try:
            output = await _result_unless_disconnected(stream, request)
            return Response(status_code=499) if output is None else fmt.response(output)
        finally:
            stream.abort()   # a no-op once finished

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if not runner.alive:
            raise APIError(503, "the engine thread is not running", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class EventStream(StreamingResponse):
    """A server-sent-event response that calls ``on_close`` however it ends: after ``[DONE]``,
    when the client disconnects (Starlette cancels the stream), or when the server stops."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _result_unless_disconnected(stream: RequestStream, request: Request, poll: float = 0.5):
    """The finished output; ``None`` if the client went away first (a non-streamed request
    has no send to fail, so the connection is polled)."""
    task = asyncio.ensure_future(stream.result())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll)
            if not task.done() and await request.is_disconnected():
                return None
        return task.result()
    finally:
        task.cancel()


def _sse(data: dict | str) -> str:
    """One server-sent event."""
    if not isinstance(data, str):
        data = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _events(stream: RequestStream, fmt: Formatter, include_usage: bool):
    output = None
    try:
        async for output in stream:
            for chunk in fmt.chunks(output):
                yield _sse(chunk)
    except Exception as e:  # the engine failed mid-stream: the status line is long gone
        yield _sse({"error": {"message": f"internal error: {e}", "type": "server_error", "param": None,
                              "code": None}})
    else:
        if include_usage:
            yield _sse(fmt.usage_chunk(output))
    yield _sse("[DONE]")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(InvalidRequest)
    async def invalid_request(request, exc: InvalidRequest):
        return APIError(400, exc.message, param=exc.param, code=exc.code).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            return APIError(400, f"The request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}",
                            code="invalid_json").response()
        loc = [str(part) for part in err["loc"] if part != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return APIError(400, f"{where}: {err['msg']}", param=param, code=err["type"]).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "server_error")
        return APIError(exc.status_code, str(exc.detail), type=kind).response()
