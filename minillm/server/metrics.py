"""Chapter 9: ``GET /metrics``, in Prometheus' text format.

Two kinds of numbers. The engine's state and totals (queues, KV blocks, prefix-cache hit rate,
preemptions, tokens) are read from the `EngineSnapshot` the engine thread publishes after each
round, at the moment Prometheus scrapes (a custom collector), so they can never drift from the
engine's own counts. Latencies are histograms observed once per finished request, from its
`RequestMetrics`: time to first token, time per output token (the mean gap between the
tokens after the first) and end-to-end latency.

Each app gets its own `CollectorRegistry`, so that several servers in one process (the tests)
do not share or clash over metrics.

Every number is exported twice: under minillm's own names (``minillm_*``), and, for those vLLM
has, under vLLM's names and labels (``vllm:num_requests_running{model_name="..."}``,
``vllm:kv_cache_usage_perc`` (a fraction, as in vLLM), ``vllm:time_to_first_token_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:time_per_output_token_seconds``,
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:num_preemptions_total``,
``vllm:request_success_total{finished_reason}``), so that a dashboard built for vLLM works
unchanged. Requests that did not succeed are counted apart: ``minillm_requests_aborted_total``
(the client went away) and ``minillm_requests_failed_total`` (an error ended them). HTTP
responses are counted by method, route and status code: ``minillm_http_responses_total``.
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

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str = "minillm"):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot, model_name))
        self.model_name = model_name
        r = self.registry
        label = ["model_name"]
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (vLLM's name).", label,
                                   buckets=TTFT_BUCKETS, registry=r)
        self.vllm_tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token (vLLM's name).",
                                   label, buckets=TPOT_BUCKETS, registry=r)
        self.vllm_latency = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency (vLLM's name).",
                                      label, buckets=LATENCY_BUCKETS, registry=r)
        self.vllm_success = Counter("vllm:request_success", "Requests that finished, by finish reason (vLLM's name).",
                                    ["model_name", "finished_reason"], registry=r)
        self.http = Counter("minillm_http_responses", "HTTP responses by method, route and status code.",
                            ["method", "route", "status"], registry=r)
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
        m, name = output.metrics, self.model_name
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.vllm_success.labels(name, output.outputs[0].finish_reason if output.outputs else "stop").inc()
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
            self.vllm_ttft.labels(name).observe(m.ttft)
        if m.latency is not None:
            self.latency.observe(m.latency)
            self.vllm_latency.labels(name).observe(m.latency)
        if len(m.token_times) > 1:
            tpot = (m.token_times[-1] - m.token_times[0]) / (len(m.token_times) - 1)
            self.tpot.observe(tpot)
            self.vllm_tpot.labels(name).observe(tpot)

    def count_response(self, method: str, route: str, status: int) -> None:
        self.http.labels(method, route, str(status)).inc()

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
        "requests_failed": ("minillm_requests_failed", "Requests ended by an error (their own, an engine fault, "
                                                       "or the shutdown)."),
    }
    VLLM_GAUGES = {
        "running": ("vllm:num_requests_running", "Requests running (vLLM's name)."),
        "waiting": ("vllm:num_requests_waiting", "Requests waiting (vLLM's name)."),
        "kv_cache_usage": ("vllm:kv_cache_usage_perc", "KV-cache usage, as a fraction of the pool (vLLM's name)."),
    }
    VLLM_COUNTERS = {
        "prompt_tokens": ("vllm:prompt_tokens", "Prompt tokens of the requests admitted (vLLM's name)."),
        "generation_tokens": ("vllm:generation_tokens", "Tokens generated (vLLM's name)."),
        "preemptions": ("vllm:num_preemptions", "Preemptions (vLLM's name)."),
    }

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str = "minillm"):
        self.snapshot, self.model_name = snapshot, model_name

    def collect(self):
        s = self.snapshot()
        for field, (name, doc) in self.GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=getattr(s, field))
        for field, (name, doc) in self.COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(s, field))
        values = {"kv_cache_usage": s.blocks_used / s.num_blocks if s.num_blocks else 0.0}
        for family, table in ((GaugeMetricFamily, self.VLLM_GAUGES), (CounterMetricFamily, self.VLLM_COUNTERS)):
            for field, (name, doc) in table.items():
                metric = family(name, doc, labels=["model_name"])
                metric.add_metric([self.model_name], values[field] if field in values else getattr(s, field))
                yield metric
