"""Chapter 13 benchmark: the engine on two GPUs with tensor parallelism against one GPU, same
model, same run. Needs at least two GPUs (with one it records nothing and says so).

**Model.** Llama-3.2-1B's shape with random weights (`minillm.experiments.ch09_engine_benchmark`,
preset ``llama-3.2-1b``: 16 layers, hidden 2048, 32 query and 8 KV heads of 64, SwiGLU 8192,
tied embeddings, vocabulary 4096 from the bundled tokenizer), bf16. Under TP=2 each rank holds
16 query and 4 KV heads, half the MLP and half the vocabulary (`minillm.distributed.tp`).

**Engines.** Both degrees run the same code: `minillm.distributed.load_parallel_model` with
one rank (this process alone) or two (this process is rank 0 on ``cuda:0``, a spawned process
rank 1 on ``cuda:1``, NCCL), under `LLMEngine`; rank 0 samples. Each degree runs twice
(``MINILLM_CH13_FUSED`` chooses, below): with Chapter 10's fused decode path on every rank
(``fused: on``, the engine's GPU default: its row-parallel GEMVs all-reduce their partial sums,
and rank 0 draws the tokens inside its graphs) and with the plain layers (``fused: off``; rank 0
samples the gathered logits on the host).
CUDA graphs for every step (``cuda_graphs="all"``; each rank captures its own graphs, its
all-reduces inside them); ``mode`` in the rows says whether the graphs were captured
(``cuda_graphs``) or the engine fell back to ``eager``.

**Measurements**, each after a warm-up run (Triton compiles, the flat GEMM tunes, graphs are
captured before the clock starts):

- ``decode_ms_per_token`` (kind ``decode``): one request alone, a prompt of
  ``DECODE_PROMPT`` random tokens, ``DECODE_TOKENS`` greedy output tokens; the median wall
  time of its one-token steps (scheduling, the plan's broadcast, the forward pass, sampling).
- ``output_tokens_per_s`` (kind ``offline``): a small Chapter 9 workload (``NUM_REQUESTS``
  requests, prompts of 32-512 tokens, outputs of 32-256, ``CONCURRENCY`` at once), all
  submitted at once.
- ``allreduce_us`` (kind ``allreduce``, TP=2): one all-reduce of a ``[tokens, 2048]`` bf16
  activation over NCCL, alone, for 1, ``CONCURRENCY`` and 2048 tokens
  (`minillm.distributed.worker.time_all_reduce`: back-to-back calls between CUDA events),
  ``launch`` ``eager`` (each call launched from Python, as an eager step pays it) and ``graph``
  (the calls replayed from one CUDA graph, as a captured step pays it);
  ``comm_ms_per_decode_step``: the 1-token time x (2 per layer + 1) all-reduces, the
  communication a single-sequence decode step cannot avoid, and ``plan_delay_us``: how long a
  decode step's command takes from rank 0's send to the other rank's receipt
  (`minillm.distributed.worker.command_delay_us`, one host clock).
- ``scaling_efficiency`` (kind ``scaling``): ``speedup / 2``, for the decode latency and the
  offline throughput (1.0 = perfect scaling).

Rows carry ``params``: kind, tp, fused, mode, model, dtype and the workload's shape; TP=2 rows
name TP=1 with the same ``fused`` as their peer (ratio > 1: TP=2 is better).

**Settings.** ``MINILLM_CH13_FUSED`` (default ``"on off"``, words separated by spaces or
commas) chooses the fused settings to run, in that order: ``MINILLM_CH13_FUSED=on`` measures
the fused path alone, in about half the time. ``MINILLM_CH13_REQUESTS`` (default 64) sets the
offline workload's number of requests.

**A run cut short keeps what it measured.** `bench.run` saves the results when the run ends or
is interrupted by a signal it can catch; a run killed outright (``SIGKILL``, e.g. by a time
limit while a rank is blocked in a collective or the ranks are shutting down) saves nothing.
So as soon as each (fused, TP) configuration is measured, before its engine is shut down, the
benchmark adds its rows and prints them to stdout as one line,
``  [ch13_tensor_parallel] rows: `` followed by JSON (``{"tp", "fused", "rows"}``, the rows as
`Results.add` made them; the TP=2 line also carries that fused setting's scaling rows), and the
log of a killed run still holds every configuration that finished (`rows_from_log` reads them
back). The results file itself is not written here: `Results.save` needs the folder that
`bench.run` was given (``--out``), which a benchmark does not receive.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import time

import torch

from bench.common import Results, free_memory

BENCHMARK = "ch13_tensor_parallel"
NEEDS_CEILINGS = False

PRESET = "llama-3.2-1b"
DTYPE = "bfloat16"
WORLDS = (1, 2)
FUSED_CHOICES = ("on", "off")
DECODE_PROMPT, DECODE_TOKENS = 128, 256
NUM_REQUESTS = int(os.environ.get("MINILLM_CH13_REQUESTS", 64))
CONCURRENCY = 32
PROMPT_LEN = (32, 512)
OUTPUT_LEN = (32, 256)
ALLREDUCE_TOKENS = (1, CONCURRENCY, 2048)
PEER = "tp1"
ROWS_PREFIX = f"  [{BENCHMARK}] rows: "


def fused_settings(value: str | None = None) -> tuple[str, ...]:
    """The fused settings to run: ``value`` (default ``$MINILLM_CH13_FUSED``, else ``"on off"``),
    words separated by spaces or commas, each ``on`` or ``off``; duplicates dropped, order kept."""
    if value is None:
        value = os.environ.get("MINILLM_CH13_FUSED", " ".join(FUSED_CHOICES))
    chosen = tuple(dict.fromkeys(w.lower() for w in re.split(r"[\s,]+", value) if w))
    bad = [w for w in chosen if w not in FUSED_CHOICES]
    if bad or not chosen:
        raise ValueError(f"MINILLM_CH13_FUSED={value!r}: expected words among {FUSED_CHOICES}")
    return chosen


def rows_from_log(text: str) -> list[dict]:
    """The rows printed by a run (see the module docstring), from its log, in order."""
    return [r for line in text.splitlines() if line.startswith(ROWS_PREFIX)
            for r in json.loads(line[len(ROWS_PREFIX):])["rows"]]


def engine_config(fused: str = "on"):
    """The benchmark's engine: CUDA graphs for every step, Chapter 10's fused path ``fused``."""
    from minillm.experiments.ch09_engine_benchmark import bench_engine_config

    return bench_engine_config(CONCURRENCY, device="cuda", dtype=DTYPE, max_num_batched_tokens=2048,
                               gpu_memory_utilization=0.5, cuda_graphs="all", fused_decode=fused)


def run(results: Results, device) -> None:
    from minillm.experiments import ch09_engine_benchmark as bench

    if torch.cuda.device_count() < 2:
        print(f"  [{BENCHMARK}] needs 2 GPUs, this machine has {torch.cuda.device_count()}: nothing measured",
              flush=True)
        return
    settings = fused_settings()   # a bad MINILLM_CH13_FUSED fails here, before the model is built
    t0 = time.perf_counter()
    path = bench.build_random_llama(PRESET, dtype=DTYPE, device="cuda")
    from minillm.model.config import ModelConfig

    mconfig = ModelConfig.from_json(path)
    n_params = bench.count_parameters(bench.PRESETS[PRESET], mconfig.vocab_size, mconfig.tie_word_embeddings)
    spec = bench.WorkloadSpec(NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN, seed=0)
    workload = bench.make_workload(spec, mconfig.vocab_size)
    warmup = bench.make_workload(bench.WorkloadSpec(CONCURRENCY, PROMPT_LEN, (8, 16), seed=1000), mconfig.vocab_size)
    decode_req = bench.make_workload(bench.WorkloadSpec(1, (DECODE_PROMPT, DECODE_PROMPT),
                                                        (DECODE_TOKENS, DECODE_TOKENS), seed=7), mconfig.vocab_size)
    base = {"model": PRESET + "-random", "parameters_m": round(n_params / 1e6, 1), "dtype": DTYPE}
    print(f"  [{BENCHMARK}] {path.name}: {n_params / 1e6:.0f}M parameters ({time.perf_counter() - t0:.1f} s to "
          f"build); {spec.describe()}", flush=True)

    measured: dict[tuple[str, int], dict] = {}

    def record(fused: str, world: int, m: dict) -> None:
        measured[(fused, world)] = m
        first = len(results.rows)
        _add_rows(results, base, world, fused, measured)
        if world == WORLDS[-1]:
            _add_scaling(results, base, fused, measured)
        # one line per configuration, so that a run killed later still has these rows in its log
        print(ROWS_PREFIX + json.dumps({"tp": world, "fused": fused, "rows": results.rows[first:]}, default=str),
              flush=True)

    for fused in settings:
        for world in WORLDS:
            _measure(path, world, fused, mconfig, warmup, decode_req, workload,
                     lambda m, fused=fused, world=world: record(fused, world, m))


def _measure(path, world: int, fused: str, mconfig, warmup, decode_req, workload, on_measured) -> dict:
    """One engine's numbers (see the module docstring), handed to ``on_measured`` before the
    engine is shut down: shutting two NCCL ranks down can outlast a run's time limit (a run
    on two H200 was killed there, after its last measurement)."""
    from minillm.experiments import ch09_engine_benchmark as bench

    t1 = time.perf_counter()
    engine = _engine(path, world, fused)
    try:
        bench.run_offline(engine, warmup, use_tqdm=False)
        mode = "cuda_graphs" if engine.runner.cuda_graphs else "eager"
        setup = time.perf_counter() - t1
        m = {"mode": mode, "runner": engine.runner.describe(), "fused_on": engine.fused_decode}
        bench.run_offline(engine, decode_req, use_tqdm=False)
        one = [1e3 * (s.end - s.start) for s in engine.steps if sum(s.tokens.values()) == 1]
        m["decode_ms_per_token"] = bench.percentile(one, 50)
        r = m["offline"] = bench.run_offline(engine, workload, mode=mode, use_tqdm=False)
        if world > 1:
            from minillm.distributed.worker import command_delay_us, time_all_reduce

            for how, in_graph in (("eager", False), ("graph", True)):
                m[f"allreduce_{how}_us"] = engine.model.run_on_all_ranks(
                    time_all_reduce, mconfig.hidden_size, ALLREDUCE_TOKENS, getattr(torch, DTYPE),
                    in_graph=in_graph)
            # a step replayed from a graph pays the captured all-reduce's time, an eager step the eager one
            ar = m["allreduce_graph_us" if mode == "cuda_graphs" else "allreduce_eager_us"]
            m["comm_ms_per_decode_step"] = ar[1] * (2 * mconfig.num_hidden_layers + 1) / 1e3
            step = _decode_step_fields(CONCURRENCY, engine.max_model_len // engine.config.block_size)
            delays = [max(engine.model.run_on_all_ranks(command_delay_us, time.perf_counter(), step)[1:])
                      for _ in range(50)]
            m["plan_delay_us"] = bench.percentile(delays, 50)
        print(f"  [{BENCHMARK}] TP={world} fused={fused} ({m['runner']}; fused path "
              f"{'on' if m['fused_on'] else 'off'}; setup+warm-up {setup:.1f} s): decode "
              f"{m['decode_ms_per_token']:.2f} ms/token, offline {r.output_tokens_per_s:,.0f} output tok/s "
              f"({r.preemptions} preemptions, {r.num_kv_blocks} KV blocks)"
              + "".join(f"; all-reduce ({how}) " + ", ".join(f"{n} tok {us:.1f} us" for n, us in m[key].items())
                        for how, key in (("eager", "allreduce_eager_us"), ("in a graph", "allreduce_graph_us"))
                        if key in m)
              + (f"; a step's command reaches the ranks in {m['plan_delay_us']:.0f} us" if world > 1 else ""),
              flush=True)
        on_measured(m)
        return m
    finally:
        if hasattr(engine.model, "shutdown"):
            engine.model.shutdown()
        del engine
        gc.collect()
        free_memory()


def _decode_step_fields(batch: int, max_blocks: int) -> dict:
    """`minillm.distributed.worker.batch_fields` of a decode step of ``batch`` sequences whose
    block tables are ``max_blocks`` wide: what a step's command carries."""
    from minillm.distributed.worker import batch_fields
    from minillm.model.paged import PagedBatch

    n = torch.arange(batch)
    return batch_fields(PagedBatch(input_ids=n, positions=n, slot_mapping=n,
                                   cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
                                   seq_lens=torch.ones(batch, dtype=torch.int32),
                                   block_tables=torch.zeros(batch, max_blocks, dtype=torch.int32),
                                   max_seqlen_q=1, max_seq_len=1))


