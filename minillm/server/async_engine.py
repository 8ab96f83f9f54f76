"""Chapter 9: the server's engine loop, in one background thread.

`LLMEngine` is not thread-safe, and its `step` is a blocking forward pass: run on the event
loop, it would stall every connection for the length of a step. So exactly one thread owns the
engine and calls ``step`` in a loop, and the asyncio side (the HTTP handlers, on uvicorn's
event loop) talks to it through two one-way channels:

- **An inbox.** ``add`` and ``abort`` append a command to a list under a lock and wake the
  thread; between two steps the thread takes the whole list and carries the commands out. A
  request is thus added or aborted between forward passes, never during one, and an abort
  always comes after its add (the list is in order).
- **One asyncio queue per request.** After each step the thread hands every request that made
  progress its new `RequestOutput` with ``loop.call_soon_threadsafe(queue.put_nowait, output)``
  (asyncio queues are not thread-safe; this runs the ``put`` on the loop's own thread).
  Outputs are cumulative (all the text so far), so a reader that fell behind keeps only the
  newest one in its queue.

With nothing queued and nothing running, the thread sleeps on a `threading.Condition` that
``add``, ``abort`` and ``stop`` notify: an idle server uses no CPU. The thread also publishes
an `EngineSnapshot` after every round, which ``/metrics`` reads without touching the engine.

Only the engine's work happens on its thread. Tokenizing a prompt (``add``) runs in a small
thread pool first, so that a long prompt never holds up a step. A request whose own step
raises is ended alone with `RequestFailed` (`LLMEngine._fail`: the others go on); only a fault
of the step as a whole (the forward pass, out of memory) ends every request in flight, with
`ServiceUnavailable` (503), and the loop goes on. For a graceful shutdown, `close_admission`
makes ``add`` refuse new requests (503), `num_in_flight` says how many still run, and
`fail_all` ends them with an error.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from minillm.decoding.sampling import SamplingParams
from minillm.engine.config import ContextLengthExceeded, InvalidRequest
from minillm.engine.engine import LLMEngine
from minillm.engine.request import RequestOutput
from minillm.server.errors import EngineError, RequestFailed, ServiceUnavailable
from minillm.server.tokens import PromptBound

__all__ = ["AsyncEngine", "EngineSnapshot", "RequestStream"]

log = logging.getLogger("minillm.server")


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's queues, pool and totals after a round of the loop (for ``/metrics``)."""

    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    blocks_cached: int = 0
    prefix_hit_rate: float = 0.0
    preemptions: int = 0
    steps: int = 0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0          # ended by an error (their own, an engine fault, or shutdown)
    num_blocks: int = 0
    prompt_tokens: int = 0            # of the requests admitted so far

    @classmethod
    def of(cls, engine: LLMEngine, failed: int = 0) -> EngineSnapshot:
        m, s = engine.manager, engine.stats
        return cls(len(engine.scheduler.running), len(engine.scheduler.waiting), m.num_used_blocks,
                   m.num_free_blocks, m.num_cached_blocks, s.prefix_hit_rate, engine.scheduler.num_preemptions,
                   s.steps, s.prompt_tokens_computed, s.generation_tokens, s.requests_finished, s.requests_aborted,
                   failed, m.num_blocks, s.prompt_tokens)


