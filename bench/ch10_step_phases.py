"""Chapter 10: where the time of one engine step goes, on the GPU (the offline workload of
`bench.ch10_fused_decode`, part ``offline``, fused engine with CUDA graphs).

Three views of the same steady-state decode steps:

- **phases** (host wall time): each phase of `LLMEngine._step` is wrapped in a timer, the
  GPU work left asynchronous; the wait for a step's tokens (the pinned copy's CUDA event) is
  a phase of its own: a long wait means the host is ahead of the GPU, a wait near zero that
  the GPU waits for the host;
- **gpu**: CUDA events recorded on the stream before a step's input copies and after its graph
  replay: ``busy`` is the GPU time of one step (copies + replay), ``gap`` the time the stream
  sat empty between the end of one step and the start of the next (the host was late);
- **cprofile**: the top functions by own time over one whole run.

``python -m bench.ch10_step_phases [--out FILE]`` prints a summary and writes the numbers as
JSON. Full 64-sequence pure-decode steps only (as the benchmark's ``decode_step_ms``).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections import defaultdict

import torch

from bench.ch10_fused_decode import BATCH, offline_setup
from bench.common import free_memory


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


class _Timed:
    """Wraps ``owner.name`` so that each call adds its wall time to ``acc[label]``."""

    def __init__(self, acc, owner, name, label):
        self.acc, self.owner, self.name, self.label = acc, owner, name, label
        self.orig = getattr(owner, name)
        self.raw = vars(owner).get(name)   # a classmethod stays one when restored

        def wrapped(*a, **kw):
            t = time.perf_counter()
            try:
                return self.orig(*a, **kw)
            finally:
                acc[label] += time.perf_counter() - t
        setattr(owner, name, wrapped)

    def undo(self):
        if self.raw is not None:
            setattr(self.owner, self.name, self.raw)
        else:
            delattr(self.owner, self.name)


def build(model, tokenizer, **config):
    from minillm.experiments import ch09_engine_benchmark as bench

    return bench.build_engine(model=model, tokenizer=tokenizer,
                              config=bench.bench_engine_config(BATCH, device="cuda", max_model_len=1024,
                                                               fused_decode="on", **config))


def instrumented_run(engine, workload) -> dict:
    """One run of ``workload`` with the phase timers and the CUDA events; per full decode step
    the phases' milliseconds, and the GPU's busy and gap times."""
    import minillm.engine.engine as eng
    from minillm.experiments import ch09_engine_benchmark as bench

    acc: dict[str, float] = defaultdict(float)
    wraps = [_Timed(acc, engine.scheduler, "schedule", "schedule"),
             _Timed(acc, engine.scheduler, "schedule_ahead", "schedule_ahead"),
             _Timed(acc, eng.PagedBatch, "from_manager", "batch_from_manager"),
             _Timed(acc, engine, "_sampling_rows", "sampling_rows"),
             _Timed(acc, engine.runner, "forward_and_sample", "forward_and_sample (host)"),
             _Timed(acc, engine, "sample", "sample"),
             _Timed(acc, engine, "_resolve_ahead", "resolve_ahead"),
             _Timed(acc, engine, "kv_tokens", "record (kv_tokens)")]
    # The wait for a step's tokens: the copy's event, timed.
    orig_copy = eng._copy_to_host

    class TimedEvent:
        def __init__(self, event):
            self.event = event

        def synchronize(self):
            t = time.perf_counter()
            self.event.synchronize()
            acc["wait for tokens"] += time.perf_counter() - t

    def copy(tokens):
        host, event = orig_copy(tokens)
        t = time.perf_counter()
        out = host, (TimedEvent(event) if event is not None else None)
        acc["copy_to_host"] += time.perf_counter() - t
        return out
    eng._copy_to_host = copy
    # GPU events around each replay (copies included).
    runner = engine.runner
    orig_replay = runner.replay
    events: list[tuple] = []

    def replay(graph, batch, sampling=None):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = orig_replay(graph, batch, sampling)
        b.record()
        events.append((a, b, batch.batch_size))
        return out
    runner.replay = replay

    per_step: list[dict] = []
    orig_step = engine._step

    def step():
        acc.clear()
        t = time.perf_counter()
        out = orig_step()
        acc["_step total"] = time.perf_counter() - t
        per_step.append(dict(acc))
        return out
    engine._step = step
    try:
        result = bench.run_offline(engine, workload, use_tqdm=False)
    finally:
        for w in wraps:
            w.undo()
        eng._copy_to_host = orig_copy
        runner.replay = orig_replay
        del engine._step
    torch.cuda.synchronize()
    busy, gap = [], []
    for (a0, b0, n0), (a1, _, n1) in zip(events, events[1:]):
        if n0 == BATCH and n1 == BATCH:
            busy.append(a0.elapsed_time(b0))
            gap.append(max(0.0, b0.elapsed_time(a1)))
    # Steps whose record was a full decode step (the benchmark's decode_step_ms).
    records = engine.steps[-len(per_step):] if per_step else []
    full = [i for i, s in enumerate(records)
            if len(s.tokens) == BATCH and all(n == 1 for n in s.tokens.values())]
    phases = defaultdict(list)
    for i in full:
        if i < len(per_step):
            for k, v in per_step[i].items():
                phases[k].append(1e3 * v)
    return {"output_tokens_per_s": result.output_tokens_per_s, "decode_step_ms": result.decode_step_ms,
            "full_steps": len(full),
            "phase_ms_median": {k: _median(v) for k, v in phases.items()},
            "phase_ms_mean": {k: statistics.fmean(v) for k, v in phases.items()},
            "gpu_busy_ms_median": _median(busy), "gpu_gap_ms_median": _median(gap),
            "gpu_gap_ms_mean": statistics.fmean(gap) if gap else float("nan"),
            "gpu_busy_ms_mean": statistics.fmean(busy) if busy else float("nan")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--overlap", default="auto,off")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    model, tokenizer, workload, warm, base = offline_setup(device)
    from minillm.experiments import ch09_engine_benchmark as bench

    report = {}
    for overlap in args.overlap.split(","):
        engine = build(model, tokenizer, overlap_decode=overlap)
        bench.run_offline(engine, warm, use_tqdm=False)
        plain = [bench.run_offline(engine, workload, use_tqdm=False) for _ in range(2)]
        r = {"plain_output_tokens_per_s": [p.output_tokens_per_s for p in plain],
             "plain_decode_step_ms": [p.decode_step_ms for p in plain]}
        r.update(instrumented_run(engine, workload))
        prof = cProfile.Profile()
        prof.enable()
        bench.run_offline(engine, workload, use_tqdm=False)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        r["cprofile"] = s.getvalue()
        report[overlap] = r
        print(f"== overlap_decode={overlap}: {r['plain_output_tokens_per_s']} tok/s, step "
              f"{r['plain_decode_step_ms']} ms", flush=True)
        for k in ("gpu_busy_ms_median", "gpu_gap_ms_median", "gpu_busy_ms_mean", "gpu_gap_ms_mean", "full_steps"):
            print(f"   {k}: {r[k]}")
        for k, v in sorted(r["phase_ms_median"].items(), key=lambda kv: -kv[1]):
            print(f"   {k:<28} median {v:.3f} ms  mean {r['phase_ms_mean'][k]:.3f} ms")
        print(r["cprofile"], flush=True)
        del engine
        free_memory()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
