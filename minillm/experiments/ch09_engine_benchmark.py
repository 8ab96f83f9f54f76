"""Chapter 9: ``minillm bench``, the engine's throughput and latency on a synthetic workload.

**The workload** (`WorkloadSpec`, `make_workload`): ``num_requests`` requests, each a prompt
of random token ids (uniform over the vocabulary) whose length is drawn uniformly from
``prompt_len = (lo, hi)`` (inclusive), and an output length drawn uniformly from
``output_len``; everything from one seeded NumPy generator, so a spec is the same workload on
every machine. Requests are greedy with ``ignore_eos``, so each produces exactly its output
length: a random-weight model is fine, and every system does the same work.

**Offline throughput** (`run_offline`): every request is submitted at once to an engine with
``max_num_seqs = concurrency``; continuous batching runs them to the end. Reported: output
tokens/s and total (prompt + output) tokens/s over the wall time from submission to the last
token, requests/s, the engine's steps, the KV memory waste averaged over the steps (`kv_waste`:
the unused slots of the blocks in use, i.e. the partly filled last block of each sequence), the
preemptions and the peak number of blocks in use.

**Online serving latency** (`run_online`): requests arrive as a Poisson process of ``rate``
requests per second (exponential gaps, seeded), injected between engine steps by the wall
clock, in-process (no HTTP). Per request: **TTFT** (arrival to first token), **TPOT** (mean
time per output token after the first: ``(last - first) / (n - 1)``) and **ITL** (every gap
between consecutive tokens, all requests pooled); each at p50 and p99 (`percentile`, linear
interpolation), plus end-to-end latency. A request's arrival is its scheduled time, not the
(later) moment the loop got to it, so waiting for a step counts against TTFT, as it would for
a real client.

**The peer** (`run_hf_static`): Hugging Face transformers ``generate`` on the same model,
device and dtype, with *static batching*: the requests in order, ``concurrency`` at a time,
prompts left-padded to the longest of the batch, greedy, ``max_new_tokens`` = the longest
output of the batch (end-of-sequence disabled). Each batch runs until its longest request is
done; the others keep decoding tokens nobody asked for. Only the tokens each request asked for
count as output, so the work static batching wastes (padding, and the tail of the longest
request) shows in its throughput: that waste is what continuous batching removes.
``useful_fraction`` is the asked-for tokens over the tokens generated. Both sides are warm when
timed: minillm after a smaller run of the same workload shape (Triton compiles, the flat GEMM
tunes, CUDA graphs are captured), transformers after one untimed batch of the workload's first
requests (its attention sets itself up per KV length: a cold first batch ran 3x slower on an
H200).

**The model** (`build_random_llama`): by default a Llama-format checkpoint with random weights
built locally with ``transformers.LlamaConfig`` (preset ``llama-280m`` on a GPU: 24 layers,
hidden 1024, 16 query heads and 4 KV heads of 64, SwiGLU 2816, 279M parameters; ``llama-tiny``
on a CPU), saved with the bundled tokenizer (vocabulary 4096), cached under
``~/.cache/minillm/models`` (``MINILLM_CACHE`` overrides). ``--model PATH`` takes any local
checkpoint instead.

    minillm bench                                     # offline + online, peer included
    minillm bench --mode offline --num-requests 128 --concurrency 64 --json out.json
    minillm bench --model minillm/checkpoints/shakespeare --device cpu --peer none
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from minillm.decoding.sampling import SamplingParams
from minillm.engine.config import EngineConfig
from minillm.engine.engine import LLMEngine, StepRecord

__all__ = ["BENCH_ENGINE_DEFAULTS", "BenchConfig", "BenchRequest", "LatencySummary", "OfflineResult", "OnlineResult", "PRESETS", "WorkloadSpec",
           "add_arguments", "bench_engine_config", "build_engine", "build_random_llama", "kv_waste", "latency_summary", "main",
           "make_workload", "percentile", "poisson_arrivals", "run_hf_static", "run_offline", "run_online"]

BUNDLED = Path(__file__).resolve().parent.parent / "checkpoints" / "shakespeare"

# == the workload ====================================================================================


@dataclass(frozen=True)
class WorkloadSpec:
    """A synthetic workload: ``num_requests`` prompts of random token ids, prompt and output
    lengths uniform over the inclusive ranges, all drawn from ``seed``."""

    num_requests: int = 256
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (32, 512)
    seed: int = 0

    def __post_init__(self):
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")

    def describe(self) -> str:
        return (f"{self.num_requests} requests, prompts {self.prompt_len[0]}-{self.prompt_len[1]} tokens, "
                f"outputs {self.output_len[0]}-{self.output_len[1]} tokens (uniform), seed {self.seed}")


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int


def make_workload(spec: WorkloadSpec, vocab_size: int) -> list[BenchRequest]:
    """The requests of ``spec``: token ids uniform in ``[0, vocab_size)``."""
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    prompt_lens = rng.integers(spec.prompt_len[0], spec.prompt_len[1] + 1, n)
    output_lens = rng.integers(spec.output_len[0], spec.output_len[1] + 1, n)
    return [BenchRequest(rng.integers(0, vocab_size, int(p)).tolist(), int(o))
            for p, o in zip(prompt_lens, output_lens)]


def sampling_params(request: BenchRequest) -> SamplingParams:
    """Greedy, exactly ``max_tokens`` tokens."""
    return SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start) of ``n`` requests of a Poisson process of
    ``rate`` requests per second: cumulative exponential gaps of mean ``1 / rate``; the first
    request arrives at 0. ``rate = inf`` sends everything at 0."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# == metrics ==========================================================================================


def percentile(values, q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, NumPy's linear interpolation; ``None``
    for no values."""
    values = [float(v) for v in values]
    return float(np.percentile(values, q)) if values else None


