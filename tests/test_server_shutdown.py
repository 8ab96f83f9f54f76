"""Chapter 9: ``minillm serve`` shuts down gracefully (`minillm.server.shutdown`).

A real ``minillm serve`` process on 127.0.0.1 and a free port, the bundled model on the CPU.
The first SIGTERM or SIGINT closes admission (503 in OpenAI's envelope, ``/health`` 503) and
lets the requests in flight run for ``--shutdown-timeout`` seconds; what is still running then
ends with an error event and ``data: [DONE]``; a second signal does that at once; the process
exits with status 0 either way, within a bounded time.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from minillm import BUNDLED_MODEL
from minillm.router.launch import InstanceProcess

pytest.importorskip("fastapi")   # the server's own dependency (the `serve` extra)
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

LONG = {"prompt": "ROMEO:", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}


class Server(InstanceProcess):
    """``minillm serve`` with the bundled model in a subprocess (killed at the end if it is
    still alive); the router's instance process, plus signals."""

    def __init__(self, *flags: str):
        super().__init__(BUNDLED_MODEL, ["--device", "cpu", "--num-blocks", "128", *flags])
        self.wait_ready(60)

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the server did not exit within {timeout} s:\n" + "".join(self.log)) from None

    def close(self) -> None:
        self.kill()


@pytest.fixture
def server_factory():
    servers = []

    def make(*flags):
        servers.append(Server(*flags))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


class Stream(threading.Thread):
    """One streamed completion, read to its end in a thread: ``events`` (``[DONE]`` kept as a
    string), ``first`` set once the first event came."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list = []
        self.error: BaseException | None = None
        self.first = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=60) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line.removeprefix("data: ")
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.first.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.first.set()

    @property
    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events if isinstance(e, dict) and e.get("choices"))


def assert_ended_with_error(stream: Stream) -> None:
    assert stream.error is None, stream.error
    *body, error, done = stream.events
    assert done == "[DONE]", stream.events[-3:]
    assert error["error"]["code"] == "server_shutting_down" and error["error"]["type"] == "server_error"
    assert body and all("choices" in e for e in body), "the stream ran before it was ended"


def test_first_signal_drains_then_ends_the_rest(server_factory):
    server = server_factory("--shutdown-timeout", "1.5")
    longs = [Stream(server.url, LONG) for _ in range(3)]    # 1000 tokens each: far longer than the drain
    for long in longs:
        assert long.first.wait(30)
    short = Stream(server.url, {**LONG, "max_tokens": 8})
    assert short.first.wait(30)
    start = time.monotonic()
    server.signal(signal.SIGTERM)
    time.sleep(0.3)
    # admission is closed: a new request (new connection) gets 503 in the envelope
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "server_shutting_down" and r.json()["error"]["type"] == "server_error"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    short.join(20)
    assert short.error is None and short.events[-1] == "[DONE]"          # finished within the drain
    assert short.events[-2]["choices"][0]["finish_reason"] == "length"
    for long in longs:
        long.join(30)
        assert_ended_with_error(long)
    assert server.wait(30) == 0
    took = time.monotonic() - start
    assert 1.2 < took < 20, f"the drain took {took:.1f} s with a 1.5 s timeout"


def test_second_signal_stops_at_once_and_cleanly(server_factory):
    server = server_factory("--shutdown-timeout", "60")
    streams = [Stream(server.url, LONG) for _ in range(2)]
    for s in streams:
        assert s.first.wait(30)
    start = time.monotonic()
    server.signal(signal.SIGINT)
    time.sleep(0.5)
    assert server.proc.poll() is None, "the first signal only drains"
    server.signal(signal.SIGINT)
    for s in streams:
        s.join(20)
        assert_ended_with_error(s)
    assert server.wait(20) == 0
    assert time.monotonic() - start < 15, "a second signal must not wait for the 60 s drain"
