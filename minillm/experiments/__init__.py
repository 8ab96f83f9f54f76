"""The book's experiments: simulations and measurement workloads, one module per chapter.

They drive the serving code (`minillm.paged`, `minillm.decoding`, `minillm.engine`) to produce
the numbers and plots of a chapter; nothing in the serving path imports them.

- `ch05_fragmentation`: memory wasted by contiguous and paged KV caches over length distributions.
- `ch06_sharing`: memory saved by fork-sharing for parallel sampling and beam search.
- `ch06_prefix_workload`: a shared-system-prompt workload, with and without prefix caching.
- `ch07_softmax_stats`: the score statistics behind the asynchronized softmax's fixed maximum.
- `ch09_engine_benchmark`: the engine benchmark (workloads, offline throughput, online latency).
- `ch13_routing`: prefix-aware routing against round-robin over several engine instances.
"""
