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
from minillm.engine.engine import LLMEngine
from minillm.engine.request import RequestOutput

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

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineSnapshot:
        m, s = engine.manager, engine.stats
        return cls(len(engine.scheduler.running), len(engine.scheduler.waiting), m.num_used_blocks,
                   m.num_free_blocks, m.num_cached_blocks, s.prefix_hit_rate, engine.scheduler.num_preemptions,
                   s.steps, s.prompt_tokens_computed, s.generation_tokens, s.requests_finished, s.requests_aborted)


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

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty():      # outputs are cumulative: the newest says it all
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def result(self) -> RequestOutput:
        """The finished output."""
        async for output in self:
            pass
        return output

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
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
        # request id -> (event loop, queue); only the engine thread touches it
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    # == the event loop's side ===================================================================
    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def add(self, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it.

        Raises:
            InvalidRequest: the engine refused it (`LLMEngine.add_request`'s checks).
        """
        stream = RequestStream(self, uuid.uuid4().hex)
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("add", stream.request_id, prompt, params, asyncio.get_running_loop(), stream._queue, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:   # the client left before the engine took the request
            stream.abort()
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
                except Exception as e:   # a bug: fail the requests in flight, keep serving
                    log.exception("engine step failed")
                    self._fail_all(e)
                    outputs = []
                for output in outputs:
                    self._deliver(output)
            self.snapshot = EngineSnapshot.of(engine)
        self._fail_all(RuntimeError("the server is shutting down"))

    def _execute(self, kind: str, request_id: str, *args) -> None:
        if kind == "abort":
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)
            return
        prompt, params, loop, queue, accepted = args
        if not accepted.set_running_or_notify_cancel():   # cancelled while in the inbox
            return
        try:
            self.engine.add_request(prompt, params, request_id)
        except Exception as e:  # InvalidRequest (HTTP 400), or a bug (500)
            accepted.set_exception(e)
            return
        self._streams[request_id] = (loop, queue)
        accepted.set_result(None)

    def _deliver(self, output: RequestOutput) -> None:
        target = self._streams.get(output.request_id)
        if target is None:
            return
        if output.finished:
            del self._streams[output.request_id]
            if self.on_finished is not None:
                self.on_finished(output)
        self._put(target, output)

    def _fail_all(self, error: Exception) -> None:
        for request_id, target in list(self._streams.items()):
            self.engine.abort(request_id)
            self._put(target, error)
        self._streams.clear()

    @staticmethod
    def _put(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item) -> None:
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass
