"""Chapter 13: the router's HTTP face, the same OpenAI API as one ``minillm serve``.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are tokenized here (in a worker
thread: `minillm.router.prompts`), their full blocks hashed (`minillm.router.prefix`), and sent
to the instance the policy picks (`minillm.router.proxy`), streamed or not as the body asks.
``GET /v1/models`` goes to the least loaded instance that is up. ``GET /health`` is 200 while
at least one instance is up (503 in OpenAI's envelope otherwise) and lists them;
``GET /router/instances`` is the router's view: per instance, up or down, requests in flight
and in all, and the block keys it remembers. A background task asks every instance's
``/health`` each ``health_interval`` seconds, bringing back the ones that recovered.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from minillm import BUNDLED_MODEL
from minillm.router.instances import InstanceSet
from minillm.router.prefix import block_hashes
from minillm.router.prompts import PromptTokenizer
from minillm.router.proxy import forward, unavailable
from minillm.server.errors import envelope

__all__ = ["create_router_app"]


def create_router_app(urls: Sequence[str], model: str | Path = BUNDLED_MODEL, *, policy: str = "prefix",
                      block_size: int = 16, max_in_flight: int | None = None, health_interval: float = 2.0,
                      index_capacity: int = 65536, max_body_bytes: int = 8 * 2**20) -> FastAPI:
    """A router over the instances at ``urls``, all serving the checkpoint ``model`` with KV
    blocks of ``block_size`` tokens; ``policy`` is ``"prefix"`` or ``"round_robin"``;
    ``max_in_flight``: the load at which an instance counts as saturated."""
    pool = InstanceSet(urls, policy, block_size, max_in_flight, index_capacity)
    prompts = PromptTokenizer(model)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0),
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

        async def health_loop():
            while True:
                await asyncio.sleep(health_interval)
                await pool.check(app.state.client)

        task = asyncio.create_task(health_loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await app.state.client.aclose()

    app = FastAPI(title="minillm router", summary="Prefix-aware routing over several minillm engine instances",
                  lifespan=lifespan)
    app.state.pool, app.state.prompts = pool, prompts

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):   # 404, 405: still OpenAI's envelope
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(envelope(str(exc.detail), kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def generate(request: Request, path: str, chat: bool):
        if int(request.headers.get("content-length") or 0) > max_body_bytes:
            return JSONResponse(envelope(f"the request body is larger than {max_body_bytes} bytes",
                                         "invalid_request_error", code="request_too_large"), status_code=413)
        content = await request.body()
        try:
            body = json.loads(content)
        except ValueError:
            body = None     # routed by load; the instance answers the 400
        stream = isinstance(body, dict) and body.get("stream") is True
        ids = await asyncio.to_thread(prompts.token_ids, body, chat) if isinstance(body, dict) else []
        return await forward(pool, request.app.state.client, "POST", path, content=content, headers=request.headers,
                             keys=block_hashes(ids, block_size), stream=stream)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        order = sorted((i for i in pool.instances if i.up), key=lambda i: i.in_flight)
        return await forward(pool, request.app.state.client, "GET", "/v1/models", headers=request.headers,
                             order=order)

    @app.get("/health")
    async def health():
        if not any(i.up for i in pool.instances):
            return unavailable("every engine instance is down")
        return {"status": "ok", "instances": pool.state()}

    @app.get("/router/instances")
    async def instances():
        return {"policy": pool.policy, "block_size": pool.block_size, "max_in_flight": pool.max_in_flight,
                "instances": pool.state()}

    return app