class RequestStream:
    """One request's outputs, read on the event loop: ``async for output in stream``.

    The iteration ends after the finished output. `abort` (a no-op once finished) must be
    called if the reader stops early, so that the engine frees the request's blocks.
    """

    def __init__(self, engine: AsyncEngine, request_id: str):
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        engine._open.add(request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty():      # outputs are cumulative: the newest says it all
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self._close()
            raise item
        if item.finished:
            self._close()
        return item

    def _close(self) -> None:
        self.finished = True
        self._engine._open.discard(self.request_id)

    async def result(self) -> RequestOutput:
        """The finished output."""
        async for output in self:
            pass
        return output

    def abort(self) -> None:
        if not self.finished:
            self._close()
            self._engine._send(("abort", self.request_id))


class AsyncEngine:
    """Runs an `LLMEngine` in a background thread (see the module docstring).

    Args:
        engine: the engine; nothing else may use it while this runs.
        on_finished: called, on the engine thread, with the output of each request that
            finishes (not aborted ones): the metrics' hook.
    """

    def __init__(self, engine: LLMEngine, on_finished: Callable[[RequestOutput], None] | None = None):
        self.engine = engine
        self.on_finished = on_finished
        self.snapshot = EngineSnapshot.of(engine)
        self._inbox: list[tuple] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.accepting = True
        self.num_failed = 0
        self.on_failed: Callable[[str, EngineError], None] | None = None  # the metrics' hook
        self._open: set[str] = set()   # streams not yet finished (the event loop's side)
        self._tokenizers: concurrent.futures.ThreadPoolExecutor | None = None
        self._bound = PromptBound(engine.tokenizer)
        # request id -> (event loop, queue); only the engine thread touches it
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    # == the event loop's side ===================================================================
    def start(self) -> None:
        self._stopping = False
        self._tokenizers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="minillm-tokenize")
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._tokenizers is not None:
            self._tokenizers.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Requests accepted whose streams have not finished."""
        return len(self._open)

    def close_admission(self) -> None:
        """From now on ``add`` refuses new requests with `ServiceUnavailable` (shutdown)."""
        self.accepting = False

    def fail_all(self, error: EngineError) -> None:
        """End every request in flight with ``error`` (between two steps)."""
        self._send(("fail_all", None, error))

    async def run_in_pool(self, fn, *args):
        """``fn(*args)`` in the tokenizer pool: text work that must not run on the event loop
        or the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizers, fn, *args)

    def check_length(self, text: str, max_tokens: int = 1, param: str = "prompt") -> None:
        """Refuse ``text`` at no cost when its length alone proves that it cannot fit in the
        context with ``max_tokens`` more (`minillm.server.tokens.PromptBound`)."""
        limit = self.engine.max_model_len - max_tokens
        at_least = self._bound.at_least(text, limit)
        if at_least > limit:   # blame max_tokens when it alone leaves no room for a prompt
            raise InvalidRequest(
                f"This model's maximum context length is {self.engine.max_model_len} tokens. However, you "
                f"requested at least {at_least + max_tokens} tokens (at least {at_least} in the prompt of "
                f"{len(text)} characters, {max_tokens} for the completion). Please reduce the length of the prompt "
                "or of max_tokens.", param="max_tokens" if limit < 1 else param, code="context_length_exceeded")

    async def tokenize(self, text: str, max_tokens: int = 1, param: str = "prompt") -> list[int]:
        """``text``'s token ids, computed in the tokenizer pool, after `check_length`."""
        self.check_length(text, max_tokens, param)
        try:
            return await self.run_in_pool(lambda: self.engine.tokenizer.encode(text).ids)
        except Exception as e:  # e.g. a lone surrogate
            raise InvalidRequest(f"the {param} cannot be tokenized: {e}", param=param) from None

    async def add(self, prompt: str | list[int], params: SamplingParams,
                  prompt_token_ids: list[int] | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it. A text prompt
        is tokenized first, in the tokenizer pool (unless ``prompt_token_ids`` are given).

        Raises:
            InvalidRequest: the engine refused it (`LLMEngine.add_request`'s checks).
            ServiceUnavailable: admission is closed (the server is shutting down).
        """
        if not self.accepting:
            raise ServiceUnavailable("the server is shutting down and accepts no new requests",
                                     code="server_shutting_down")
        if isinstance(prompt, str) and prompt_token_ids is None:
            prompt_token_ids = await self.tokenize(prompt, params.max_tokens)
        ids = prompt if prompt_token_ids is None else prompt_token_ids
        if len(ids) + params.max_tokens > self.engine.max_model_len:   # refused here, in O(1)
            raise ContextLengthExceeded(self.engine.max_model_len, len(ids), params.max_tokens)
        stream = RequestStream(self, uuid.uuid4().hex)
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("add", stream.request_id, prompt, params, asyncio.get_running_loop(), stream._queue, accepted,
                    prompt_token_ids))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:   # the client left before the engine took the request
            stream.abort()
            raise
        except BaseException:
            stream._close()
            raise
        return stream

    def _send(self, command: tuple) -> None:
        with self._wake:
            self._inbox.append(command)
            self._wake.notify()

    # == the engine thread =======================================================================
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not (self._inbox or self._stopping or engine.has_unfinished_requests()):
                    self._wake.wait()
                if self._stopping:
                    break
                commands, self._inbox = self._inbox, []
            for command in commands:
                self._execute(*command)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as e:   # the step as a whole failed: end what runs, keep serving
                    log.exception("engine step failed")
                    self._fail_all(ServiceUnavailable(f"the engine failed a step ({type(e).__name__}: {e}); "
                                                      "the requests in it were ended: retry", code="engine_error"))
                    outputs = []
                for output in outputs:
                    self._deliver(output)
            self.snapshot = EngineSnapshot.of(engine, self.num_failed)
        self._fail_all(ServiceUnavailable("the server is shutting down", code="server_shutting_down"))

    def _execute(self, kind: str, request_id: str, *args) -> None:
        if kind == "abort":
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)
            return
        if kind == "fail_all":
            self._fail_all(*args)
            return
        prompt, params, loop, queue, accepted, ids = args
        if not accepted.set_running_or_notify_cancel():   # cancelled while in the inbox
            return
        try:
            self.engine.add_request(prompt, params, request_id, prompt_token_ids=ids)
        except Exception as e:  # InvalidRequest (HTTP 400), or a bug (500)
            accepted.set_exception(e)
            return
        self._streams[request_id] = (loop, queue)
        accepted.set_result(None)

    def _deliver(self, output: RequestOutput) -> None:
        error = self.engine.failures.pop(output.request_id, None)
        target = self._streams.get(output.request_id)
        if target is None:
            return
        if error is not None:
            del self._streams[output.request_id]
            self._failed(output.request_id, target, RequestFailed(f"this request failed: {type(error).__name__}: "
                                                                  f"{error}"))
            return
        if output.finished:
            del self._streams[output.request_id]
            if self.on_finished is not None:
                self.on_finished(output)
        self._put(target, output)

    def _fail_all(self, error: EngineError) -> None:
        for request_id, target in list(self._streams.items()):
            self.engine.abort(request_id)
            self._failed(request_id, target, error)
        self._streams.clear()
        for request_id in list(self.engine.requests):   # none should be left; never leak blocks
            self.engine.abort(request_id)

    def _failed(self, request_id: str, target, error: EngineError) -> None:
        log.warning("request %s failed: %s", request_id, error)
        self.num_failed += 1
        if self.on_failed is not None:
            self.on_failed(request_id, error)
        self._put(target, error)

    @staticmethod
    def _put(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item) -> None:
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass
