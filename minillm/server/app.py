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

The limits cost nothing: a body over ``max_body_bytes`` gets 413 before it is read
(`minillm.server.middleware`), a text prompt whose length alone proves it too long gets 400
before it is tokenized (`minillm.server.tokens`), and tokenizing, detokenizing and chat
templates run in a small thread pool, never on the event loop or the engine thread. A request
that fails inside the engine ends alone (500, or an error event in its stream); a fault of the
whole engine, or the server's shutdown, ends the requests in flight with 503. Any other
exception is a catch-all 500, still in the envelope; undecodable (non-UTF-8) bodies and lone
surrogates are 400s; a 405 carries ``Allow``. The OpenAPI document lists these responses.

Besides the OpenAI routes: ``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), ``GET
/version``, ``GET /health`` (503 while shutting down) and ``GET /metrics``.

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
from importlib import metadata
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator
from starlette.exceptions import HTTPException

from minillm.engine.config import InvalidRequest
from minillm.engine.engine import LLMEngine
from minillm.model.loader import render_chat
from minillm.server.async_engine import AsyncEngine, RequestStream
from minillm.server.errors import EngineError, ErrorResponse, envelope, finite
from minillm.server.metrics import CONTENT_TYPE_LATEST, Metrics
from minillm.server.multi_prompt import MultiStream
from minillm.server.middleware import DEFAULT_MAX_BODY_BYTES, BodySizeLimit, CountResponses
from minillm.server.protocol import ChatCompletionRequest, CompletionRequest
from minillm.server.responses import Formatter
from minillm.server.tokens import find_surrogate

__all__ = ["APIError", "VERSION", "create_app"]

try:
    VERSION = metadata.version("minillm")
except metadata.PackageNotFoundError:   # run from a checkout that was never installed
    VERSION = "0+unknown"


class APIError(Exception):
    """An error answered in OpenAI's envelope."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(envelope(self.message, self.type, self.param, self.code), status_code=self.status,
                            headers=headers)


class SafeJSONResponse(JSONResponse):
    """JSON that stays JSON: a non-finite float (a ``-inf`` log-probability) is written as
    `minillm.server.errors.finite` says instead of failing the response."""

    def render(self, content) -> bytes:
        try:
            return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        except ValueError:
            return json.dumps(finite(content), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _errors(*statuses: int) -> dict:
    """OpenAPI ``responses=`` for these error statuses, each in OpenAI's envelope."""
    what = {400: "The request is invalid (OpenAI's invalid_request_error).", 401: "A wrong or missing API key.",
            404: "Unknown model.", 413: "The request body is larger than the server's limit.",
            500: "The request failed inside the server.",
            503: "The server is shutting down, or its engine failed: retry later."}
    return {s: {"model": ErrorResponse, "description": what[s]} for s in statuses}


_STREAMABLE = {200: {"description": "The whole response (JSON), or with \"stream\": true a server-sent-event "
                                    "stream of chunks ending with `data: [DONE]`.",
                     "content": {"application/json": {}, "text/event-stream": {"schema": {"type": "string"}}}}}


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt``, or chat ``messages`` rendered with
    the checkpoint's template."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data):
        if (where := find_surrogate(data)) is not None:
            raise InvalidRequest(f"{where}: the string holds a lone UTF-16 surrogate", param=where.split(".")[0],
                                 code="invalid_unicode")
        return data


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


def create_app(engine: LLMEngine, api_key: str | None = None, *,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The server around ``engine``; the engine thread runs while the app does (its lifespan).
    With ``api_key``, ``/v1/*`` requires the header ``Authorization: Bearer <api_key>``. A
    request body over ``max_body_bytes`` is refused with 413 before it is read."""
    runner = AsyncEngine(engine)
    metrics = Metrics(lambda: runner.snapshot, engine.model_name)
    runner.on_finished = metrics.observe

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start()
        try:
            yield
        finally:
            runner.stop()

    app = FastAPI(title="minillm", summary="An OpenAI-compatible server for the minillm engine", lifespan=lifespan,
                  version=VERSION, default_response_class=SafeJSONResponse)
    app.state.engine, app.state.runner, app.state.metrics = engine, runner, metrics
    _add_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(CountResponses, count=metrics.count_response)
    app.openapi = lambda: _openapi(app)

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

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)], responses=_errors(401))

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "minillm", "max_model_len": engine.max_model_len}]}

    @v1.post("/completions", responses={**_STREAMABLE, **_errors(400, 404, 413, 500, 503)})
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        return await respond(body.prompts(), body.to_sampling_params(), body, request, chat=False)

    @v1.post("/chat/completions", responses={**_STREAMABLE, **_errors(400, 404, 413, 500, 503)})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        text = await chat_prompt([m.as_dict() for m in body.messages])
        ids = await runner.tokenize(text, body.max_completion_tokens or body.max_tokens or 1, param="messages")
        return await respond(ids, body.to_sampling_params(len(ids), engine.max_model_len), body, request, chat=True)

    async def chat_prompt(messages: list[dict]) -> str:
        """The checkpoint's chat template applied to ``messages`` (in the thread pool)."""
        if engine.chat_template is None:
            raise InvalidRequest(f"the model '{engine.model_name}' has no chat template: use /v1/completions",
                                 param="messages")
        try:
            return await runner.run_in_pool(render_chat, engine.chat_template, messages)
        except TemplateError as e:
            raise InvalidRequest(f"the chat template refused these messages: {e}", param="messages") from None

    async def respond(prompt, params, body, request: Request, chat: bool):
        """Chat: one prompt. Completions: a list of prompts, one engine request each, merged."""
        if chat:
            stream = await runner.add(prompt, params)
            fmt = Formatter(chat, engine.model_name, engine.tokenizer, stream.request_id,
                            prompt_logprobs=params.prompt_logprobs is not None)
        else:
            stream = await MultiStream.open(runner, prompt, params)
            fmt = Formatter(chat, engine.model_name, engine.tokenizer, stream.request_id, prompts=prompt,
                            echo=body.echo, echo_only=body.echo_only,
                            prompt_logprobs=body.prompt_logprobs is not None)
        if body.stream:
            return EventStream(_events(stream, fmt, body.include_usage), on_close=stream.abort)
        try:
            output = await _result_unless_disconnected(stream, request)
            return Response(status_code=499) if output is None else fmt.response(output)
        finally:
            stream.abort()   # a no-op once finished

    app.include_router(v1)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, 404, 413, 503))
    async def tokenize(body: TokenizeRequest):
        """vLLM's ``/tokenize``: the prompt's (or the rendered chat's) token ids."""
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("give either a prompt or messages", param="prompt")
        if body.messages is not None:
            messages = [{"role": str(m.get("role", "")), "content": m.get("content") or ""} for m in body.messages]
            text, param = await chat_prompt(messages), "messages"
        else:
            text, param = body.prompt, "prompt"
        ids = await runner.tokenize(text, 0, param=param)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_errors(400, 404, 413, 503))
    async def detokenize(body: DetokenizeRequest):
        """vLLM's ``/detokenize``: the text of token ids."""
        check_model(body.model)
        vocab = engine.model_config.vocab_size

        def decode(tokens: list[int]) -> str:   # in the pool: a long list takes a while
            if not all(t < vocab for t in tokens):
                raise InvalidRequest(f"token ids must lie in [0, {vocab})", param="tokens")
            return engine.tokenizer.decode(tokens)

        return DetokenizeResponse(prompt=await runner.run_in_pool(decode, body.tokens))

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/health", responses=_errors(503))
    async def health():
        if not runner.alive:
            raise APIError(503, "the engine thread is not running", type="server_error")
        if not runner.accepting:
            raise APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus' text format.", "content": {CONTENT_TYPE_LATEST: {}}}})
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
        try:
            data = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except ValueError:   # a non-finite float
            data = json.dumps(finite(data), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _events(stream: RequestStream, fmt: Formatter, include_usage: bool):
    output = None
    try:
        async for output in stream:
            for chunk in fmt.chunks(output):
                yield _sse(chunk)
    except EngineError as e:  # this request failed, or the server is stopping: the status line is long gone
        yield _sse(envelope(e.message, e.type, e.param, e.code))
    except Exception as e:
        yield _sse(envelope(f"internal error: {type(e).__name__}: {e}", "server_error"))
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

    @app.exception_handler(EngineError)
    async def engine_error(request, exc: EngineError):
        # 503: retry later; a request that failed on its own would fail again (the openai client
        # honours x-should-retry)
        headers = {"Retry-After": "1"} if exc.status == 503 else {"x-should-retry": "false"}
        return APIError(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code).response(headers)

    @app.exception_handler(Exception)
    async def any_error(request, exc: Exception):  # a bug: still the envelope, never a plain-text 500
        # Starlette answers this one outside the middlewares, so it is counted here.
        route = getattr(request.scope.get("route"), "path", None) or "other"
        request.app.state.metrics.count_response(request.method, route, 500)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error").response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        err = exc.errors()[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidRequest):   # raised by a model validator
            return APIError(400, cause.message, param=cause.param, code=cause.code).response()
        if err["type"] == "json_invalid":
            return APIError(400, f"The request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}",
                            code="invalid_json").response()
        loc = [str(part) for part in err["loc"] if part != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return APIError(400, f"{where}: {err['msg']}", param=param, code=err["type"]).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        status = exc.status_code
        kind = "not_found_error" if status == 404 else "invalid_request_error" if status < 500 else "server_error"
        message = str(exc.detail)
        if status == 400 and isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body"
            message = f"The request body is not valid UTF-8: {exc.__cause__}"
        code = {400: "invalid_body", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
        return APIError(status, message, type=kind, code=code).response(getattr(exc, "headers", None))


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document without its 422 responses: this server answers a validation error
    with 400 in OpenAI's envelope, which every route lists instead."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