def kv_waste(steps: list[StepRecord], block_size: int) -> tuple[float, float]:
    """``(mean, max)`` over the steps of the fraction of slots in used blocks that hold no
    token: ``1 - kv_tokens / (blocks_used * block_size)`` (`LLMEngine.kv_waste`, recorded after
    each step). Steps that hold no block are skipped; ``(0, 0)`` when none holds any."""
    waste = [1 - s.kv_tokens / (s.blocks_used * block_size) for s in steps if s.blocks_used > 0]
    return (float(np.mean(waste)), float(max(waste))) if waste else (0.0, 0.0)


@dataclass
class LatencySummary:
    """Per-request latencies in milliseconds: p50 / p99 / mean of TTFT, TPOT, ITL and
    end-to-end latency (``None`` where there was nothing to measure, e.g. TPOT of one-token
    outputs)."""

    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    ttft_mean_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    tpot_mean_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    itl_mean_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None


def latency_summary(metrics) -> LatencySummary:
    """From `minillm.engine.request.RequestMetrics` of finished requests (``arrival``,
    ``first_token``, ``token_times`` of completion 0, ``finished``)."""
    ttft, tpot, itl, e2e = [], [], [], []
    for m in metrics:
        if m.first_token is None:
            continue
        ttft.append(m.first_token - m.arrival)
        times = m.token_times
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl.extend(b - a for a, b in zip(times, times[1:]))
        if m.finished is not None:
            e2e.append(m.finished - m.arrival)

    def ms(x):
        return None if x is None else 1e3 * x

    def mean(xs):
        return float(np.mean(xs)) if xs else None

    return LatencySummary(ms(percentile(ttft, 50)), ms(percentile(ttft, 99)), ms(mean(ttft)),
                          ms(percentile(tpot, 50)), ms(percentile(tpot, 99)), ms(mean(tpot)),
                          ms(percentile(itl, 50)), ms(percentile(itl, 99)), ms(mean(itl)),
                          ms(percentile(e2e, 50)), ms(percentile(e2e, 99)))


# == the model ========================================================================================

#: Random-weight Llama shapes (``transformers.LlamaConfig`` fields), vocabulary = the bundled
#: tokenizer's. ``llama-280m``: deep and narrow like the small open Llamas (24 layers, GQA 4:1).
PRESETS = {
    "llama-280m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=64, max_position_embeddings=2048),
    "llama-tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, max_position_embeddings=1024),
    # Chapter 13's: Llama-3.2-1B's shape (tied embeddings), with the bundled tokenizer's vocabulary.
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True),
}


def default_preset(device: str) -> str:
    return "llama-280m" if device == "cuda" else "llama-tiny"


def cache_dir() -> Path:
    return Path(os.environ.get("MINILLM_CACHE") or Path.home() / ".cache" / "minillm") / "models"


