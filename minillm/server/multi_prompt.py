"""Chapter 9: several prompts in one ``/v1/completions`` request, as one stream of outputs.

The OpenAI API takes a list of prompts in one completions request and answers with one list of
choices: prompt ``i``'s ``n`` completions are choices ``i * n .. i * n + n - 1``. The engine
knows nothing of this: each prompt is its own engine request (its own seed, its own samples),
and `MultiStream` merges their streams. Each merged `MergedOutput` holds every choice so far,
re-indexed, and ``parts``, the latest output of each prompt (for echo and prompt
log-probabilities); it is finished when every prompt is. The response code treats a single
prompt the same way, as a list of one.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from minillm.decoding.sampling import SamplingParams
from minillm.engine.request import CompletionOutput, RequestOutput

__all__ = ["MergedOutput", "MultiStream"]


@dataclass(frozen=True)
class MergedOutput:
    """The outputs of all the prompts of one request. ``prompt_token_ids`` are all the prompts'
    ids one after the other (their count is the request's prompt tokens)."""

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    prompt_token_ids: list[int]
    num_cached_tokens: int
    parts: list[RequestOutput]
    n: int


class MultiStream:
    """The engine streams of a request's prompts, read as one (the `RequestStream` interface:
    ``async for output in stream``, `result`, `abort`, ``request_id``, ``finished``)."""

    def __init__(self, streams: list, n: int):
        self.streams, self.n = streams, n
        self.request_id = streams[0].request_id
        self.finished = False
        self._parts: list[RequestOutput | None] = [None] * len(streams)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    @classmethod
    async def open(cls, runner, prompts: Sequence, params: SamplingParams) -> MultiStream:
        """Add every prompt to ``runner`` (an `AsyncEngine`); if one is refused, abort the ones
        already added and raise its error."""
        streams = []
        try:
            for prompt in prompts:
                streams.append(await runner.add(prompt, params))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return cls(streams, params.n)

    async def _pump(self, index: int, stream) -> None:
        try:
            async for output in stream:
                self._queue.put_nowait((index, output))
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            self._queue.put_nowait((index, e))

    def __aiter__(self) -> MultiStream:
        return self

    async def __anext__(self) -> MergedOutput:
        if self.finished:
            raise StopAsyncIteration
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        for index, item in items:
            if isinstance(item, BaseException):
                self.abort()
                raise item
            self._parts[index] = item
        merged = self._merged()
        self.finished = merged.finished
        return merged

    def _merged(self) -> MergedOutput:
        parts = [p for p in self._parts if p is not None]
        outputs = [dataclasses.replace(c, index=i * self.n + c.index)
                   for i, p in enumerate(self._parts) if p is not None for c in p.outputs]
        finished = len(parts) == len(self._parts) and all(p.finished for p in parts)
        ids = [t for p in parts for t in p.prompt_token_ids]
        return MergedOutput(self.request_id, outputs, finished, ids, sum(p.num_cached_tokens for p in parts),
                            list(self._parts), self.n)

    async def result(self) -> MergedOutput:
        """The finished output."""
        output = None
        async for output in self:
            pass
        return output

    def abort(self) -> None:
        """Abort every prompt still running (a no-op once finished)."""
        self.finished = True
        for stream in self.streams:
            stream.abort()
        for task in self._tasks:
            task.cancel()
