"""Chapter 10 benchmark: the engine's host time per decode step, with the model taken out.

A decode step of the engine is host work (schedule, take slots, build the step's batch, sample,
check the stop conditions) around the GPU's forward pass. With CUDA graphs the GPU part of a
64-sequence step of the 280M model is about 1.15 ms on an H100; whatever the host adds on top
is time the GPU waits, unless the two overlap. This benchmark measures the host part alone, on
any machine (no GPU needed):

- the engine is built on a 1-layer random Llama (`minillm.testing.tiny_llama`), and its runner
  is replaced by `minillm.experiments.ch10_host_overhead.FreeRunner`, which returns a fixed logits tensor and its argmax without
  running the model: what remains of `LLMEngine._step` is the host's work;
- the tokens come "from the device" as on a GPU (`LLMEngine.sample_on_device`): the engine's
  sampling path is the one a CUDA step takes (`LLMEngine._sample_from_device`);
- ``NUM_SEQS`` greedy requests (``ignore_eos``) of ``PROMPT_LEN`` tokens are admitted and
  prefilled, then ``STEPS`` pure decode steps are timed one by one: ``host_step_ms`` is the
  median wall time of one ``_step``, in both KV-cache modes (``paged``: Chapter 9's block
  manager with the prefix cache on; ``virtual``: Chapter 11's `VirtualBlockManager` over the
  simulated allocator), with the benchmark's ``record_steps`` on, as in Chapter 9's runs.

`minillm.experiments.ch10_host_overhead.profile_steps` gives the cProfile top list of the same steps (``python -m bench.ch10_host_overhead
--profile``). Rows: ``host_step_ms`` per mode (virtual's row has paged as its peer, ``better``
lower), ``host_us_per_seq``.

On a GPU, ``python -m bench.ch10_host_overhead --gpu-phases [--out FILE]`` attributes the time
of the real engine's steps instead (`gpu_phases`, no rows): each phase of a step, the wait for
its tokens, and the GPU's busy and idle time per step, on the offline workload of
`bench.ch10_fused_decode`.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from bench.common import Results
from minillm.experiments.ch10_host_overhead import MODES, NUM_SEQS, PROMPT_LEN, STEPS, host_step_ms, profile_steps

BENCHMARK = "ch10_host_overhead"
NEEDS_CEILINGS = False


def run(results: Results, device=None) -> None:
    """Measure both modes (on the host: ``device`` is not used) and add the rows."""
    ms = {mode: host_step_ms(mode) for mode in MODES}
    base = {"num_seqs": NUM_SEQS, "prompt_len": PROMPT_LEN, "steps": STEPS, "model": "none (FreeRunner)"}
    for mode in MODES:
        peer = ("paged", ms["paged"]) if mode == "virtual" else (None, None)
        results.add(BENCHMARK, {**base, "kv_cache": mode}, "host_step_ms", ms[mode], *peer, better="lower",
                    note="median wall time of one pure decode step with the model taken out")
        results.add(BENCHMARK, {**base, "kv_cache": mode}, "host_us_per_seq", 1e3 * ms[mode] / NUM_SEQS, better="lower")
        print(f"  [{BENCHMARK}] {mode}: {ms[mode]:.3f} ms per step of {NUM_SEQS} sequences", flush=True)


def summary(results: Results | dict) -> str:
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    return "\n".join(f"{r['params']['kv_cache']:>8}: {r['ours']:.3f} ms of host time per decode step of "
                     f"{r['params']['num_seqs']} sequences" for r in select(data, BENCHMARK, "host_step_ms"))


# == on a GPU: where the time of one engine step goes =============================================
# ``python -m bench.ch10_host_overhead --gpu-phases [--out FILE]``: the offline workload of
# `bench.ch10_fused_decode` (part ``offline``, the fused engine with CUDA graphs), three views of
# its full 64-sequence decode steps:
#
# - phases (host wall time): each phase of `LLMEngine._step` wrapped in a timer, the GPU's work
#   left asynchronous; the wait for a step's tokens (the pinned copy's CUDA event) is a phase of
#   its own: a long wait means the host is ahead of the GPU, one near zero that the GPU waits for
#   the host;
# - gpu: CUDA events on the stream before a step's input copies and after its replay: ``busy``
#   is the GPU time of one step, ``gap`` the time the stream sat empty between two steps;
# - cprofile: the top functions by own time over one whole run.

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


def _build(model, tokenizer, **config):
    from bench.ch10_fused_decode import BATCH
    from minillm.experiments import ch09_engine_benchmark as bench

    return bench.build_engine(model=model, tokenizer=tokenizer,
                              config=bench.bench_engine_config(BATCH, device="cuda", max_model_len=1024,
                                                               fused_decode="on", **config))


def instrumented_run(engine, workload) -> dict:
    """One run of ``workload`` with the phase timers and the CUDA events; per full decode step
    the phases' milliseconds, and the GPU's busy and gap times."""
    import torch

    import minillm.engine.engine as eng
    from bench.ch10_fused_decode import BATCH
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


def gpu_phases(out: str | None = None, overlaps: str = "auto,off") -> dict:
    """`instrumented_run` and a cProfile of the offline workload on the GPU, per
    ``overlap_decode`` setting; printed, and written as JSON to ``out`` when given."""
    import cProfile
    import io
    import json
    import pstats

    import torch

    from bench.ch10_fused_decode import offline_setup
    from bench.common import free_memory

    device = torch.device("cuda")
    model, tokenizer, workload, warm, base = offline_setup(device)
    from minillm.experiments import ch09_engine_benchmark as bench

    report = {}
    for overlap in overlaps.split(","):
        engine = _build(model, tokenizer, overlap_decode=overlap)
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
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    return report



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The engine's host time per decode step (no GPU needed).")
    ap.add_argument("--num-seqs", type=int, default=NUM_SEQS)
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--mode", choices=MODES, action="append", help="KV-cache mode (default both)")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top list too")
    ap.add_argument("--gpu-phases", action="store_true",
                    help="on a GPU: the engine step's phases, GPU busy and gap times on the offline workload")
    ap.add_argument("--out", default=None, help="with --gpu-phases: write the numbers as JSON here")
    args = ap.parse_args(argv)
    if args.gpu_phases:
        gpu_phases(args.out)
        return 0
    for mode in args.mode or MODES:
        ms = host_step_ms(mode, args.num_seqs, args.prompt_len, args.steps)
        print(f"{mode:>8}: {ms:.3f} ms per decode step of {args.num_seqs} sequences "
              f"({1e3 * ms / args.num_seqs:.1f} us per sequence)", flush=True)
        if args.profile:
            print(profile_steps(mode, args.num_seqs, args.prompt_len))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
