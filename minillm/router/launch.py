"""Chapter 13: start the engine instances and the router, on this machine.

`spawn_instances` starts ``n`` ``minillm serve`` processes on free ports of 127.0.0.1, with the
same checkpoint and engine flags (`engine_argv` turns `EngineConfig` values back into flags),
and waits until each answers ``/health``. `RouterThread` runs the router app in a background
thread of this process (uvicorn), for tests, notebooks and the Chapter 13 measurement;
``minillm route`` (`minillm.router.command`) runs it in the foreground.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

__all__ = ["InstanceProcess", "RouterThread", "engine_argv", "free_port", "spawn_instances", "stop_instances"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_argv(values: dict) -> list[str]:
    """``minillm serve`` flags for the engine fields in ``values`` that differ from
    `EngineConfig`'s defaults (``{"block_size": 8}`` -> ``["--block-size", "8"]``)."""
    from minillm.cli import ENGINE_FLAGS, engine_defaults

    defaults, argv = engine_defaults(), []
    for options, (name, kwargs) in ENGINE_FLAGS.items():
        value = values.get(name)
        if name not in values or value == defaults.get(name):
            continue
        if kwargs.get("action") == "store_false":
            argv += [options[0]] if value is False else []
        elif value is not None:
            argv += [options[0], str(value).removeprefix("torch.")]
    return argv


class InstanceProcess:
    """One ``minillm serve`` subprocess; ``log`` collects its output."""

    def __init__(self, model: str | Path, flags: list[str], port: int | None = None, host: str = "127.0.0.1",
                 threads: int | None = 1, log_level: str = "warning"):
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minillm", "serve", "--model", str(model), "--host", host, "--port", str(self.port),
             "--log-level", log_level, *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"instance {self.url} exited ({self.proc.returncode}):\n" + "".join(self.log))
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"instance {self.url} did not start in {timeout} s:\n" + "".join(self.log))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the server drains), then kill if it is still there after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def spawn_instances(n: int, model: str | Path, flags: list[str] = (), *, threads: int | None = 1,
                    timeout: float = 120.0) -> list[InstanceProcess]:
    """Start ``n`` instances (all at once) and wait until every one is up; on failure, stop them."""
    procs = [InstanceProcess(model, list(flags), threads=threads) for _ in range(n)]
    try:
        for p in procs:
            p.wait_ready(timeout)
    except BaseException:
        stop_instances(procs)
        raise
    return procs


def stop_instances(procs: list[InstanceProcess]) -> None:
    for p in procs:
        p.kill()


class RouterThread:
    """The router app served by uvicorn in a daemon thread: ``with RouterThread(app) as url:``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        import uvicorn

        self.url = f"http://{host}:{port or free_port(host)}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=int(self.url.rsplit(":", 1)[1]),
                                                    log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the router did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
