"""Chapter 9: ``GET /metrics``, in Prometheus' text format.

Two kinds of numbers. The engine's state and totals (queues, KV blocks, prefix-cache hit rate,
preemptions, tokens) are read from the `EngineSnapshot` the engine thread publishes after each
round, at the moment Prometheus scrapes (a custom collector), so they can never drift from the
engine's own counts. Latencies are histograms observed once per finished request, from its
`RequestMetrics`: time to first token, time per output token (the mean gap between the
tokens after the first) and end-to-end latency.

Each app gets its own `CollectorRegistry`, so that several servers in one process (the tests)
do not share or clash over metrics.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from minillm.engine.request import RequestOutput
from minillm.server.async_engine import EngineSnapshot

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The server's metrics. ``snapshot`` returns the engine's latest `EngineSnapshot`."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot))
        r = self.registry
        self.ttft = Histogram("minillm_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("minillm_time_per_output_token_seconds",
                              "Mean time between a request's output tokens after the first.", buckets=TPOT_BUCKETS,
                              registry=r)
        self.latency = Histogram("minillm_e2e_request_latency_seconds", "Time from arrival to the last token.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("minillm_prompt_tokens", "Prompt tokens of finished requests.", registry=r)

    def observe(self, output: RequestOutput) -> None:
        """Record a finished request (called on the engine thread; prometheus_client is thread-safe)."""
        m = output.metrics
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.latency is not None:
            self.latency.observe(m.latency)
        if len(m.token_times) > 1:
            self.tpot.observe((m.token_times[-1] - m.token_times[0]) / (len(m.token_times) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """The engine's numbers, read from its snapshot at scrape time."""

    GAUGES = {
        "running": ("minillm_num_requests_running", "Requests holding KV blocks."),
        "waiting": ("minillm_num_requests_waiting", "Requests queued or preempted, holding no blocks."),
        "blocks_used": ("minillm_kv_blocks_used", "KV blocks referenced by running sequences."),
        "blocks_free": ("minillm_kv_blocks_free", "KV blocks on the free list."),
        "blocks_cached": ("minillm_kv_blocks_cached", "Unreferenced KV blocks kept for the prefix cache."),
        "prefix_hit_rate": ("minillm_prefix_cache_hit_rate", "Fraction of prompt tokens served by the prefix cache."),
    }
    COUNTERS = {
        "preemptions": ("minillm_num_preemptions", "Requests preempted (blocks freed, recomputed later)."),
        "steps": ("minillm_engine_steps", "Engine steps (forward passes)."),
        "prompt_tokens_computed": ("minillm_prompt_tokens_computed", "Prompt tokens run (prefix-cache hits excluded)."),
        "generation_tokens": ("minillm_generation_tokens", "Tokens generated."),
        "requests_finished": ("minillm_requests_finished", "Requests that finished."),
        "requests_aborted": ("minillm_requests_aborted", "Requests aborted (e.g. the client disconnected)."),
    }

    def __init__(self, snapshot: Callable[[], EngineSnapshot]):
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot()
        for field, (name, doc) in self.GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=getattr(s, field))
        for field, (name, doc) in self.COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(s, field))