def count_parameters(config: dict, vocab_size: int, tied: bool = False) -> int:
    """Parameters of a Llama of these ``LlamaConfig`` fields (norms included)."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
    return layers * per_layer + h + vocab_size * h * (1 if tied else 2)


def build_random_llama(preset: str = "llama-280m", directory: str | os.PathLike | None = None, seed: int = 0,
                       dtype: str = "bfloat16", device: str | None = None) -> Path:
    """A Llama-format checkpoint folder with random weights (``transformers`` initialisation,
    ``torch.manual_seed(seed)``), the bundled tokenizer and a ``config.json`` that both
    minillm and transformers load; built once and reused (``directory`` defaults to
    ``<cache>/<preset>-seed<seed>-<dtype>``). Initialised on ``device`` (default: CUDA when
    available), so the weights differ between a GPU and a CPU build: they are random anyway."""
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    path = Path(directory) if directory is not None else cache_dir() / f"{preset}-seed{seed}-{dtype}"
    if all((path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return path
    vocab = Tokenizer.from_file(str(BUNDLED / "tokenizer.json")).get_vocab_size()
    config = LlamaConfig(vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=0, eos_token_id=0,
                         **{"tie_word_embeddings": False, **PRESETS[preset]})
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(getattr(torch, dtype)).eval()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / name, tmp / name)
    (tmp / "README.md").write_text(
        f"Random-weight Llama ({preset}, {count_parameters(PRESETS[preset], vocab, config.tie_word_embeddings) / 1e6:.0f}"
        f"M parameters, seed "
        f"{seed}, {dtype}) built by minillm.experiments.ch09_engine_benchmark.build_random_llama for `minillm bench`; "
        "tokenizer: minillm/checkpoints/shakespeare. Its outputs are meaningless: it is for throughput.\n")
    del model
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


# == minillm ==========================================================================================


def build_engine(model_path=None, *, model=None, tokenizer=None, config: EngineConfig | None = None,
                 **fields) -> LLMEngine:
    """An `LLMEngine` from a checkpoint folder, or around an already loaded ``model`` and
    ``tokenizer`` (several engines, one copy of the weights). ``config``: the `EngineConfig`;
    else ``fields`` are its fields (``cuda_graphs="off"`` for the eager engine; ``max_n``
    defaults to at most ``max_num_seqs``)."""
    if config is None:
        fields.setdefault("max_n", min(EngineConfig.max_n, fields.get("max_num_seqs", EngineConfig.max_num_seqs)))
        config = EngineConfig(**fields)
    elif fields:
        config = replace(config, **fields)
    if model is None:
        return LLMEngine.from_pretrained(model_path, config)
    return LLMEngine(model, tokenizer, config, model_name=Path(model_path or "model").name)


@dataclass
class OfflineResult:
    """One offline run. Token rates count the tokens each request asked for."""

    system: str
    mode: str
    num_requests: int
    concurrency: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    generated_tokens: int            # tokens produced, wasted ones included (HF static batching)
    useful_fraction: float           # output_tokens / generated_tokens
    steps: int | None = None         # engine steps (HF: decode steps of all batches)
    kv_waste_mean: float | None = None
    kv_waste_max: float | None = None
    preemptions: int | None = None
    peak_kv_blocks: int | None = None
    num_kv_blocks: int | None = None
    decode_step_ms: float | None = None  # median wall time of full pure-decode steps
    eager_steps: int | None = None       # steps the model ran eagerly (the rest replayed a CUDA graph)


def _reset_engine_counters(engine: LLMEngine) -> tuple[int, int, int]:
    engine.steps.clear()
    engine.config.record_steps = True
    return engine.scheduler.num_preemptions, engine.runner.num_eager, engine.stats.steps


def run_offline(engine: LLMEngine, workload: list[BenchRequest], *, mode: str = "", use_tqdm: bool = True,
                desc: str = "minillm offline") -> OfflineResult:
    """Submit every request at once, step until all are done (see the module docstring)."""
    preempt0, eager0, steps0 = _reset_engine_counters(engine)
    total_out = sum(r.max_tokens for r in workload)
    produced: dict[str, int] = {}
    start = time.perf_counter()
    ids = [engine.add_request(r.prompt_ids, sampling_params(r)) for r in workload]
    with tqdm(total=total_out, desc=desc, unit="tok", disable=not use_tqdm, leave=False) as bar:
        while engine.has_unfinished_requests():
            for request in engine._step():
                if request.finished:
                    produced[request.request_id] = len(request.output().outputs[0].token_ids)
                    bar.update(produced[request.request_id])
    elapsed = time.perf_counter() - start
    wrong = [(i, produced.get(i), r.max_tokens) for i, r in zip(ids, workload) if produced.get(i) != r.max_tokens]
    if wrong:
        raise RuntimeError(f"{len(wrong)} requests did not produce exactly max_tokens tokens, e.g. {wrong[:3]}")
    return _engine_result(engine, workload, mode, elapsed, preempt0, eager0, steps0)


def _engine_result(engine, workload, mode, elapsed, preempt0, eager0, steps0) -> OfflineResult:
    prompt = sum(len(r.prompt_ids) for r in workload)
    out = sum(r.max_tokens for r in workload)
    records = list(engine.steps)
    waste_mean, waste_max = kv_waste(records, engine.manager.block_size)
    full = [1e3 * (s.end - s.start) for s in records
            if len(s.tokens) == engine.config.max_num_seqs and all(n == 1 for n in s.tokens.values())]
    return OfflineResult(
        system="minillm", mode=mode, num_requests=len(workload), concurrency=engine.config.max_num_seqs,
        elapsed_s=elapsed, prompt_tokens=prompt, output_tokens=out, output_tokens_per_s=out / elapsed,
        total_tokens_per_s=(prompt + out) / elapsed, requests_per_s=len(workload) / elapsed, generated_tokens=out,
        useful_fraction=1.0, steps=engine.stats.steps - steps0, kv_waste_mean=waste_mean, kv_waste_max=waste_max,
        preemptions=engine.scheduler.num_preemptions - preempt0,
        peak_kv_blocks=max((s.blocks_used for s in records), default=0), num_kv_blocks=engine.manager.num_blocks,
        decode_step_ms=percentile(full, 50), eager_steps=engine.runner.num_eager - eager0)


@dataclass
class OnlineResult:
    """One online run at ``request_rate`` requests/s (Poisson)."""

    system: str
    mode: str
    request_rate: float
    num_requests: int
    elapsed_s: float
    output_tokens_per_s: float
    requests_per_s: float
    latency: LatencySummary
    preemptions: int
    kv_waste_mean: float
    peak_kv_blocks: int


def run_online(engine: LLMEngine, workload: list[BenchRequest], rate: float, *, seed: int = 0, mode: str = "",
               use_tqdm: bool = True) -> OnlineResult:
    """Poisson arrivals at ``rate`` requests/s, injected between steps by the wall clock; a
    request's arrival time is its scheduled one (see the module docstring)."""
    preempt0, _, _ = _reset_engine_counters(engine)
    arrivals = poisson_arrivals(len(workload), rate, seed)
    metrics = []
    start = time.perf_counter()
    nxt = 0
    with tqdm(total=len(workload), desc=f"minillm online {rate:g} req/s", unit="req", disable=not use_tqdm,
              leave=False) as bar:
        while nxt < len(workload) or engine.has_unfinished_requests():
            now = time.perf_counter()
            while nxt < len(workload) and start + arrivals[nxt] <= now:
                r = workload[nxt]
                rid = engine.add_request(r.prompt_ids, sampling_params(r))
                engine.requests[rid].metrics.arrival = start + arrivals[nxt]
                nxt += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, start + arrivals[nxt] - time.perf_counter()))
                continue
            for request in engine._step():
                if request.finished:
                    metrics.append(request.metrics)
                    bar.update()
    elapsed = time.perf_counter() - start
    out = sum(r.max_tokens for r in workload)
    waste_mean, _ = kv_waste(list(engine.steps), engine.manager.block_size)
    return OnlineResult("minillm", mode, rate, len(workload), elapsed, out / elapsed, len(workload) / elapsed,
                        latency_summary(metrics), engine.scheduler.num_preemptions - preempt0, waste_mean,
                        max((s.blocks_used for s in engine.steps), default=0))


