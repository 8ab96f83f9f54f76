"""Chapter 13: prefix-aware routing over several engine instances.

One engine instance caches the prompts *it* has seen. Behind a load balancer that ignores
prompts (round-robin), every instance ends up computing and caching every system prompt, and
the cache hit rate of each falls as instances are added. A prefix-aware router (SGLang's
router, KsanaLLM's) sends a request to the instance that already holds its prefix, so each
system prompt is cached once, the fleet's caches add up, and hits stay high.

    minillm route --instances 2                  # two `minillm serve` processes behind one OpenAI API

The modules, one job each:

- `minillm.router.prefix`: a prompt's block keys (Chapter 6's hash chain) and a bounded LRU
  index of the keys sent to one instance.
- `minillm.router.policy`: the routing decision, pure functions (prefix-aware, round-robin).
- `minillm.router.prompts`: a request body's prompt as token ids (the server's chat template).
- `minillm.router.instances`: the instances' state (up, load, index) and health checks.
- `minillm.router.proxy`: forward a request, relay the answer (streams chunk by chunk), retry
  on the next instance when one fails before anything was relayed.
- `minillm.router.app`: the FastAPI app (the OpenAI routes, ``/health``, ``/router/instances``).
- `minillm.router.launch`, `minillm.router.command`: start instances and the router; ``minillm route``.

The measurement (prefix-cache hit rate and throughput, prefix-aware against round-robin) is
`minillm.experiments.ch13_routing`.
"""
from minillm.router.policy import InstanceView, prefix_aware_order, round_robin_order
from minillm.router.prefix import PrefixIndex, block_hashes

__all__ = ["InstanceView", "PrefixIndex", "block_hashes", "prefix_aware_order", "round_robin_order"]