def _engine(path, world: int, fused: str):
    """`LLMEngine` over `load_parallel_model` with ``world`` ranks (one: the same code, alone)."""
    from minillm.distributed import load_parallel_model
    from minillm.engine import LLMEngine
    from minillm.model import load_tokenizer

    model = load_parallel_model(path, world, device="cuda", dtype=DTYPE)
    tokenizer, template = load_tokenizer(path)
    return LLMEngine(model, tokenizer, dataclasses.replace(engine_config(fused), tensor_parallel_size=world),
                     chat_template=template)


def _add_rows(results: Results, base: dict, world: int, fused: str, measured: dict) -> None:
    m, ref = measured[(fused, world)], measured.get((fused, 1)) if world > 1 else None
    peer = (lambda key: ref[key]) if ref else (lambda key: None)  # noqa: E731
    params = {**base, "tp": world, "fused": fused, "mode": m["mode"]}
    results.add(BENCHMARK, {**params, "kind": "decode", "prompt_len": DECODE_PROMPT, "output_len": DECODE_TOKENS},
                "decode_ms_per_token", m["decode_ms_per_token"], PEER if ref else None, peer("decode_ms_per_token"),
                better="lower", note=f"median one-token step of one request alone; {m['runner']}")
    r = m["offline"]
    off = {**params, "kind": "offline", "num_requests": NUM_REQUESTS, "concurrency": CONCURRENCY,
           "prompt_len": f"{PROMPT_LEN[0]}-{PROMPT_LEN[1]}", "output_len": f"{OUTPUT_LEN[0]}-{OUTPUT_LEN[1]}"}
    for metric in ("output_tokens_per_s", "total_tokens_per_s", "elapsed_s"):
        results.add(BENCHMARK, off, metric, getattr(r, metric), PEER if ref else None,
                    getattr(ref["offline"], metric) if ref else None)
    results.add(BENCHMARK, off, "preemptions", r.preemptions, better="lower")
    results.add(BENCHMARK, off, "kv_pool_blocks", r.num_kv_blocks, better="higher",
                note="each rank's pool holds its KV heads only: TP=2 fits twice the blocks in the same memory")
    if "allreduce_eager_us" in m:
        for how, what in (("eager", "launched one by one"), ("graph", "replayed from one CUDA graph")):
            for tokens, us in m[f"allreduce_{how}_us"].items():
                results.add(BENCHMARK, {**params, "kind": "allreduce", "tokens": tokens, "launch": how},
                            "allreduce_us", us, better="lower",
                            note=f"one NCCL all-reduce of [{tokens}, hidden] {DTYPE}, alone, {what}, CUDA events")
        results.add(BENCHMARK, {**params, "kind": "allreduce", "tokens": 1}, "comm_ms_per_decode_step",
                    m["comm_ms_per_decode_step"], better="lower",
                    note="the 1-token all-reduce (captured when the engine replays graphs) x (2 per layer + 1 "
                         "for the embedding)")
        results.add(BENCHMARK, {**params, "kind": "allreduce"}, "plan_delay_us", m["plan_delay_us"], better="lower",
                    note=f"from rank 0's send of a {CONCURRENCY}-sequence decode step's command to the last "
                         "rank's receipt (a pipe per rank, pickled), median of 50")