# == the peer: transformers, static batching ==========================================================


def load_hf_model(model_path, device, dtype):
    import transformers
    from transformers import AutoModelForCausalLM

    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(str(model_path), **{key: dtype})
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # outputs of exactly max_new_tokens (like ignore_eos)
    return model


@torch.inference_mode()
def run_hf_static(model, workload: list[BenchRequest], concurrency: int, *, pad_token_id: int = 0,
                  use_tqdm: bool = True) -> OfflineResult:
    """Transformers ``generate`` with static batching (see the module docstring): the
    requests in order, ``concurrency`` per batch, left-padded, greedy, each batch run to its
    longest output."""
    from transformers import GenerationConfig

    device = model.device
    prompt = sum(len(r.prompt_ids) for r in workload)
    out = sum(r.max_tokens for r in workload)
    generated = steps = 0
    batches = [workload[i:i + concurrency] for i in range(0, len(workload), concurrency)]
    _sync(device)
    start = time.perf_counter()
    for batch in tqdm(batches, desc="transformers static batching", unit="batch", disable=not use_tqdm, leave=False):
        width = max(len(r.prompt_ids) for r in batch)
        new = max(r.max_tokens for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids):] = 1
        config = GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=pad_token_id, eos_token_id=None)
        result = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        if result.shape[1] - width != new:
            raise RuntimeError(f"transformers generated {result.shape[1] - width} tokens, expected {new}")
        generated += len(batch) * new
        steps += new
    _sync(device)
    elapsed = time.perf_counter() - start
    return OfflineResult(
        system="hf_static_batching", mode="generate", num_requests=len(workload), concurrency=concurrency,
        elapsed_s=elapsed, prompt_tokens=prompt, output_tokens=out, output_tokens_per_s=out / elapsed,
        total_tokens_per_s=(prompt + out) / elapsed, requests_per_s=len(workload) / elapsed,
        generated_tokens=generated, useful_fraction=out / generated, steps=steps)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# == the command ======================================================================================


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``minillm bench``."""
    parser.add_argument("--model", default=None,
                        help="checkpoint folder (default: a random-weight Llama built once with --preset)")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                        help="shape of the default model (default: llama-280m on a GPU, llama-tiny on a CPU)")
    parser.add_argument("--mode", default="both", choices=["offline", "online", "both"])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (and the arrivals')")
    parser.add_argument("--concurrency", type=int, default=BENCH_ENGINE_DEFAULTS["max_num_seqs"],
                        help="max_num_seqs of the engine, and the peer's batch size")
    parser.add_argument("--request-rate", type=float, action="append", default=None,
                        help="online: requests/s of the Poisson arrivals (repeatable; default 8)")
    parser.add_argument("--online-requests", type=int, default=None,
                        help="online: how many requests (default: --num-requests)")
    parser.add_argument("--peer", default="auto", choices=["auto", "hf", "none"],
                        help="transformers static batching in the same run (auto: when transformers imports)")
    parser.add_argument("--compare-eager", action="store_true",
                        help="also run the offline workload eagerly (no CUDA graphs) for comparison")
    # The engine's own flags (those of `minillm serve`), with the benchmark's defaults.
    from minillm.cli import add_engine_arguments

    add_engine_arguments(parser, defaults=BENCH_ENGINE_DEFAULTS, exclude=("max_num_seqs", "max_model_len"), helps={
        "dtype": "default: bfloat16 on a GPU, float32 on a CPU",
        "gpu_memory_utilization": "of the GPU's memory for the engine (default %(default)s: the peer runs in the "
                                  "same process)"})
    parser.add_argument("--json", default=None, help="write the results (a list of rows) to this file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


#: Where ``minillm bench``'s engine differs from `EngineConfig`'s defaults: a larger step budget
#: and CPU pool, half the GPU (the peer shares the process), seeded, every step recorded.
BENCH_ENGINE_DEFAULTS = dict(max_num_seqs=64, max_num_batched_tokens=2048, gpu_memory_utilization=0.5,
                             kv_cache_memory_mb=256, seed=0, record_steps=True)


def bench_engine_config(concurrency: int = BENCH_ENGINE_DEFAULTS["max_num_seqs"], **fields) -> EngineConfig:
    """The benchmark's `EngineConfig`: ``max_num_seqs = concurrency`` (``max_n`` capped by it)."""
    fields = {**BENCH_ENGINE_DEFAULTS, "max_num_seqs": concurrency, **fields}
    fields.setdefault("max_n", min(EngineConfig.max_n, fields["max_num_seqs"]))
    return EngineConfig(**fields)


