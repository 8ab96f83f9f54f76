"""Chapter 13: which instance gets a request, as pure functions of the router's view.

`InstanceView` is what the router knows about one instance when a request arrives: whether
it is up, its requests in flight, how many of the request's leading blocks it was sent before
(`PrefixIndex.match`), and how many block keys it has been sent in all.

**Prefix-aware** (`prefix_aware_order`): the instances that are up, best first:

1. not saturated (in flight below ``max_in_flight``) before saturated: a saturated instance
   would queue the request behind the others, so a long match there loses to none elsewhere;
2. the longest prefix match;
3. the fewest requests in flight (the load tie-break);
4. the fewest block keys sent so far: a new prefix goes where the cache has the most room,
   which spreads different system prompts over the instances even when the load is equal;
5. the instance's index, so that the order is a pure function of the view.

Saturated instances stay in the list, last, ordered by load: when all are saturated the
request still goes somewhere (the engine queues it). Instances that are down are left out.

**Round-robin** (`round_robin_order`): the instances that are up, starting at the one after
the last choice: the usual load balancer, blind to prefixes. Both return an *order*, not one
instance: if the first refuses the connection the router retries the next
(`minillm.router.proxy`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["InstanceView", "prefix_aware_order", "round_robin_order"]


@dataclass(frozen=True)
class InstanceView:
    """One instance as the router sees it when a request arrives.

    Attributes:
        index: the instance's position in the router's list.
        up: False once a connection failed or a health check did, until one succeeds.
        in_flight: requests sent there and not finished.
        matched: the request's leading full blocks this instance was sent before.
        cached: block keys the router remembers sending there (its `PrefixIndex`'s size).
    """

    index: int
    up: bool = True
    in_flight: int = 0
    matched: int = 0
    cached: int = 0


def prefix_aware_order(views: Sequence[InstanceView], max_in_flight: int | None = None) -> list[int]:
    """The indices of the instances that are up, best first (rules in the module docstring).
    ``max_in_flight=None``: no instance is ever saturated."""
    def saturated(v: InstanceView) -> bool:
        return max_in_flight is not None and v.in_flight >= max_in_flight

    up = [v for v in views if v.up]
    fresh = sorted((v for v in up if not saturated(v)), key=lambda v: (-v.matched, v.in_flight, v.cached, v.index))
    full = sorted((v for v in up if saturated(v)), key=lambda v: (v.in_flight, -v.matched, v.cached, v.index))
    return [v.index for v in fresh + full]


def round_robin_order(views: Sequence[InstanceView], last: int) -> list[int]:
    """The indices of the instances that are up, in cyclic order starting after ``last``
    (the index chosen last time; ``-1`` at the start)."""
    n = len(views)
    order = [(last + 1 + k) % n for k in range(n)] if n else []
    return [i for i in order if views[i].up]
