"""Chapter 2 benchmark: tokens per second of the torch model with and without the KV cache.

Two ways to produce the next token of a sequence that already holds ``context`` tokens plus
the latest one (``context + 1`` in all, the new token at position ``context``):

- ``cached`` (ours): one decode step, ``model(token, start_pos=context, cache=cache)`` with a
  `KVCache` already holding the ``context`` earlier tokens: one row through every layer;
- ``no_cache`` (peer): ``model(ids[:, :context + 1])``, the whole sequence again, keeping only
  the last position's logits (the model computes all ``context + 1`` of them).

Model: `LlamaForCausalLM` with random weights (speed does not depend on the values) of a fixed
shape, SwiGLU, RoPE, untied embeddings:

======  ===============================================================  =========  ======
device  shape                                                            params     dtype
======  ===============================================================  =========  ======
GPU     ``GPU_CONFIG``: Llama-2-7B's layer shape, 8 layers instead of 32  1.88 G     bf16
        (hidden 4096, 32 heads = 32 KV heads, head_dim 128, intermediate
        11008, vocab 32000)
CPU     ``CPU_CONFIG``: 4 layers, hidden 256, 4 heads / 2 KV heads,       5.2 M      fp32
        head_dim 64, intermediate 768, vocab 4096
======  ===============================================================  =========  ======

Why few, wide layers on the GPU: our eager model launches ~40 small kernels per layer, and at
batch 1 that Python/launch overhead (≈ 0.5 ms a layer on the VMs we measured) is all a cached
step costs; a ~100 M-parameter 12-layer model measured ≈ 6 ms per step *with or without* the
cache up to context 4096 at batch 1 (an H200, 2026-11), which shows the overhead and nothing
else. Wide layers put enough work behind each launch for the cache's savings to show.

Points: GPU context 64 … 4096 (``GPU_CONTEXTS``), batch 1 and 16; CPU context 16 … 1024
(``CPU_CONTEXTS``), batch 1. Times: `bench.common.time_ms` on the GPU (do_bench median, cold
L2), `bench.common.cpu_time_ms` on the CPU (median of repeated calls, warm caches). A cached
step at batch 1 is still mostly launch overhead: the roofline rows show how far above the
hardware bound it runs.

Rows (``params``: model, batch, context, dtype; generation rows: model, batch, prompt_len,
new_tokens, dtype):

==========================  ==============================================================
``step_ms``                 one step's median time; ours = cached, peer ``no_cache``
                            (ratio = speed-up of the cache)
``tokens_per_s``            ``batch / step time``, same pairing; ``fraction_of_ceiling`` =
                            measured over the roofline rate (`minillm.costs.per_token_time`)
``predicted_step_ms``       roofline lower bound of each step (`minillm.costs.per_token_time`,
                            no-cache side with ``logits="all"`` as ``model(ids)`` computes),
                            from the ceilings measured in the same run; only when known
``generate_tokens_per_s``   end to end: ``new_tokens / seconds`` to generate ``new_tokens``
                            greedy tokens after a ``prompt_len``-token random prompt (prompt
                            processing included), fastest of ``GENERATE_RUNS`` timed runs
                            each side, after a short warm-up
``rel_err``                 ‖last logits cached − no_cache‖ / ‖no_cache‖ at the first context:
                            both sides compute the same function
``copy_TBps``,              CPU only: the CPU ceilings used for ``predicted_step_ms``
``fp32_matmul_TFLOPs``      (``torch.Tensor.copy_`` of 256 MiB, read + written; fp32
                            ``torch.matmul`` 1024³), params ``{"ceiling": ...}``
==========================  ==============================================================

GPU: ``python -m bench.run --only ch02_generation`` (results in ``bench/results/<gpu>.json``).
CPU: ``python -m bench.ch02_generation --cpu`` measures on this machine's CPU and saves
``bench/results/cpu/<cpu-slug>.json`` (+ ``.md``), a sub-folder, so that
``minillm.results.load_results()`` (no slug: the newest GPU file) never picks a CPU file.
Read it with ``load_results(cpu_slug(), results_dir() / "cpu")``.
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.common import DEFAULT_OUT, Results, cpu_time_ms, environment, gpu_slug, time_ms
from minillm import costs
from minillm.model.config import ModelConfig
from minillm.model.torch_model import LlamaForCausalLM
from minillm.results import cpu_model_name

BENCHMARK = "ch02_generation"
#: The GPU side uses bench.run's measured ceilings for the roofline rows.
NEEDS_CEILINGS = True

GPU_CONFIG = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                         max_position_embeddings=8192, dtype="bfloat16")
CPU_CONFIG = ModelConfig(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=4096, dtype="float32")
GPU_NAME, CPU_NAME = "llama2-7b-8-layers-random", "llama-5m-random"

GPU_CONTEXTS = (64, 128, 256, 512, 1024, 2048, 4096)
GPU_BATCHES = (1, 16)
CPU_CONTEXTS = (16, 32, 64, 128, 256, 512, 1024)
CPU_BATCHES = (1,)
#: End-to-end generation: (prompt_len, new_tokens) at batch 1.
GPU_GENERATE = (16, 2048)
CPU_GENERATE = (16, 256)
#: Timed runs of each end-to-end generation (the fastest counts: a shared machine's
#: interruptions only ever add time).
GENERATE_RUNS = 2
#: Where the CPU results go (a sub-folder of bench/results; see the module docstring).
CPU_RESULTS_DIR = DEFAULT_OUT / "cpu"
#: Stop starting new points after this many seconds.
BUDGET_S = float(os.environ.get("MINILLM_CH02_BUDGET_S", "300"))


# --------------------------------------------------------------------------- set-up
def build_model(config: ModelConfig, device, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """A `LlamaForCausalLM` of ``config`` with PyTorch's default random init, in eval mode."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def shape_of(config: ModelConfig, name: str) -> costs.ModelShape:
    return costs.ModelShape.from_config(config, name=name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cuda":
        return lambda fn: time_ms(fn, warmup=25, rep=100)
    return lambda fn: cpu_time_ms(fn, warmup=2, min_reps=5, min_time_s=0.3)


# --------------------------------------------------------------------------- the two ways
@torch.inference_mode()
def generate_loop(model: LlamaForCausalLM, prompt: torch.Tensor, new_tokens: int, cached: bool) -> torch.Tensor:
    """Greedy generation of ``new_tokens`` after ``prompt [B, T]``; returns ``[B, T + new]``.

    ``cached``: prefill into a `KVCache`, then one token per step. Otherwise every step runs
    ``model(ids)`` over the whole sequence so far and keeps the last logits.
    """
    B, T = prompt.shape
    ids = prompt
    if cached:
        cache = model.new_cache(B, T + new_tokens)
        logits = model(prompt, 0, cache)[:, -1]
        for i in range(new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            if i + 1 < new_tokens:
                logits = model(nxt, T + i, cache)[:, -1]
        return ids
    for _ in range(new_tokens):
        nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


# --------------------------------------------------------------------------- the sweep
def sweep(results: Results, device, config: ModelConfig, name: str, dtype: torch.dtype,
          contexts, batches, generate: tuple[int, int] | None,
          peak_flops: float | None, bandwidth: float | None, ceiling_note: str | None) -> None:
    """Measure every (batch, context) point, then the end-to-end generation; add the rows."""
    device = torch.device(device)
    timer = _timer(device)
    model = build_model(config, device, dtype)
    shape = shape_of(config, name)
    dtype_name = str(dtype).removeprefix("torch.")
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    add = lambda *a, **kw: results.add(BENCHMARK, *a, **kw)  # noqa: E731
    start = time.perf_counter()
    gen = torch.Generator(device="cpu").manual_seed(0)

    with torch.inference_mode():
        for batch in batches:
            max_ctx = max(contexts)
            ids = torch.randint(0, config.vocab_size, (batch, max_ctx + 1), generator=gen).to(device)
            cache = model.new_cache(batch, max_ctx + 1)
            model(ids[:, :max_ctx], 0, cache)          # fill the cache once; each point reuses a prefix
            for i, ctx in enumerate(contexts):
                if time.perf_counter() - start > BUDGET_S:
                    print(f"  [{BENCHMARK}] time budget of {BUDGET_S:.0f} s spent: stopping early", flush=True)
                    results.set_status(BENCHMARK, f"partial: time budget {BUDGET_S:.0f} s spent")
                    return
                t0 = time.perf_counter()
                tok, prefix = ids[:, ctx:ctx + 1], ids[:, :ctx + 1]
                params = {"model": name, "batch": batch, "context": ctx, "dtype": dtype_name}
                if i == 0:
                    # Slot ctx is rewritten by every cached call with the same token: same K/V.
                    err = _rel_err(model(tok, ctx, cache)[:, -1], model(prefix)[:, -1])
                    add(params, "rel_err", err, "no_cache", None)
                cached_ms = timer(lambda: model(tok, ctx, cache))
                uncached_ms = timer(lambda: model(prefix))
                add(params, "step_ms", cached_ms, "no_cache", uncached_ms)

                frac, note = None, None
                if peak_flops and bandwidth:
                    pred_c = costs.per_token_time(shape, ctx, peak_flops, bandwidth, batch, cached=True,
                                                  dtype_bytes=dtype_bytes)
                    pred_u = costs.per_token_time(shape, ctx, peak_flops, bandwidth, batch, cached=False,
                                                  dtype_bytes=dtype_bytes, logits="all")
                    frac = pred_c * 1e3 / cached_ms
                    note = ceiling_note
                    add(params, "predicted_step_ms", pred_c * 1e3, "no_cache", pred_u * 1e3, note=note)
                add(params, "tokens_per_s", batch / (cached_ms * 1e-3), "no_cache", batch / (uncached_ms * 1e-3),
                    fraction_of_ceiling=frac, note=note and "fraction_of_ceiling: measured / roofline rate")
                print(f"  [{BENCHMARK}] B={batch} context={ctx}: cached {cached_ms:.3f} ms, "
                      f"no cache {uncached_ms:.3f} ms ({uncached_ms / cached_ms:.1f}x), "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
            del cache, ids
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

        if generate is not None:
            prompt_len, new_tokens = generate
            prompt = torch.randint(0, config.vocab_size, (1, prompt_len), generator=gen).to(device)
            secs = {}
            for cached in (True, False):
                generate_loop(model, prompt, 4, cached)   # warm-up
                for _ in range(GENERATE_RUNS):
                    _sync(device)
                    t0 = time.perf_counter()
                    generate_loop(model, prompt, new_tokens, cached)
                    _sync(device)
                    secs[cached] = min(secs.get(cached, float("inf")), time.perf_counter() - t0)
            params = {"model": name, "batch": 1, "prompt_len": prompt_len, "new_tokens": new_tokens,
                      "dtype": dtype_name}
            add(params, "generate_tokens_per_s", new_tokens / secs[True], "no_cache", new_tokens / secs[False],
                note=f"best of {GENERATE_RUNS} runs: {secs[True]:.3f} s with the cache, {secs[False]:.3f} s without")
            print(f"  [{BENCHMARK}] generate {new_tokens} tokens: {secs[True]:.2f} s cached, "
                  f"{secs[False]:.2f} s without", flush=True)


def run(results: Results, device) -> None:
    """The GPU sweep (`GPU_CONFIG`, bf16): called by ``python -m bench.run``. Uses
    ``results.ceilings`` (``copy_TBps``, ``bf16_matmul_TFLOPs``) for the roofline rows when
    there are any."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError("run() is the GPU benchmark; on a CPU use `python -m bench.ch02_generation --cpu`")
    ceil = results.ceilings or {}
    peak = ceil.get("bf16_matmul_TFLOPs") and ceil["bf16_matmul_TFLOPs"] * 1e12
    bw = ceil.get("copy_TBps") and ceil["copy_TBps"] * 1e12
    note = (f"roofline at the measured ceilings: {peak / 1e12:.1f} TFLOP/s bf16 matmul, "
            f"{bw / 1e12:.3f} TB/s copy") if peak and bw else None
    sweep(results, device, GPU_CONFIG, GPU_NAME, torch.bfloat16, GPU_CONTEXTS, GPU_BATCHES, GPU_GENERATE,
          peak, bw, note)


# --------------------------------------------------------------------------- CPU entry point
def cpu_device_name(threads: int | None = None) -> str:
    """``"CPU: <model>, <n> threads"``, the ``device`` of the CPU results file."""
    threads = threads or torch.get_num_threads()
    return f"CPU: {cpu_model_name()}, {threads} threads"


def cpu_slug(threads: int | None = None) -> str:
    """The CPU results file's name without ``.json``, e.g. ``cpu-intel-xeon-2-50ghz-2-threads``."""
    return gpu_slug(cpu_device_name(threads))


def cpu_ceilings(copy_bytes: int = 256 << 20, matmul_n: int = 1024) -> dict[str, float]:
    """CPU counterparts of `bench.common.measure_ceilings`: ``copy_TBps`` (``dst.copy_(src)``
    of ``copy_bytes`` fp32, read + written) and ``fp32_matmul_TFLOPs`` (``matmul_n``³)."""
    src = torch.randn(copy_bytes // 4)
    dst = torch.empty_like(src)
    ms = cpu_time_ms(lambda: dst.copy_(src))
    copy_tbps = 2 * copy_bytes / (ms * 1e-3) / 1e12
    a, b = torch.randn(matmul_n, matmul_n), torch.randn(matmul_n, matmul_n)
    c = torch.empty(matmul_n, matmul_n)
    ms = cpu_time_ms(lambda: torch.matmul(a, b, out=c))
    return {"copy_TBps": copy_tbps, "fp32_matmul_TFLOPs": costs.gemm_flops(matmul_n, matmul_n, matmul_n) / (ms * 1e-3) / 1e12}


def _loadavg() -> float | None:
    """The 1-minute load average (other processes competing for the cores), if known."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def run_cpu(out_dir: str | os.PathLike | None = None, contexts=CPU_CONTEXTS, batches=CPU_BATCHES,
            generate: tuple[int, int] | None = CPU_GENERATE) -> Results:
    """Measure on this machine's CPU (`CPU_CONFIG`, fp32) and save
    ``<out_dir>/<cpu_slug()>.json`` and ``.md`` (default `CPU_RESULTS_DIR`)."""
    env = environment()
    env["cuda"] = None
    env["device_info"] = {"kind": "cpu", "cpu_model": cpu_model_name(), "threads": torch.get_num_threads(),
                          "logical_cpus": os.cpu_count(), "loadavg_1min_at_start": _loadavg()}
    results = Results(cpu_device_name(), ceilings=None, env=env)
    device = torch.device("cpu")
    print(f"{BENCHMARK}: {results.device}; torch {torch.__version__}; 1-min load average "
          f"{env['device_info']['loadavg_1min_at_start']} (other work on these cores slows every number)",
          flush=True)
    try:
        ceil = cpu_ceilings()
        what = {"copy_TBps": "copy_ 256 MiB fp32, read + written", "fp32_matmul_TFLOPs": "matmul fp32 1024^3"}
        for k, v in ceil.items():
            results.add(BENCHMARK, {"ceiling": what[k]}, k, v)
        peak, bw = ceil["fp32_matmul_TFLOPs"] * 1e12, ceil["copy_TBps"] * 1e12
        note = f"roofline at the measured CPU ceilings: {peak / 1e12:.3f} TFLOP/s fp32 matmul, {bw / 1e9:.1f} GB/s copy"
        print(f"  [{BENCHMARK}] CPU ceilings: {peak / 1e9:.1f} GFLOP/s fp32 matmul, {bw / 1e9:.1f} GB/s copy",
              flush=True)
        sweep(results, device, CPU_CONFIG, CPU_NAME, torch.float32, contexts, batches, generate, peak, bw, note)
    except KeyboardInterrupt:
        results.set_status(BENCHMARK, "partial: interrupted")
        raise
    finally:
        results.env["device_info"]["loadavg_1min_at_end"] = _loadavg()
        json_path, _ = results.save(CPU_RESULTS_DIR if out_dir is None else out_dir)
        print(f"{BENCHMARK}: {len(results.rows)} rows -> {json_path}", flush=True)
    return results


# --------------------------------------------------------------------------- summary
def summary(results: Results | dict) -> str:
    """A text table: per (batch, context), the step times and the cache's speed-up."""
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    lines = [f"{'batch':>5} {'context':>7} {'cached ms':>10} {'no-cache ms':>12} {'speed-up':>8} "
             f"{'cached tok/s':>12} {'no-cache tok/s':>14} {'of roofline':>11}"]
    tps = {(r["params"]["batch"], r["params"]["context"]): r for r in select(data, BENCHMARK, "tokens_per_s")}
    for r in select(data, BENCHMARK, "step_ms"):
        p = r["params"]
        t = tps.get((p["batch"], p["context"]), {})
        frac = t.get("fraction_of_ceiling")
        lines.append(f"{p['batch']:>5} {p['context']:>7} {r['ours']:>10.3f} {r['peer_value']:>12.3f} "
                     f"{r['ratio']:>7.1f}x {t.get('ours', 0):>12.1f} {t.get('peer_value', 0):>14.1f} "
                     f"{'' if frac is None else f'{frac:.1%}':>11}")
    for r in select(data, BENCHMARK, "generate_tokens_per_s"):
        p = r["params"]
        lines.append(f"generate {p['new_tokens']} tokens after {p['prompt_len']}: {r['ours']:.1f} tok/s cached, "
                     f"{r['peer_value']:.1f} tok/s without ({r['ratio']:.1f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Chapter 2: tokens/s with and without the KV cache.")
    ap.add_argument("--cpu", action="store_true", help="measure on this machine's CPU (no GPU needed)")
    ap.add_argument("--out", default=None, help=f"results folder (CPU default {CPU_RESULTS_DIR})")
    args = ap.parse_args(argv)
    if args.cpu:
        print(summary(run_cpu(args.out)), flush=True)
        return 0
    from bench.run import main as run_main

    run_argv = ["--only", BENCHMARK] + (["--out", args.out] if args.out else [])
    return run_main(run_argv)


if __name__ == "__main__":
    raise SystemExit(main())
