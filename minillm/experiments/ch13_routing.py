"""Chapter 13's measurement: prefix-aware routing against round-robin, on several instances.

**The workload** (`RoutingWorkload`): Chapter 6's shared-system-prompt workload
(`PrefixWorkload.random`), several times over: ``num_systems`` different system prompts, each
followed by ``requests_per_system`` different user suffixes, all requests shuffled together
(seeded), so that the system prompts arrive interleaved as they would from different
applications sharing one fleet. Prompts are token ids (the completions API takes them), so
nothing depends on how a text would re-tokenize; requests are greedy with ``ignore_eos``, so
each decodes exactly ``max_tokens`` tokens and both policies do the same decoding work.

**The run** (`run_policy`): ``instances`` fresh ``minillm serve`` processes (cold caches, the
same engine flags; small KV pools, so that one instance cannot hold every system prompt) behind
the router (`minillm.router`) with one policy; ``concurrency`` clients send the requests in
arrival order, each sending its next request when its previous one is answered (a closed
loop). Each instance first gets a warm-up request shorter than a block, which caches nothing,
and so does the router (its first request pays for setting up its HTTP client).

**What is measured.** The prefix-cache hit rate: prompt tokens served from the cache over all
prompt tokens, summed over the instances, read from each instance's ``/metrics``
(``minillm_prefix_cache_hit_rate`` times ``vllm:prompt_tokens_total``, the warm-up subtracted)
and checked against the ``usage.prompt_tokens_details.cached_tokens`` of the answers. And the
throughput: requests and tokens per second over the wall time from the first request sent to
the last answer, plus the mean and p99 request latency.

With ``concurrency=1`` and no saturation the routing is a pure function of the workload, and
so are the hit rates: prefix-aware routing pins each system prompt to one instance, which
computes it once; round-robin spreads each over every instance, which each compute it, and
whose pools must each hold every system prompt. **Timings are CPU timings** on whatever the
machine is (the instances share its cores; a 2-core machine runs two one-thread instances).

    python -m minillm.experiments.ch13_routing --save     # the committed CPU run (bench/results/cpu/)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from minillm import BUNDLED_MODEL
from minillm.experiments.ch06_prefix_workload import PrefixWorkload
from minillm.results import cpu_model_name

__all__ = ["POLICIES", "PolicyResult", "RoutingWorkload", "compare_routing", "format_table", "result_rows",
           "run_policy"]

POLICIES = ("prefix", "round_robin")


# == the workload ===============================================================================

@dataclass(frozen=True)
class RoutingWorkload:
    """Several Chapter 6 workloads (one per system prompt), interleaved.

    Attributes:
        systems: one `PrefixWorkload` per system prompt.
        order: the arrival order, ``(system, request)`` pairs.
    """

    systems: tuple[PrefixWorkload, ...]
    order: tuple[tuple[int, int], ...]

    @classmethod
    def random(cls, num_systems: int = 4, requests_per_system: int = 8, system_len: int = 128,
               suffix_len: int = 32, vocab_size: int = 4096, seed: int = 0) -> RoutingWorkload:
        """Random token ids (Chapter 6's `PrefixWorkload.random`, seeds ``seed + k``), arrivals
        shuffled with ``seed``."""
        systems = tuple(PrefixWorkload.random(system_len, requests_per_system, suffix_len, vocab_size, seed=seed + k)
                        for k in range(num_systems))
        order = [(k, j) for k in range(num_systems) for j in range(requests_per_system)]
        perm = np.random.default_rng(seed).permutation(len(order))
        return cls(systems, tuple(order[i] for i in perm))

    @property
    def prompts(self) -> list[list[int]]:
        """Every request's prompt, in arrival order."""
        return [self.systems[k].prompts[j] for k, j in self.order]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def ideal_hit_rate(self, block_size: int) -> float:
        """The hit rate of one instance whose cache never evicts: each system prompt computed
        once (Chapter 6's `PrefixWorkload.expected_cached_tokens`, summed over the systems)."""
        return sum(sum(w.expected_cached_tokens(block_size)) for w in self.systems) / self.prompt_tokens


# == one run ====================================================================================

@dataclass
class PolicyResult:
    """One policy on one workload (see the module docstring for how each number is measured).

    Attributes:
        policy: ``"prefix"`` or ``"round_robin"``.
        requests, failed: requests sent, and those that did not come back 200.
        prompt_tokens, cached_tokens: over all instances, from their ``/metrics``.
        usage_cached_tokens: the same, summed from the answers' ``usage``.
        output_tokens: tokens generated.
        seconds: wall time, first request sent to last answer.
        latencies: per request, seconds from sent to answered.
        per_instance: per instance, requests served and the hit rate there.
    """

    policy: str
    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: float
    usage_cached_tokens: int
    output_tokens: int
    seconds: float
    latencies: list[float] = field(repr=False)
    per_instance: list[dict]

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        return {"policy": self.policy, "requests": self.requests, "failed": self.failed,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": round(self.cached_tokens),
                "usage_cached_tokens": self.usage_cached_tokens, "hit_rate": self.hit_rate,
                "seconds": self.seconds, "requests_per_s": self.requests_per_s,
                "output_tokens_per_s": self.output_tokens_per_s, "total_tokens_per_s": self.total_tokens_per_s,
                "latency_mean_s": statistics.fmean(lat) if lat else None,
                "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
                "per_instance": self.per_instance}


def _metric(text: str, name: str) -> float:
    """The value of the sample ``name`` (labels ignored) in a Prometheus text page."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    if m is None:
        raise KeyError(f"no metric {name} on the page")
    return float(m.group(1))


def cache_counts(url: str) -> tuple[float, float]:
    """``(prompt tokens admitted, of those served by the prefix cache)`` of the instance at ``url``."""
    text = httpx.get(url + "/metrics", timeout=10).text
    prompt = _metric(text, "vllm:prompt_tokens_total")
    return prompt, _metric(text, "minillm_prefix_cache_hit_rate") * prompt


async def _send_all(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int, timeout: float):
    queue: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(prompts):
        queue.put_nowait((i, p))
    answers: list = [None] * len(prompts)

    async def client_loop(client: httpx.AsyncClient):
        while not queue.empty():
            i, prompt = queue.get_nowait()
            start = time.perf_counter()
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            try:
                r = await client.post(url + "/v1/completions", json=body)
                answers[i] = (r.status_code, r.json(), r.headers.get("x-minillm-instance"),
                              time.perf_counter() - start)
            except httpx.HTTPError as e:
                answers[i] = (None, {"error": str(e)}, None, time.perf_counter() - start)

    async with httpx.AsyncClient(timeout=timeout) as client:
        await asyncio.wait_for(asyncio.gather(*(client_loop(client) for _ in range(concurrency))), timeout)
    return answers


def run_policy(policy: str, workload: RoutingWorkload, *, instances: int = 2, model: str | os.PathLike = BUNDLED_MODEL,
               block_size: int = 16, num_blocks: int = 64, max_tokens: int = 8, concurrency: int = 1,
               max_in_flight: int | None = None, engine_flags: list[str] = (), threads: int | None = None,
               timeout: float = 600.0) -> PolicyResult:
    """Run ``workload`` through a fresh router and ``instances`` fresh instances with ``policy``.

    ``num_blocks`` and ``block_size``: each instance's KV pool; ``threads``: torch threads per
    instance (default: the cores shared out); ``timeout``: the most seconds the requests may take.
    """
    from minillm.router.app import create_router_app
    from minillm.router.launch import RouterThread, spawn_instances, stop_instances

    threads = threads or max(1, (os.cpu_count() or 1) // instances)
    flags = ["--device", "cpu", "--block-size", str(block_size), "--num-blocks", str(num_blocks), *engine_flags]
    procs = spawn_instances(instances, model, flags, threads=threads)
    try:
        app = create_router_app([p.url for p in procs], model, policy=policy, block_size=block_size,
                                max_in_flight=max_in_flight, health_interval=5.0)
        with RouterThread(app) as url:
            # Warm-up, shorter than a block so that it caches nothing: each instance directly,
            # and the router once (its first request pays for its client and thread pool).
            warm = {"prompt": [1] * max(1, block_size - 1), "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            for target in [p.url for p in procs] + [url]:
                httpx.post(target + "/v1/completions", json=warm, timeout=60)
            before = [cache_counts(p.url) for p in procs]
            start = time.perf_counter()
            answers = asyncio.run(_send_all(url, workload.prompts, max_tokens, concurrency, timeout))
            seconds = time.perf_counter() - start
        after = [cache_counts(p.url) for p in procs]
    finally:
        stop_instances(procs)
    ok = [a for a in answers if a[0] == 200]
    per_instance = []
    for i, ((p0, c0), (p1, c1)) in enumerate(zip(before, after)):
        served = sum(1 for a in ok if a[2] == str(i))
        per_instance.append({"instance": i, "requests": served, "prompt_tokens": round(p1 - p0),
                             "hit_rate": (c1 - c0) / (p1 - p0) if p1 > p0 else 0.0})
    return PolicyResult(
        policy=policy, requests=len(answers), failed=len(answers) - len(ok),
        prompt_tokens=round(sum(a[0] for a in after) - sum(b[0] for b in before)),
        cached_tokens=sum(a[1] for a in after) - sum(b[1] for b in before),
        usage_cached_tokens=sum(a[1]["usage"]["prompt_tokens_details"]["cached_tokens"] for a in ok),
        output_tokens=sum(a[1]["usage"]["completion_tokens"] for a in ok),
        seconds=seconds, latencies=[a[3] for a in ok], per_instance=per_instance)


# == both policies ==============================================================================

def compare_routing(workload: RoutingWorkload | None = None, *, policies=POLICIES, repeats: int = 1,
                    log=None, **run_kwargs) -> dict:
    """Run every policy on ``workload`` (default `RoutingWorkload.random()`), ``repeats`` times,
    alternating; returns ``{"params": ..., "runs": [summary, ...], "table": [row, ...]}`` where
    ``table`` has one row per policy: its hit rate (the same every repeat at ``concurrency=1``;
    the mean otherwise) and its best throughput (the fastest repeat, the usual way to measure on
    a shared machine)."""
    workload = workload or RoutingWorkload.random()
    runs = []
    for r in range(repeats):
        for policy in policies:
            result = run_policy(policy, workload, **run_kwargs)
            runs.append({"repeat": r, **result.summary()})
            if log:
                log(f"{policy:>12} repeat {r}: hit rate {result.hit_rate:.3f}, {result.requests_per_s:.2f} req/s, "
                    f"{result.seconds:.2f} s, failed {result.failed}")
    table = []
    for policy in policies:
        mine = [run for run in runs if run["policy"] == policy]
        best = max(mine, key=lambda run: run["requests_per_s"])
        table.append({"policy": policy, "hit_rate": statistics.fmean(run["hit_rate"] for run in mine),
                      "requests_per_s": best["requests_per_s"], "output_tokens_per_s": best["output_tokens_per_s"],
                      "total_tokens_per_s": best["total_tokens_per_s"], "latency_mean_s": best["latency_mean_s"],
                      "failed": sum(run["failed"] for run in mine),
                      "requests_per_instance": [i["requests"] for i in best["per_instance"]]})
    defaults = {k: v.default for k, v in _run_defaults().items()}
    model = Path(run_kwargs.get("model", defaults["model"]))
    model = "bundled: " + model.name if model.resolve() == Path(BUNDLED_MODEL).resolve() else str(model)
    params = {**defaults, **run_kwargs, "model": model, "repeats": repeats,
              "num_systems": len(workload.systems), "requests_per_system": workload.systems[0].num_requests,
              "system_len": len(workload.systems[0].system), "suffix_len": len(workload.systems[0].suffixes[0]),
              "ideal_hit_rate": workload.ideal_hit_rate(run_kwargs.get("block_size", defaults["block_size"]))}
    params["engine_flags"] = list(params["engine_flags"])
    params["threads"] = params["threads"] or max(1, (os.cpu_count() or 1) // params["instances"])
    return {"params": params, "runs": runs, "table": table}


def _run_defaults() -> dict:
    import inspect

    return {k: p for k, p in inspect.signature(run_policy).parameters.items() if p.kind is p.KEYWORD_ONLY}


def format_table(result: dict) -> str:
    """The policy table as markdown."""
    lines = ["| policy | prefix-cache hit rate | requests/s | output tokens/s | mean latency (s) "
             "| requests per instance |", "|---|---|---|---|---|---|"]
    for row in result["table"]:
        lines.append(f"| {row['policy']} | {row['hit_rate']:.3f} | {row['requests_per_s']:.2f} | "
                     f"{row['output_tokens_per_s']:.1f} | {row['latency_mean_s']:.3f} "
                     f"| {row['requests_per_instance']} |")
    return "\n".join(lines) + "\n"


def result_rows(result: dict, device: str) -> list[dict]:
    """The table as rows of `minillm.results` (``ours``: prefix-aware, ``peer``: round-robin)."""
    by = {row["policy"]: row for row in result["table"]}
    ours, peer = by.get("prefix"), by.get("round_robin")
    if not ours or not peer:
        return []
    p = result["params"]
    params = {k: p[k] for k in ("instances", "num_systems", "requests_per_system", "system_len", "suffix_len",
                                "block_size", "num_blocks", "max_tokens", "concurrency")}
    rows = []
    for metric in ("hit_rate", "requests_per_s", "output_tokens_per_s"):
        a, b = ours[metric], peer[metric]
        rows.append({"benchmark": "ch13_routing", "params": params, "metric": metric, "ours": a,
                     "peer": "round_robin", "peer_value": b, "ratio": a / b if b else None, "better": "higher",
                     "fraction_of_ceiling": None, "note": None, "device": device})
    return rows


# == the script =================================================================================

def cpu_device_name() -> str:
    """``"CPU: <model>, <n> cores"`` (the ``device`` of the results file)."""
    return f"CPU: {cpu_model_name()}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--num-systems", type=int, default=8)
    parser.add_argument("--requests-per-system", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=128)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=64, help="each instance's KV pool, in blocks")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-in-flight", type=int, default=0,
                        help="requests in flight at which an instance counts as saturated (default 0: never)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the result (JSON) here")
    parser.add_argument("--save", action="store_true",
                        help="write it to bench/results/cpu/<cpu-slug>.ch13_routing.json (the committed file)")
    args = parser.parse_args(argv)
    workload = RoutingWorkload.random(args.num_systems, args.requests_per_system, args.system_len, args.suffix_len,
                                      seed=args.seed)
    device = cpu_device_name()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"ch13_routing on {device}; 1-min load average {load}", flush=True)
    result = compare_routing(workload, repeats=args.repeats, log=lambda s: print(s, flush=True),
                             instances=args.instances, block_size=args.block_size, num_blocks=args.num_blocks,
                             max_tokens=args.max_tokens, concurrency=args.concurrency,
                             max_in_flight=args.max_in_flight or None)
    print(format_table(result))
    if args.save:
        from minillm.results import gpu_slug, results_dir

        args.out = str(results_dir() / "cpu" / f"{gpu_slug(device)}.ch13_routing.json")
    if args.out:
        import torch

        doc = {"schema": 1, "benchmark": "ch13_routing", "device": device,
               "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "python": platform.python_version(),
               "torch": torch.__version__, "loadavg_1min_at_start": load,
               "loadavg_1min_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
               **result, "rows": result_rows(result, device)}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