@dataclass
class BenchConfig:
    """Everything `run_benchmark` needs (what ``minillm bench``'s options say). The engine's
    knobs are an `EngineConfig` (``engine.max_num_seqs`` is the concurrency); its ``device`` and
    ``dtype`` of ``None`` mean CUDA if available, bfloat16 on a GPU and float32 on a CPU."""

    model: str | None = None
    preset: str | None = None
    mode: str = "both"
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    engine: EngineConfig = field(default_factory=bench_engine_config)
    request_rates: tuple[float, ...] = (8.0,)
    online_requests: int | None = None
    peer: str = "auto"
    compare_eager: bool = False
    progress: bool = True

    @property
    def concurrency(self) -> int:
        """Requests in flight at once: the engine's ``max_num_seqs``, the peer's batch size."""
        return self.engine.max_num_seqs

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        from minillm.cli import engine_flag_values

        return cls(model=args.model, preset=args.preset, mode=args.mode,
                   workload=WorkloadSpec(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed),
                   engine=bench_engine_config(args.concurrency, **engine_flag_values(args)), request_rates=tuple(args.request_rate or (8.0,)),
                   online_requests=args.online_requests, peer=args.peer, compare_eager=args.compare_eager,
                   progress=not args.no_progress)


def run_benchmark(cfg: BenchConfig, log=print) -> dict:
    """Run what ``cfg`` asks for; returns ``{"model": ..., "offline": [OfflineResult...],
    "online": [OnlineResult...]}`` (dataclasses)."""
    from minillm.model import load_model, load_tokenizer

    device = cfg.engine.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = cfg.engine.dtype or ("bfloat16" if device == "cuda" else "float32")
    model_path = Path(cfg.model) if cfg.model else build_random_llama(cfg.preset or default_preset(device),
                                                                      dtype=dtype, device=device)
    model, mconfig = load_model(model_path, device=device, dtype=dtype)
    tokenizer, _ = load_tokenizer(model_path)
    n_params = sum(p.numel() for p in model.parameters())
    info = dict(model=model_path.name, model_path=str(model_path), parameters=n_params, device=device, dtype=dtype,
                gpu=torch.cuda.get_device_name() if device == "cuda" else None, workload=cfg.workload.describe(),
                concurrency=cfg.concurrency)
    log(f"minillm bench: {model_path.name} ({n_params / 1e6:.1f}M parameters, {dtype}) on "
        f"{info['gpu'] or device}; {cfg.workload.describe()}; concurrency {cfg.concurrency}")
    workload = make_workload(cfg.workload, mconfig.vocab_size)
    warmup = make_workload(WorkloadSpec(min(cfg.workload.num_requests, cfg.concurrency), cfg.workload.prompt_len,
                                        (min(cfg.workload.output_len), min(cfg.workload.output_len[1], 64)),
                                        cfg.workload.seed + 1000), mconfig.vocab_size)
    engine_config = replace(cfg.engine, device=device, dtype=dtype,
                            max_num_batched_tokens=max(cfg.engine.max_num_batched_tokens, cfg.concurrency))
    graphs = cfg.engine.cuda_graphs if device == "cuda" else "off"
    modes = ([graphs] + (["off"] if cfg.compare_eager and graphs != "off" else []))
    offline, online = [], []

    peer = cfg.peer
    if peer == "auto":
        import importlib.util
        peer = "hf" if importlib.util.find_spec("transformers") is not None else "none"
    if peer == "hf" and cfg.mode in ("offline", "both"):
        hf = load_hf_model(model_path, device, getattr(torch, dtype))
        run_hf_static(hf, workload[:cfg.concurrency], cfg.concurrency, use_tqdm=False)  # warm-up, untimed
        result = run_hf_static(hf, workload, cfg.concurrency, use_tqdm=cfg.progress)
        offline.append(result)
        log(_offline_line(result))
        del hf
        free_memory()

    for mode in modes:
        engine = build_engine(model_path, model=model, tokenizer=tokenizer, config=replace(engine_config, cuda_graphs=mode))
        run_offline(engine, warmup, mode=mode, use_tqdm=False)  # compile and tune everything first
        if cfg.mode in ("offline", "both"):
            result = run_offline(engine, workload, mode=mode, use_tqdm=cfg.progress, desc=f"minillm offline ({mode})")
            offline.append(result)
            log(_offline_line(result))
        if cfg.mode in ("online", "both") and mode == modes[0]:
            n = cfg.online_requests or cfg.workload.num_requests
            online_workload = make_workload(WorkloadSpec(n, cfg.workload.prompt_len, cfg.workload.output_len,
                                                         cfg.workload.seed + 1), mconfig.vocab_size)
            for rate in cfg.request_rates:
                result = run_online(engine, online_workload, rate, seed=cfg.workload.seed, mode=mode,
                                    use_tqdm=cfg.progress)
                online.append(result)
                log(_online_line(result))
        del engine
        free_memory()
    return {"info": info, "offline": offline, "online": online}


