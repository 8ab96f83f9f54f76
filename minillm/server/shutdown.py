"""Chapter 9: a graceful shutdown for ``minillm serve``.

uvicorn's own first Ctrl-C closes the listening socket and then waits, without limit, for
every connection to finish: a 40-second stream holds the process for 40 seconds, and a second
Ctrl-C kills the streams mid-way, with no error event and no ``data: [DONE]``, so a client
cannot tell a cut stream from a slow one. `GracefulServer` replaces that with:

1. **First SIGINT or SIGTERM: drain.** Admission closes: every new request (on a new
   connection or a kept-alive one) gets 503 in OpenAI's envelope, and ``/health`` says 503 so
   a load balancer moves on. The requests in flight run on, for at most ``shutdown_timeout``
   seconds.
2. **Then, or at a second signal: stop.** Whatever still runs is ended by the engine between
   two steps: a stream gets an error event (``"code": "server_shutting_down"``) and ``data:
   [DONE]``, a whole response a 503 envelope. Once those have gone out (a second or so at
   most), uvicorn closes the connections, the engine thread stops, and the process exits with
   status 0.
"""
from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from minillm.server.async_engine import AsyncEngine
from minillm.server.errors import ServiceUnavailable

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT", "GracefulServer"]

DEFAULT_SHUTDOWN_TIMEOUT = 10.0
FLUSH_SECONDS = 2.0     # for the ended streams to send their last events

log = logging.getLogger("minillm.server")


class GracefulServer(uvicorn.Server):
    """A ``uvicorn.Server`` that drains ``runner`` for ``shutdown_timeout`` seconds on the first
    signal and stops at once on the second (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, runner: AsyncEngine,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT):
        super().__init__(config)
        self.runner, self.shutdown_timeout = runner, shutdown_timeout
        self.signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        """The signal handler (on the event loop's thread, between two bytecodes): hand the work
        to the loop. The signal is not re-raised after the shutdown: the exit status is 0."""
        self.signals += 1
        if self._loop is None or self._loop.is_closed():
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._on_signal, self.signals)

    def _on_signal(self, count: int) -> None:
        if count == 1:
            log.warning("shutting down: no new requests; draining %d in flight for at most %.0f s (again to stop now)",
                        self.runner.num_in_flight, self.shutdown_timeout)
            self._spawn(self._drain(self.shutdown_timeout))
        else:
            log.warning("stopping now: ending %d requests in flight", self.runner.num_in_flight)
            self._spawn(self._drain(0))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, timeout: float) -> None:
        runner = self.runner
        runner.close_admission()
        deadline = time.monotonic() + timeout
        while runner.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if runner.num_in_flight:
            runner.fail_all(ServiceUnavailable(
                "the server is shutting down: this request was ended before it finished", code="server_shutting_down"))
            deadline = time.monotonic() + FLUSH_SECONDS
            while runner.num_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)   # the streams' last writes
        self.should_exit = True
