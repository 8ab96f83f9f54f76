"""Chapter 13: the router's live view of its instances: up or down, load, and prefix index.

`InstanceSet` holds one `Instance` per backend URL and turns a request's block keys into an
order of instances to try (`order`, by the policy of `minillm.router.policy`). The proxy tells
it what happened: `sent` (in flight +1, the blocks recorded in the instance's `PrefixIndex`),
`done` (in flight -1), `mark_down` (a connection failed). `check` asks every instance's
``/health``, marking it down or up again; the app runs it periodically. An instance marked down
is presumed to have lost its cache (a crash, a restart), so its index is cleared.

Everything here runs on the event loop's one thread: the counts need no lock.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from minillm.router.policy import InstanceView, prefix_aware_order, round_robin_order
from minillm.router.prefix import PrefixIndex

__all__ = ["POLICIES", "Instance", "InstanceSet"]

POLICIES = ("prefix", "round_robin")


@dataclass(eq=False)
class Instance:
    """One engine instance behind the router (``url`` like ``http://127.0.0.1:8001``)."""

    index: int
    url: str
    prefixes: PrefixIndex
    up: bool = True
    in_flight: int = 0
    requests: int = 0           # sent in all (retries included)
    failures: int = 0           # connection failures and failed health checks

    def state(self) -> dict:
        return {"index": self.index, "url": self.url, "up": self.up, "in_flight": self.in_flight,
                "requests": self.requests, "failures": self.failures, "cached_blocks": len(self.prefixes)}


@dataclass(eq=False)
class InstanceSet:
    """The instances, the routing policy and its knobs.

    Attributes:
        policy: ``"prefix"`` (prefix-aware) or ``"round_robin"``.
        block_size: the instances' KV block size (the engine's ``--block-size``).
        max_in_flight: requests in flight at which an instance counts as saturated (``None``: never).
        index_capacity: block keys remembered per instance.
    """

    urls: Sequence[str]
    policy: str = "prefix"
    block_size: int = 16
    max_in_flight: int | None = None
    index_capacity: int = 65536
    instances: list[Instance] = field(init=False)
    _last: int = field(default=-1, init=False)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not self.urls:
            raise ValueError("the router needs at least one instance")
        self.instances = [Instance(i, u.rstrip("/"), PrefixIndex(self.index_capacity)) for i, u in enumerate(self.urls)]

    def views(self, keys: Sequence[bytes] = ()) -> list[InstanceView]:
        return [InstanceView(i.index, i.up, i.in_flight, i.prefixes.match(keys) if keys else 0, len(i.prefixes))
                for i in self.instances]

    def order(self, keys: Sequence[bytes] = ()) -> list[Instance]:
        """The instances that are up, in the order to try them for a request with these keys."""
        views = self.views(keys)
        if self.policy == "prefix":
            indices = prefix_aware_order(views, self.max_in_flight)
        else:
            indices = round_robin_order(views, self._last)
        return [self.instances[i] for i in indices]

    def sent(self, instance: Instance, keys: Sequence[bytes] = (), generation: bool = True) -> None:
        """A request went to ``instance``; ``generation=False`` for the side requests
        (``/v1/models``), which neither count nor move the round-robin."""
        instance.in_flight += 1
        if generation:
            instance.requests += 1
            instance.prefixes.insert(keys)
            self._last = instance.index

    def done(self, instance: Instance) -> None:
        instance.in_flight -= 1

    def mark_down(self, instance: Instance) -> None:
        instance.failures += 1
        if instance.up:
            instance.up = False
            instance.prefixes.clear()

    async def check(self, client: httpx.AsyncClient, timeout: float = 2.0) -> None:
        """Ask every instance's ``GET /health``: 200 marks it up, anything else down."""
        async def one(instance: Instance) -> None:
            try:
                ok = (await client.get(instance.url + "/health", timeout=timeout)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                instance.up = True
            else:
                self.mark_down(instance)

        await asyncio.gather(*(one(i) for i in self.instances))

    def state(self) -> list[dict]:
        return [i.state() for i in self.instances]