def _offline_line(r: OfflineResult) -> str:
    extra = (f", KV waste {r.kv_waste_mean:.2%}, {r.preemptions} preemptions, peak {r.peak_kv_blocks} blocks"
             if r.kv_waste_mean is not None else f", {r.useful_fraction:.0%} of generated tokens useful")
    return (f"  {r.system} ({r.mode}): {r.output_tokens_per_s:,.0f} output tok/s, {r.total_tokens_per_s:,.0f} total "
            f"tok/s, {r.requests_per_s:.2f} req/s in {r.elapsed_s:.2f} s{extra}")


def _online_line(r: OnlineResult) -> str:
    lat = r.latency
    f = lambda x: "—" if x is None else f"{x:.1f}"  # noqa: E731
    return (f"  online {r.request_rate:g} req/s: TTFT p50/p99 {f(lat.ttft_p50_ms)}/{f(lat.ttft_p99_ms)} ms, TPOT "
            f"{f(lat.tpot_p50_ms)}/{f(lat.tpot_p99_ms)} ms, ITL {f(lat.itl_p50_ms)}/{f(lat.itl_p99_ms)} ms; "
            f"{r.output_tokens_per_s:,.0f} output tok/s")


def result_rows(results: dict) -> list[dict]:
    """Flat rows (one dict per run) for ``--json``."""
    rows = []
    for r in results["offline"]:
        rows.append({"kind": "offline", **results["info"], **asdict(r)})
    for r in results["online"]:
        d = asdict(r)
        d.update(d.pop("latency"))
        rows.append({"kind": "online", **results["info"], **d})
    return rows