def _add_scaling(results: Results, base: dict, fused: str, measured: dict) -> None:
    if (fused, 1) not in measured or (fused, 2) not in measured:
        return
    one, two = measured[(fused, 1)], measured[(fused, 2)]
    params = {**base, "tp": 2, "fused": fused, "mode": two["mode"], "kind": "scaling"}
    decode = one["decode_ms_per_token"] / two["decode_ms_per_token"] / 2
    offline = two["offline"].output_tokens_per_s / one["offline"].output_tokens_per_s / 2
    results.add(BENCHMARK, {**params, "of": "decode_ms_per_token"}, "scaling_efficiency", decode, better="higher",
                note="(TP=1 time / TP=2 time) / 2; 1.0 = perfect")
    results.add(BENCHMARK, {**params, "of": "output_tokens_per_s"}, "scaling_efficiency", offline, better="higher",
                note="(TP=2 throughput / TP=1 throughput) / 2; 1.0 = perfect")


def summary(results: Results | dict) -> str:
    """Per TP degree and fused path: decode ms/token, offline tok/s, the 1-token all-reduce
    (launched alone and replayed from a graph), the communication per step; the scaling."""
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    by_run: dict = {}
    for r in select(data, BENCHMARK):
        p = r["params"]
        by_run.setdefault((p.get("tp"), p.get("fused", "off")), {}).setdefault(
            (p["kind"], r["metric"], p.get("tokens"), p.get("of"), p.get("launch")), r)
    lines = [f"{'TP':<3} {'fused':<6} {'mode':<12} {'decode ms/tok':>13} {'out tok/s':>10} {'all-reduce 1 tok us':>20} "
             f"{'(in a graph)':>12} {'comm ms/step':>12}"]
    for tp, fused in sorted(k for k in by_run if k[0] is not None):
        m = by_run[(tp, fused)]
        val = lambda *key, launch=None: (m.get((*key, launch)) or {}).get("ours")  # noqa: E731
        mode = next((r["params"].get("mode") for r in m.values()), "")
        lines.append(f"{tp:<3} {fused:<6} {mode:<12} {_g(val('decode', 'decode_ms_per_token', None, None), '.2f'):>13} "
                     f"{_g(val('offline', 'output_tokens_per_s', None, None), ',.0f'):>10} "
                     f"{_g(val('allreduce', 'allreduce_us', 1, None, launch='eager'), '.1f'):>20} "
                     f"{_g(val('allreduce', 'allreduce_us', 1, None, launch='graph'), '.1f'):>12} "
                     f"{_g(val('allreduce', 'comm_ms_per_decode_step', 1, None), '.3f'):>12}")
    for (tp, fused), m in sorted((k, v) for k, v in by_run.items() if k[0] == 2):
        eff = [(of, (m.get(("scaling", "scaling_efficiency", None, of, None)) or {}).get("ours"))
               for of in ("decode_ms_per_token", "output_tokens_per_s")]
        lines.append(f"scaling efficiency (TP=2, fused {fused}): " + ", ".join(f"{of} {_g(v, '.2f')}" for of, v in eff))
    return "\n".join(lines)


def _g(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


if __name__ == "__main__":
    from bench.run import main

    raise SystemExit(main(["--only", BENCHMARK]))