def format_table(results: dict) -> str:
    """The summary table ``minillm bench`` prints."""
    lines = []
    off = results["offline"]
    if off:
        lines.append(f"{'offline':<28} {'out tok/s':>10} {'total tok/s':>11} {'req/s':>7} {'time s':>7} "
                     f"{'useful':>6} {'KV waste':>8} {'preempt':>7} {'peak blk':>8} {'decode ms':>9}")
        peer = next((r for r in off if r.system == "hf_static_batching"), None)
        for r in off:
            name = f"{r.system} ({r.mode})"
            ratio = f"  {r.output_tokens_per_s / peer.output_tokens_per_s:.2f}x peer" if peer and r is not peer else ""
            fmt = lambda x, s: "—" if x is None else format(x, s)  # noqa: E731
            lines.append(f"{name:<28} {r.output_tokens_per_s:>10,.0f} {r.total_tokens_per_s:>11,.0f} "
                         f"{r.requests_per_s:>7.2f} {r.elapsed_s:>7.2f} {r.useful_fraction:>6.0%} "
                         f"{fmt(r.kv_waste_mean, '.2%'):>8} {fmt(r.preemptions, 'd'):>7} "
                         f"{fmt(r.peak_kv_blocks, 'd'):>8} {fmt(r.decode_step_ms, '.2f'):>9}{ratio}")
    if results["online"]:
        lines.append("")
        lines.append(f"{'online (ms)':<16} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
                     f"{'ITL p50':>8} {'ITL p99':>8} {'e2e p50':>8} {'out tok/s':>10}")
        for r in results["online"]:
            lat = r.latency
            fmt = lambda x: "—" if x is None else f"{x:.1f}"  # noqa: E731
            lines.append(f"{f'{r.request_rate:g} req/s':<16} {fmt(lat.ttft_p50_ms):>9} {fmt(lat.ttft_p99_ms):>9} "
                         f"{fmt(lat.tpot_p50_ms):>9} {fmt(lat.tpot_p99_ms):>9} {fmt(lat.itl_p50_ms):>8} "
                         f"{fmt(lat.itl_p99_ms):>8} {fmt(lat.e2e_p50_ms):>8} {r.output_tokens_per_s:>10,.0f}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """``minillm bench``: run, print the table, optionally write ``--json``."""
    from minillm.model.config import CheckpointError

    cfg = BenchConfig.from_args(args)
    if cfg.model is not None and not (Path(cfg.model) / "config.json").is_file():
        print(f"minillm bench: {cfg.model} is not a checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    try:
        results = run_benchmark(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    except CheckpointError as e:
        print(f"minillm bench: {e}", file=sys.stderr)
        return 2
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(result_rows(results), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="minillm bench", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
