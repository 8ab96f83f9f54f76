"""Chapter 10 benchmark: the fused decode step against the unfused one, same model, same GPU,
same run.

Models: random-weight Llamas built in memory (`minillm.model.LlamaForCausalLM`, normal(0, 0.02)
weights, bf16) in the shapes of `minillm.experiments.ch09_engine_benchmark.PRESETS`:
``llama-280m`` (24 layers, hidden 1024, 16/4 heads of 64, SwiGLU 2816) and ``llama-3.2-1b``
(16 layers, hidden 2048, 32/8 heads of 64, SwiGLU 8192, tied embeddings), vocabulary 4096 (the
bundled tokenizer's). Seven parts, each in its own ``try`` (a failure records an ``error`` row):

1. **kernels** (kind ``kernel``): each fused kernel of `minillm.kernels.ch10_fused_decode`
   against the torch ops the unfused model runs (``torch_eager``; for the rotary this includes
   Chapter 5's cache-write kernel) and against ``torch.compile`` of those ops
   (``torch_compile``); ``time_us`` per call inside a CUDA graph (`bench.common.graph_time_ms`),
   at the 280M model's shapes and 64 rows, and at the 1B model's and 1 row.
2. **decode step** (kind ``step``): one decode step of 64 sequences of ``CONTEXT`` tokens of
   the 280M model, captured in a CUDA graph, fused against unfused: ``step_ms`` (graph replay,
   argmax included), ``eager_step_ms``, ``kernels_per_step`` (torch.profiler over one eager
   step), per category (``gemm``, ``attention``, ``norms``, ``rotary`` (with the cache write),
   ``elementwise``, ``sampling``, ``other``) ``<category>_us`` and ``<category>_kernels`` from
   the profiler; and the floor model (`minillm.costs.decode_floor_s`): weights + KV bytes over
   the copy bandwidth measured in this run (``floor_bytes_ms``), plus kernels times the cost of
   an almost empty kernel inside a graph (``empty_kernel_us``, measured here):
   ``floor_ms`` per mode.
3. **single request** (kind ``single``): decode time per token of one sequence of the 1B model
   (CUDA graph), fused against unfused, and ``floor_ms`` = its weights once at the bandwidth.
4. **offline** (kind ``offline``): Chapter 9's offline workload, reduced (``OFFLINE_REQUESTS``
   requests, prompts and outputs of 32-256 tokens, 64 at once), the engine fused against
   unfused (``output_tokens_per_s``, ``decode_step_ms``), and transformers' static batching
   as the peer when time is left (`minillm.experiments.ch09_engine_benchmark.run_hf_static`).
5. **sampling** (part ``sampling``): the sampler of `minillm.decoding.gpu_sampling` (kind
   ``sampler``: temperature 0.8, top-k 50, top-p 0.9 and the draw on ``[B, vocab]`` float32
   logits, ``B`` in ``SAMPLER_BATCHES``, vocab in ``SAMPLER_VOCABS``; ``time_us`` per call inside
   a CUDA graph) against the same operation in torch (``torch_eager``: temperature, a sort,
   the top-k and top-p masks, a softmax, and the exponential race with ``Tensor.exponential_``)
   and ``torch.compile`` of it (``torch_compile``, one compilation per shape while the budget
   allows); and the engine on sampled requests (kind ``sampled``: the 280M model, ``BATCH``
   requests of 64 output tokens at temperature 0.8, top-p 0.9) with the tokens drawn inside the
   CUDA graph against the same fused engine drawing each sequence's token on the device with
   a host round trip per sequence (`minillm.decoding.sampling.draw_on_device`):
   ``decode_step_ms`` and ``output_tokens_per_s``.
6. **offline, eager** (part ``offline_eager``, kind ``offline``, ``cuda_graphs: "off"``): the same
   workload on the engine without CUDA graphs, fused and unfused (rows ``mode`` ``"fused eager"``,
   ``"unfused eager"``), against the same transformers static-batching peer measured in this run
   (shared with part 4 when both run).
7. **static-cache decode** (part ``hf_static``, kind ``decode``): time per output token
   (``tpot_ms``: one decode step, i.e. per token of each sequence; ``(T(N) - T(1)) / (N - 1)``
   of the wall times of whole generations of ``N`` = ``NEW_TOKENS`` and of 1 new token, so
   the prefill cancels) of the 1B model at batches ``DECODE_BATCHES``, prompts of
   ``SINGLE_CONTEXT`` random tokens: minillm's engine (fused, CUDA graphs) against transformers
   ``generate`` with a `StaticCache` (same shape, random weights, sdpa attention), eager
   (peer ``hf_static``, generate's own compilation disabled) and with
   ``model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``
   (peer ``hf_static_compile``; compile and CUDA-graph recording happen in untimed warm-up
   runs, whose time is in the row's note, as are the CUDA-graph skips inductor reported).

``MINILLM_CH10_PARTS`` (comma-separated part names: ``step, single, kernels, sampling, offline,
offline_eager, hf_static``; default all) runs only some parts; the saved file then keeps the
earlier rows of the other parts (`row_part`, `bench.common.Results.keep_previous`).
``MINILLM_CH10_BUDGET_S`` (default 420) is the time budget of the whole run: a part, or a
step of one, that would not fit records a ``skipped`` row.

The profiler's category table and a timeline (start, duration, category of each kernel of one
captured step) are written to ``$MINILLM_ARTIFACTS/<gpu-slug>.ch10_profile.json`` when that
variable is set (``scripts/gpu.sh`` sets it), for the chapter's plots.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
import traceback
from pathlib import Path

import torch

from bench.common import Results, free_memory, graph_time_ms, time_ms

BENCHMARK = "ch10_fused_decode"
BATCH = 64
CONTEXT = int(os.environ.get("MINILLM_CH10_CONTEXT", 256))
SINGLE_CONTEXT = 128
OFFLINE_REQUESTS = int(os.environ.get("MINILLM_CH10_REQUESTS", 64))
BUDGET_S = float(os.environ.get("MINILLM_CH10_BUDGET_S", 420))
DTYPE = torch.bfloat16
MODES = ("unfused", "fused")
CATEGORIES = ("gemm", "attention", "norms", "rotary", "elementwise", "sampling", "other")
#: The parts in run order (`run`); ``MINILLM_CH10_PARTS`` selects some.
PARTS = ("step", "single", "kernels", "sampling", "offline", "offline_eager", "hf_static")
NEW_TOKENS = int(os.environ.get("MINILLM_CH10_NEW_TOKENS", 256))
DECODE_BATCHES = (1, 8)
SAMPLER_BATCHES = (1, 8, 64)
SAMPLER_VOCABS = (4096, 32000)


# == models ========================================================================================

def random_model(preset: str, device, dtype=DTYPE, seed: int = 0):
    """A `LlamaForCausalLM` of a `PRESETS` shape with random weights, built on ``device``."""
    from minillm.experiments.ch09_engine_benchmark import PRESETS
    from minillm import BUNDLED_MODEL
    from minillm.model import LlamaForCausalLM, ModelConfig, load_tokenizer

    tokenizer = load_tokenizer(BUNDLED_MODEL)[0]
    p = PRESETS[preset]
    config = ModelConfig(model_type="llama", vocab_size=tokenizer.get_vocab_size(), hidden_size=p["hidden_size"],
                         intermediate_size=p["intermediate_size"], num_hidden_layers=p["num_hidden_layers"],
                         num_attention_heads=p["num_attention_heads"], num_key_value_heads=p["num_key_value_heads"],
                         head_dim=p["head_dim"], max_position_embeddings=p["max_position_embeddings"],
                         rms_norm_eps=1e-5, tie_word_embeddings=p.get("tie_word_embeddings", False),
                         bos_token_id=0, eos_token_ids=[0])
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            t.fill_(1.0) if "norm" in name else t.normal_(0, 0.02)
    return model, tokenizer


def weight_bytes(model) -> int:
    from minillm.costs import llama_weight_bytes

    c = model.config
    return llama_weight_bytes(c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                              c.num_key_value_heads, c.head_dim, c.vocab_size, model.lm_head.weight.element_size(),
                              c.tie_word_embeddings)


# == part 1: the kernels ===========================================================================

def _kernel_cases(device):
    """``(name, shape params, ours, eager)`` for each fused kernel at two shapes."""
    from minillm.kernels import ch10_fused_decode as k
    from minillm.kernels.ch05_paged_attention import write_paged_kv
    from minillm.model.torch_model import apply_rope, rope_cos_sin

    cases = []
    for label, T, hidden, H, Hkv, D, inter in (("280m", BATCH, 1024, 16, 4, 64, 2816),
                                               ("1b", 1, 2048, 32, 8, 64, 8192)):
        g = torch.Generator(device=device).manual_seed(0)
        rnd = lambda *s: torch.randn(*s, device=device, dtype=DTYPE, generator=g)  # noqa: E731
        x, r, w = rnd(T, hidden), rnd(T, hidden), rnd(hidden)

        def norm_eager(x=x, r=r, w=w):
            s = x + r
            h = s.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
            return w * h.to(s.dtype), s

        cases.append(("add_rmsnorm", {"shape": label, "rows": T, "hidden": hidden},
                      lambda x=x, r=r, w=w: k.add_rmsnorm(x, r, w, 1e-5), norm_eager))
        qkv = rnd(T, (H + 2 * Hkv) * D)
        q, kk, v = (qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D),
                    qkv[:, (H + Hkv) * D:].view(T, Hkv, D))
        cos, sin = rope_cos_sin(torch.arange(100, 100 + T, device=device), D, 10000.0, DTYPE)
        blocks = T * 16 // 16 + 4
        kc = torch.zeros(blocks, 16, Hkv, D, device=device, dtype=DTYPE)
        vc = torch.zeros_like(kc)
        slots = torch.arange(T, device=device) * 16 + 3

        def rope_eager(q=q, kk=kk, v=v, cos=cos, sin=sin, kc=kc, vc=vc, slots=slots):
            qr = apply_rope(q, cos[:, None], sin[:, None])
            kr = apply_rope(kk, cos[:, None], sin[:, None])
            if torch.compiler.is_compiling():   # torch.compile: the write as an index_put
                kc.view(-1, Hkv, D)[slots] = kr
                vc.view(-1, Hkv, D)[slots] = v
            else:                                # eager: the unfused model's path (Chapter 5's kernel)
                write_paged_kv(kc, vc, kr, v, slots)
            return qr

        cases.append(("rope_write_kv", {"shape": label, "rows": T, "heads": H, "kv_heads": Hkv, "head_dim": D},
                      lambda q=q, kk=kk, v=v, cos=cos, sin=sin, kc=kc, vc=vc, slots=slots:
                      k.rope_write_kv(q, kk, v, cos, sin, kc, vc, slots), rope_eager))
        gate_up = rnd(T, 2 * inter)
        cases.append(("silu_mul", {"shape": label, "rows": T, "intermediate": inter},
                      lambda gu=gate_up: k.silu_mul(gu),
                      lambda gu=gate_up, n=inter: torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]))
    return cases


def part_kernels(results: Results, ctx: dict) -> None:
    device = ctx["device"]
    for name, params, ours, eager in _kernel_cases(device):
        params = {"kind": "kernel", "kernel": name, **params}
        t_ours = graph_time_ms(ours) * 1e3
        t_eager = graph_time_ms(eager) * 1e3
        t_comp = None
        if params["shape"] == "280m" and ctx["left"]() > 120:
            try:
                compiled = torch.compile(eager, dynamic=False)
                compiled()
                t_comp = graph_time_ms(compiled) * 1e3
            except Exception as e:  # noqa: BLE001 - torch.compile may not run here
                results.add(BENCHMARK, {**params, "peer": "torch_compile"}, "error", None,
                            note=f"torch.compile: {type(e).__name__}: {e}"[:300])
        results.add(BENCHMARK, params, "time_us", t_ours, "torch_eager", t_eager,
                    note="per call inside a CUDA graph (bench.common.graph_time_ms)")
        if t_comp is not None:
            results.add(BENCHMARK, params, "time_us", t_ours, "torch_compile", t_comp)
        print(f"  [{BENCHMARK}] {name:14s} {params['shape']:5s} fused {t_ours:7.2f} us, eager {t_eager:7.2f} us"
              + (f", compile {t_comp:7.2f} us" if t_comp else ""), flush=True)


# == part: sampling ================================================================================

def torch_sampler(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                  ) -> torch.Tensor:
    """The peer: temperature, top-k, top-p and a draw on ``[B, vocab]`` in plain torch, as
    gpt-fast and vLLM's torch fallback write it (one sort; the exponential race with
    ``Tensor.exponential_`` for the draw, no host synchronisation). ``[B]`` int64."""
    x = logits.float() / temperature[:, None]
    sorted_x, order = x.sort(dim=-1, descending=True)
    kth = sorted_x.gather(1, (top_k - 1)[:, None])
    sorted_x = sorted_x.masked_fill(sorted_x < kth, -torch.inf)
    p = torch.softmax(sorted_x, dim=-1)
    sorted_x = sorted_x.masked_fill(p.cumsum(-1) - p >= top_p[:, None], -torch.inf)
    probs = torch.softmax(sorted_x, dim=-1)
    choice = (probs / torch.empty_like(probs).exponential_()).argmax(-1, keepdim=True)
    return order.gather(1, choice)[:, 0]


def _sampler_time_us(fn) -> tuple[float, str]:
    """``fn``'s time per call inside a CUDA graph, or, if it cannot be captured, with
    launches (`bench.common.time_ms`); with a word saying which."""
    try:
        return graph_time_ms(fn) * 1e3, "CUDA graph"
    except Exception:  # noqa: BLE001 - e.g. an op that cannot be captured
        torch.cuda.synchronize()
        return time_ms(fn) * 1e3, "launched (could not be captured)"


def part_sampling(results: Results, ctx: dict) -> None:
    from minillm.decoding.gpu_sampling import SamplingTensors, sample
    from minillm.decoding.sampling import SamplingParams

    device = ctx["device"]
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    for vocab in SAMPLER_VOCABS:
        for B in SAMPLER_BATCHES:
            g = torch.Generator(device=device).manual_seed(B)
            logits = torch.randn(B, vocab, device=device, generator=g) * 3
            rows = SamplingTensors.from_params([params] * B, range(B), [100] * B, device)
            t, k, p = rows.temperature.clone(), rows.top_k.clone(), rows.top_p.clone()
            base = {"kind": "sampler", "batch": B, "vocab": vocab, "temperature": 0.8, "top_k": 50, "top_p": 0.9}
            ours, how = _sampler_time_us(lambda: sample(logits, rows))
            eager, how_eager = _sampler_time_us(lambda: torch_sampler(logits, t, k, p))
            results.add(BENCHMARK, base, "time_us", ours, "torch_eager", eager,
                        note=f"per call; ours {how}, torch {how_eager}")
            comp = None
            if ctx["left"]() > 60:
                try:
                    compiled = torch.compile(torch_sampler, dynamic=False)
                    compiled(logits, t, k, p)
                    comp, how_comp = _sampler_time_us(lambda: compiled(logits, t, k, p))
                    results.add(BENCHMARK, base, "time_us", ours, "torch_compile", comp,
                                note=f"per call; ours {how}, torch.compile (one compilation per shape) {how_comp}")
                except Exception as e:  # noqa: BLE001 - torch.compile may not run here
                    results.add(BENCHMARK, {**base, "peer": "torch_compile"}, "error", None,
                                note=f"torch.compile: {type(e).__name__}: {e}"[:300])
            else:
                results.add(BENCHMARK, {**base, "peer": "torch_compile"}, "skipped", None,
                            note=f"time budget ({BUDGET_S:.0f} s) spent")
            print(f"  [{BENCHMARK}] sampler B={B:3d} vocab={vocab}: ours {ours:7.2f} us, eager {eager:7.2f} us"
                  + (f", compile {comp:7.2f} us" if comp else ""), flush=True)
    if ctx["left"]() < 60:
        results.add(BENCHMARK, {"kind": "sampled", "part": "sampling"}, "skipped", None, note="no time left")
        return
    sampled_engine(results, ctx)


def sampled_engine(results: Results, ctx: dict) -> None:
    """The fused engine on ``BATCH`` sampled requests, the tokens drawn inside the step's CUDA
    graph against drawn per sequence with a host round trip each."""
    from minillm.engine import SamplingParams
    from minillm.experiments import ch09_engine_benchmark as bench

    device = ctx["device"]
    model, tokenizer = random_model("llama-280m", device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, model.config.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(32, 128, (BATCH,), generator=g)]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64, ignore_eos=True, seed=0)
    base = {"kind": "sampled", "model": "llama-280m-random", "dtype": "bfloat16", "requests": BATCH,
            "output_len": 64, "temperature": 0.8, "top_p": 0.9}
    out = {}
    for mode, in_graph in (("host draws", False), ("in graph", True)):
        config = bench.bench_engine_config(BATCH, device=device.type, max_model_len=512, fused_decode="on",
                                           cuda_graphs="off", record_steps=True)
        engine = bench.build_engine(model=model, tokenizer=tokenizer, config=config)
        engine.sample_on_device = in_graph      # before the capture: the graphs end with the sampler or not
        engine.runner.capture_cuda_graphs(BATCH, engine.max_model_len, 0, sample_tokens=in_graph)
        for warm in (True, False):
            engine.steps.clear()
            _sync(device)
            t0 = time.perf_counter()
            ids = [engine.add_request(p, params) for p in prompts]
            done = {}
            while engine.has_unfinished_requests():
                done.update({o.request_id: o for o in engine.step() if o.finished})
            _sync(device)
            wall = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for i in ids for c in done[i].outputs)
        steps = [s.end - s.start for s in engine.steps
                 if len(s.tokens) == BATCH and all(n == 1 for n in s.tokens.values())]
        out[mode] = (tokens / wall, _median(steps) * 1e3 if steps else None, engine.runner.num_replays)
        print(f"  [{BENCHMARK}] sampled engine, {mode}: {out[mode][0]:,.0f} out tok/s, decode step "
              f"{out[mode][1]} ms", flush=True)
        del engine
        free_memory()
    note = ("fused engine, CUDA graphs (decode); 'host draws': the graph returns logits and each "
            "sequence's token is drawn on the GPU and read back one at a time (a synchronisation per "
            "sequence per step); 'in graph': the graph ends with the batched sampler, one copy of the ids")
    results.add(BENCHMARK, {**base, "mode": "in graph"}, "decode_step_ms", out["in graph"][1], "host draws",
                out["host draws"][1], note=note + "; median wall time of full pure-decode engine steps")
    results.add(BENCHMARK, {**base, "mode": "in graph"}, "output_tokens_per_s", out["in graph"][0], "host draws",
                out["host draws"][0], note=note + "; second of two runs (the first warms up)")
    model.fused_decode = None
    del model
    free_memory()


# == profiling ====================================================================================

def categorize(name: str) -> str:
    """A kernel's category from its name (used where no annotation says: inside a graph)."""
    n = name.lower()
    if any(s in n for s in ("argmax", "softmax", "multinomial", "sort", "topk", "cumsum", "exponential_race")):
        return "sampling"
    if any(s in n for s in ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "matmul", "splitk")):
        return "gemm"
    if any(s in n for s in ("_split_kernel", "merge_splits", "_fwd_kernel", "paged_decode", "paged_prefill",
                            "flash", "attention")):
        return "attention"
    if "rmsnorm" in n or "rsqrt" in n or "pow_tensor" in n or "meanops" in n:
        return "norms"
    if any(s in n for s in ("rope", "write_paged_kv", "catarray", "neg_kernel", "cos_kernel", "sin_kernel")):
        return "rotary"
    if any(s in n for s in ("silu", "elementwise", "mul", "add", "copy", "fill")):
        return "elementwise"
    return "other"


@contextlib.contextmanager
def labelled(model):
    """Wrap the model's parts in ``torch.profiler.record_function("ch10::<category>")`` ranges
    (module hooks and patched functions), so each kernel can be attributed to the innermost
    range that launched it."""
    from torch.profiler import record_function

    from minillm.model import fused as fused_mod
    from minillm.model import torch_model as tm

    from minillm.model.torch_model import MLP, DecoderLayer, Linear, RMSNorm

    handles, patches, stack = [], [], []
    labels = {RMSNorm: "norms", Linear: "gemm", MLP: "elementwise", DecoderLayer: "elementwise",
              torch.nn.Embedding: "other"}

    def pre(label):
        def hook(module, args):
            rf = record_function(f"ch10::{label}")
            rf.__enter__()
            stack.append(rf)
        return hook

    def post(module, args, out):
        stack.pop().__exit__(None, None, None)

    for m in model.modules():
        for cls, label in labels.items():
            if type(m) is cls or (cls is Linear and isinstance(m, Linear)):
                handles += [m.register_forward_pre_hook(pre(label)), m.register_forward_hook(post)]
                break

    def wrap(owner, attr, label):
        fn = getattr(owner, attr)

        def wrapped(*a, **kw):
            with record_function(f"ch10::{label}"):
                return fn(*a, **kw)
        setattr(owner, attr, wrapped)
        patches.append((owner, attr, fn))

    for owner, attr, label in ((tm, "apply_rope", "rotary"), (tm, "write_kv", "rotary"),
                               (tm, "rope_cos_sin", "rotary"), (tm, "paged_attention", "attention"),
                               (fused_mod, "paged_attention", "attention"), (fused_mod, "_linear", "gemm")):
        wrap(owner, attr, label)
    fused = getattr(model, "fused_decode", None)
    if fused is not None:
        kern = fused.k

        class Labelled:  # the fused kernels, each in its range (the module's other names as they are)
            pass
        lk = Labelled()
        for attr in kern.__all__:
            setattr(lk, attr, getattr(kern, attr))
        for attr, label in (("add_rmsnorm", "norms"), ("rope_write_kv", "rotary"), ("silu_mul", "elementwise"),
                            ("add_rmsnorm_gemv", "gemm"), ("silu_mul_gemv", "gemm"), ("decode_gemv", "gemm"),
                            ("add_rmsnorm_gemv_rope", "gemm")):
            wrap(lk, attr, label)
        fused.k = lk
    try:
        yield
    finally:
        if fused is not None:
            fused.k = kern
        for owner, attr, fn in reversed(patches):
            setattr(owner, attr, fn)
        for h in handles:
            h.remove()


def profile_eager(model, step) -> dict:
    """Run ``step()`` once under torch.profiler with the model `labelled`; per category the
    kernel count and GPU microseconds, and the total count."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with labelled(model), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = {c: {"kernels": 0, "us": 0.0} for c in CATEGORIES}
    linked = 0
    for e in prof.events():
        if e.device_type != DeviceType.CPU or not e.kernels:
            continue
        label, p = None, e
        while p is not None and label is None:
            if p.name.startswith("ch10::"):
                label = p.name[6:]
            p = p.cpu_parent
        for kern in e.kernels:
            if kern.name.startswith(("Memcpy", "Memset")):
                continue
            cat = label or categorize(kern.name)
            table[cat]["kernels"] += 1
            table[cat]["us"] += kern.duration
            linked += 1
    device_kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA
                      and not e.name.startswith(("Memcpy", "Memset"))]
    if linked == 0:  # no CPU-GPU links: categories by kernel name alone
        for e in device_kernels:
            cat = categorize(e.name)
            table[cat]["kernels"] += 1
            table[cat]["us"] += e.time_range.elapsed_us()
    return {"categories": table, "kernels": len(device_kernels), "attributed_by": "ranges" if linked else "names"}


def profile_graph(replay) -> list[dict]:
    """The kernels of one replay of a captured graph: ``[{name, start_us, dur_us, category}]``
    (empty when the profiler does not see inside graphs)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA
                 and not e.name.startswith(("Memcpy", "Memset"))), key=lambda e: e.time_range.start)
    if not ev:
        return []
    t0 = ev[0].time_range.start
    return [{"name": e.name[:80], "start_us": e.time_range.start - t0, "dur_us": e.time_range.elapsed_us(),
             "category": categorize(e.name)} for e in ev]


def empty_kernel_us(device) -> float:
    """Microseconds one almost empty kernel (a one-element add) costs inside a CUDA graph."""
    x = torch.zeros(1, device=device)
    return graph_time_ms(lambda: x.add_(1.0), repeats=200) * 1e3


# == parts 2 and 3: one decode step ===============================================================

def decode_setup(model, batch: int, context: int, device):
    """A paged cache holding ``batch`` sequences of ``context`` tokens (zeros: the values do not
    change the time) and the `PagedBatch` of their next decode step."""
    from minillm.model.paged import PagedBatch
    from minillm.paged import BlockManager

    bs = 16
    num_blocks = batch * math.ceil((context + 1) / bs) + 4
    cache = model.new_paged_cache(num_blocks, bs)
    manager = BlockManager(num_blocks, bs, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for i in range(batch):
        manager.allocate(i, torch.randint(0, vocab, (context,), generator=gen).tolist())
    manager.append_slots(list(range(batch)), torch.randint(0, vocab, (batch,), generator=gen).tolist())
    return cache, PagedBatch.from_manager(manager, list(range(batch)), 1, device=device)


def measure_step(model, cache, batch, mode: str, profile: bool = False) -> dict:
    """Eager and graph time of one decode step (+ argmax) in ``mode``; with ``profile`` the
    profiler's categories (eager) and the graph's timeline."""
    from minillm.model.fused import enable_fused_decode

    enable_fused_decode(model, cache, "on" if mode == "fused" else "off")

    def step():
        return model.forward_paged(batch, cache, last_only=True).argmax(-1)

    with torch.inference_mode():
        step()
        torch.cuda.synchronize()
        out = {"eager_step_ms": time_ms(step, warmup=10, rep=50)}
        fused = model.fused_decode
        if fused is not None:  # the same without layer replay: every layer through its wrappers
            out["replayed_layers"] = fused.replayed_layers
            fused.replay_layers = False
            out["eager_step_ms_no_replay"] = time_ms(step, warmup=10, rep=50)
            fused.replay_layers = True
        if profile:
            out["profile"] = profile_eager(model, step)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        out["step_ms"] = time_ms(graph.replay, warmup=10, rep=100)
        if profile:
            out["timeline"] = profile_graph(graph.replay)
    del graph
    return out


def part_step(results: Results, ctx: dict) -> None:
    from minillm.costs import decode_floor_s, kv_cache_bytes

    device, bw = ctx["device"], ctx["bandwidth"]
    model, _ = random_model("llama-280m", device)
    c = model.config
    cache, batch = decode_setup(model, BATCH, CONTEXT, device)
    kv = kv_cache_bytes(BATCH * (CONTEXT + 1), c.num_key_value_heads, c.head_dim, 2, c.num_hidden_layers)
    wb = weight_bytes(model)
    per_kernel = ctx["empty_kernel_us"]
    base = {"kind": "step", "model": "llama-280m-random", "dtype": "bfloat16", "batch": BATCH, "context": CONTEXT}
    m = {mode: measure_step(model, cache, batch, mode, profile=True) for mode in MODES}
    floor_bytes = decode_floor_s(wb, kv, bw)["bytes_s"] * 1e3
    add = lambda metric, *a, **kw: results.add(BENCHMARK, base, metric, *a, **kw)  # noqa: E731
    f, u = m["fused"], m["unfused"]
    add("step_ms", f["step_ms"], "unfused", u["step_ms"], note="decode step + argmax, CUDA graph replay")
    add("eager_step_ms", f["eager_step_ms"], "unfused", u["eager_step_ms"])
    add("eager_step_ms", f["eager_step_ms"], "fused, no replay", f["eager_step_ms_no_replay"],
        note=f"{f['replayed_layers']} of {c.num_hidden_layers} layers replaying layer 1's recorded launches")
    add("kernels_per_step", f["profile"]["kernels"], "unfused", u["profile"]["kernels"], better="lower",
        note="CUDA kernels of one eager step (torch.profiler)")
    add("floor_bytes_ms", floor_bytes, note=f"(weights {wb / 1e6:.0f} MB + KV {kv / 1e6:.0f} MB) / copy bandwidth")
    add("empty_kernel_us", per_kernel, note="a one-element add inside a CUDA graph")
    add("weight_bytes", wb)
    add("kv_bytes", kv)
    for mode in MODES:
        p = m[mode]["profile"]
        params = {**base, "mode": mode}
        floor = decode_floor_s(wb, kv, bw, p["kernels"], per_kernel * 1e-6)
        results.add(BENCHMARK, params, "floor_ms", floor["total_s"] * 1e3,
                    note="bytes at the copy bandwidth + kernels x empty_kernel_us")
        results.add(BENCHMARK, params, "step_ms", m[mode]["step_ms"],
                    fraction_of_ceiling=floor["total_s"] * 1e3 / m[mode]["step_ms"])
        for cat, v in p["categories"].items():
            results.add(BENCHMARK, params, f"{cat}_us", v["us"], note=f"attributed by {p['attributed_by']}")
            results.add(BENCHMARK, params, f"{cat}_kernels", v["kernels"], better="lower")
    ctx["artifact"]["step"] = {
        **base, "bandwidth_TBps": bw / 1e12, "empty_kernel_us": per_kernel, "weight_bytes": wb, "kv_bytes": kv,
        "modes": {mode: {"step_ms": m[mode]["step_ms"], "eager_step_ms": m[mode]["eager_step_ms"],
                         "kernels": m[mode]["profile"]["kernels"], "categories": m[mode]["profile"]["categories"],
                         "attributed_by": m[mode]["profile"]["attributed_by"], "timeline": m[mode]["timeline"]}
                  for mode in MODES}}
    print(f"  [{BENCHMARK}] 280M x {BATCH} seqs @ {CONTEXT}: graph step fused {f['step_ms']:.3f} ms vs unfused "
          f"{u['step_ms']:.3f} ms; kernels {f['profile']['kernels']} vs {u['profile']['kernels']}; floor (bytes) "
          f"{floor_bytes:.3f} ms; empty kernel {per_kernel:.2f} us", flush=True)
    model.fused_decode = None
    del model, cache
    free_memory()


def part_single(results: Results, ctx: dict) -> None:
    from minillm.costs import decode_floor_s

    device, bw = ctx["device"], ctx["bandwidth"]
    model, _ = random_model("llama-3.2-1b", device)
    cache, batch = decode_setup(model, 1, SINGLE_CONTEXT, device)
    m = {mode: measure_step(model, cache, batch, mode) for mode in MODES}
    wb = weight_bytes(model)
    base = {"kind": "single", "model": "llama-3.2-1b-random", "dtype": "bfloat16", "batch": 1,
            "context": SINGLE_CONTEXT}
    floor = decode_floor_s(wb, 0, bw)["total_s"] * 1e3
    results.add(BENCHMARK, base, "token_ms", m["fused"]["step_ms"], "unfused", m["unfused"]["step_ms"],
                fraction_of_ceiling=floor / m["fused"]["step_ms"], note="CUDA graph replay of one decode step")
    results.add(BENCHMARK, base, "eager_token_ms", m["fused"]["eager_step_ms"], "unfused",
                m["unfused"]["eager_step_ms"])
    results.add(BENCHMARK, base, "floor_ms", floor, note=f"weights ({wb / 1e9:.2f} GB) once at the copy bandwidth")
    ctx["artifact"]["single"] = {**base, "floor_ms": floor, **{mode: m[mode] for mode in MODES}}
    print(f"  [{BENCHMARK}] 1B single request: fused {m['fused']['step_ms']:.3f} ms/token, unfused "
          f"{m['unfused']['step_ms']:.3f}, floor {floor:.3f}", flush=True)
    model.fused_decode = None
    del model, cache
    free_memory()


# == part 4: the offline workload =================================================================

def part_offline(results: Results, ctx: dict) -> None:
    device = ctx["device"]
    model, tokenizer, workload, warm, base = offline_setup(device)
    out = offline_runs(model, tokenizer, workload, warm)
    f, u = out["fused"], out["unfused"]
    results.add(BENCHMARK, base, "output_tokens_per_s", f.output_tokens_per_s, "unfused", u.output_tokens_per_s)
    results.add(BENCHMARK, base, "decode_step_ms", f.decode_step_ms, "unfused", u.decode_step_ms,
                note="median wall time of full (64-sequence) pure-decode engine steps")
    model.fused_decode = None
    if "hf_static_batching" not in ctx and ctx["left"]() < 90:
        results.add(BENCHMARK, {**base, "peer": "hf_static_batching"}, "skipped", None, note="no time left")
        return
    del model
    free_memory()
    peer = hf_static_batching(ctx, workload)
    results.add(BENCHMARK, base, "output_tokens_per_s", f.output_tokens_per_s, "hf_static_batching",
                peer.output_tokens_per_s, note="the peer: transformers generate, batches of 64, after a warm-up")


def offline_setup(device):
    """Part 4's model, workload, warm-up workload and row params (part 5 shares them)."""
    from minillm.experiments import ch09_engine_benchmark as bench

    model, tokenizer = random_model("llama-280m", device)
    spec = bench.WorkloadSpec(OFFLINE_REQUESTS, (32, 256), (32, 256), seed=0)
    workload = bench.make_workload(spec, model.config.vocab_size)
    warm = bench.make_workload(bench.WorkloadSpec(BATCH, (32, 256), (8, 16), seed=1), model.config.vocab_size)
    base = {"kind": "offline", "model": "llama-280m-random", "dtype": "bfloat16", "num_requests": OFFLINE_REQUESTS,
            "concurrency": BATCH, "prompt_len": "32-256", "output_len": "32-256"}
    return model, tokenizer, workload, warm, base


def offline_runs(model, tokenizer, workload, warm, modes=("unfused", "fused"), **config) -> dict:
    """The engine on ``workload`` in each of ``modes`` (each after an untimed run of ``warm``),
    with the Chapter 9 bench configuration plus ``config``: ``{mode: result}``. Modes:
    ``"unfused"``, ``"fused"``, and ``"fused, no replay"`` (fused, every layer's launches made
    by its wrappers: `FusedDecode.replay_layers` off)."""
    from minillm.experiments import ch09_engine_benchmark as bench

    label = " eager" if config.get("cuda_graphs") == "off" else ""
    out = {}
    for mode in modes:
        fused = mode.startswith("fused")
        engine = bench.build_engine(model=model, tokenizer=tokenizer,
                                    config=bench.bench_engine_config(BATCH, device="cuda", max_model_len=1024,
                                                                     fused_decode="on" if fused else "off", **config))
        assert engine.fused_decode == fused
        if mode == "fused, no replay":
            engine.runner.model.fused_decode.replay_layers = False
        bench.run_offline(engine, warm, use_tqdm=False)
        out[mode] = r = bench.run_offline(engine, workload, mode=mode + label, use_tqdm=False)
        del engine
        free_memory()
        print(f"  [{BENCHMARK}] offline {mode}{label}: {r.output_tokens_per_s:,.0f} out tok/s, decode step "
              f"{r.decode_step_ms} ms", flush=True)
    return out


def hf_static_batching(ctx: dict, workload):
    """Transformers' static batching on the offline workload (the 280M checkpoint), measured
    once per run (after an untimed warm-up) and kept in ``ctx`` for the parts that compare
    with it."""
    from minillm.experiments import ch09_engine_benchmark as bench

    if "hf_static_batching" not in ctx:
        device = ctx["device"]
        path = bench.build_random_llama("llama-280m", dtype="bfloat16", device="cuda")
        hf = bench.load_hf_model(path, device, DTYPE)
        bench.run_hf_static(hf, workload[:BATCH], BATCH, use_tqdm=False)     # warm-up, untimed
        ctx["hf_static_batching"] = bench.run_hf_static(hf, workload, BATCH, use_tqdm=False)
        print(f"  [{BENCHMARK}] offline hf_static_batching: "
              f"{ctx['hf_static_batching'].output_tokens_per_s:,.0f} out tok/s", flush=True)
        del hf
        free_memory()
    return ctx["hf_static_batching"]


# == part 5: the offline workload on the eager engine ==============================================

def part_offline_eager(results: Results, ctx: dict) -> None:
    """The engine without CUDA graphs (fused and unfused) on part 4's workload, against
    transformers' static batching."""
    device = ctx["device"]
    model, tokenizer, workload, warm, base = offline_setup(device)
    out = offline_runs(model, tokenizer, workload, warm, modes=("unfused", "fused", "fused, no replay"),
                       cuda_graphs="off")
    for mode, r in out.items():
        results.add(BENCHMARK, {**base, "mode": f"{mode} eager", "cuda_graphs": "off"}, "decode_step_ms",
                    r.decode_step_ms, note=f"engine without CUDA graphs ({r.eager_steps} of {r.steps} steps eager); "
                    "median wall time of full (64-sequence) pure-decode steps")
    f, u = out["fused"], out["unfused"]
    results.add(BENCHMARK, {**base, "mode": "fused eager", "cuda_graphs": "off"}, "output_tokens_per_s",
                f.output_tokens_per_s, "unfused eager", u.output_tokens_per_s)
    results.add(BENCHMARK, {**base, "mode": "fused eager", "cuda_graphs": "off"}, "output_tokens_per_s",
                f.output_tokens_per_s, "fused, no replay eager", out["fused, no replay"].output_tokens_per_s,
                note="layers 2 and up replaying layer 1's recorded launches, against every layer through its wrappers")
    model.fused_decode = None
    del model
    free_memory()
    if "hf_static_batching" not in ctx and ctx["left"]() < 45:
        results.add(BENCHMARK, {**base, "mode": "eager", "cuda_graphs": "off", "peer": "hf_static_batching"},
                    "skipped", None, note="no time left")
        return
    peer = hf_static_batching(ctx, workload)
    for mode in ("fused", "fused, no replay", "unfused"):
        results.add(BENCHMARK, {**base, "mode": f"{mode} eager", "cuda_graphs": "off"}, "output_tokens_per_s",
                    out[mode].output_tokens_per_s, "hf_static_batching", peer.output_tokens_per_s,
                    note="the engine without CUDA graphs against transformers generate, batches of 64, "
                         "both after a warm-up")


# == part 6: static-cache decode against transformers (eager and torch.compile) ====================

def hf_random_model(preset: str, device, vocab_size: int, dtype=DTYPE, seed: int = 0):
    """A transformers `LlamaForCausalLM` of a `PRESETS` shape with random weights (its own
    initialisation), built in memory on ``device``; end-of-sequence disabled."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from minillm.experiments.ch09_engine_benchmark import PRESETS

    config = LlamaConfig(vocab_size=vocab_size, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=0, eos_token_id=0,
                         **{"tie_word_embeddings": False, **PRESETS[preset]})
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_static_cache(model, batch: int, max_len: int):
    """A transformers `StaticCache` of ``max_len`` positions (5.x: shapes taken lazily from
    the first update; 4.x: given here)."""
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # transformers 4.x
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=max_len, device=model.device,
                           dtype=model.dtype)


def hf_generate(model, ids, new: int, cache) -> None:
    """Greedy ``generate`` of exactly ``new`` tokens after ``ids`` into ``cache`` (reset
    first), generate's own compilation disabled (a compiled ``model.forward`` is used as is)."""
    from transformers import GenerationConfig

    cache.reset()
    config = GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
                              disable_compile=True)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                         generation_config=config)
    if out.shape[1] - ids.shape[1] != new:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, expected {new}")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _wall_s(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def tpot_ms(generate, new: int, device, reps: int = 2) -> tuple[float, float, float]:
    """``(ms per output token, s of a generation of new tokens, s of one of 1 token)``:
    ``generate(n)`` runs one whole generation of ``n`` new tokens; medians of ``reps``."""
    full = _median([_wall_s(lambda: generate(new), device) for _ in range(reps)])
    first = _median([_wall_s(lambda: generate(1), device) for _ in range(reps)])
    return (full - first) / (new - 1) * 1e3, full, first


@contextlib.contextmanager
def cudagraph_skips():
    """The CUDA-graph skips inductor reports inside the block: a list, filled on exit with
    its messages (or their count when the messages cannot be read)."""
    found: list[str] = []
    try:
        from torch._dynamo.utils import counters
        from torch._inductor import cudagraph_utils as cu
        log, before = cu.cudagraphs_log, counters["inductor"]["cudagraph_skips"]
    except Exception:  # noqa: BLE001 - diagnostics only
        yield found
        return
    messages: list[str] = []
    log.warning = lambda msg, *a, **kw: messages.append(str(msg % a if a else msg)[:200])
    try:
        yield found
    finally:
        del log.warning
        n = counters["inductor"]["cudagraph_skips"] - before
        found.extend(dict.fromkeys(messages) or ([f"{n} graphs (no message: not on CUDA)"] if n else []))


def measure_engine_decode(model, tokenizer, prompts: list[list[int]], new: int, device, fused: bool, reps: int = 3):
    """minillm's engine (CUDA graphs on CUDA, prefix caching off) generating ``new`` tokens for
    each prompt at once: ``(tpot_ms, warm-up s, median engine decode step ms, eager steps)``."""
    from minillm.experiments import ch09_engine_benchmark as bench

    device = torch.device(device)
    config = bench.bench_engine_config(len(prompts), device=device.type, max_model_len=len(prompts[0]) + new + 16,
                                       fused_decode="on" if fused else "off", enable_prefix_caching=False)
    engine = bench.build_engine(model=model, tokenizer=tokenizer, config=config)
    work = lambda n: [bench.BenchRequest(list(p), n) for p in prompts]  # noqa: E731
    t0 = time.perf_counter()
    bench.run_offline(engine, work(16), use_tqdm=False)
    bench.run_offline(engine, work(1), use_tqdm=False)
    warm_s = time.perf_counter() - t0
    runs = []

    def generate(n):
        runs.append(bench.run_offline(engine, work(n), use_tqdm=False))

    tpot = tpot_ms(generate, new, device, reps)[0]
    full = [r for r in runs if r.output_tokens == len(prompts) * new]
    step = _median([r.decode_step_ms for r in full if r.decode_step_ms is not None] or [float("nan")])
    del engine
    free_memory()
    return tpot, warm_s, step, sum(r.eager_steps or 0 for r in full)


def measure_hf_decode(model, ids, new: int, compiled: bool, reps: int = 2) -> dict:
    """Transformers' static-cache decode of ``ids`` (one batch): ``{"tpot_ms", "warm_s",
    "skips", "graphs"}``; with ``compiled`` the forward is ``torch.compile``'d
    (``mode="reduce-overhead", fullgraph=True``) for the measurement and restored after."""
    device = ids.device
    cache = hf_static_cache(model, ids.shape[0], ids.shape[1] + new)
    hf_generate(model, ids, 1, cache)  # eager: the cache's tensors are created (and marked static) outside tracing
    out = {"skips": [], "graphs": None}
    _sync(device)
    t0 = time.perf_counter()
    try:
        if compiled:
            from torch._dynamo.utils import counters

            torch._dynamo.reset()
            graphs0 = counters["stats"]["unique_graphs"]
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        with cudagraph_skips() as skips:
            prev = None
            for _ in range(8 if compiled else 1):  # compile, record the graphs, warm up until steady (2 in 10%)
                t = _wall_s(lambda: hf_generate(model, ids, new if compiled else min(8, new), cache), device)
                hf_generate(model, ids, 1, cache)
                if prev is not None and abs(t - prev) <= 0.1 * prev:
                    break
                prev = t
            _sync(device)
            out["warm_s"] = time.perf_counter() - t0
            out["tpot_ms"] = tpot_ms(lambda n: hf_generate(model, ids, n, cache), new, device, reps)[0]
        out["skips"] = skips
        if compiled:
            out["graphs"] = counters["stats"]["unique_graphs"] - graphs0
    finally:
        if compiled:
            model.__dict__.pop("forward", None)
    del cache
    free_memory()
    return out


def part_hf_static(results: Results, ctx: dict) -> None:
    """Time per output token of the 1B model at batch 1 and 8: minillm's engine against
    transformers' static cache, eager and compiled. ``ctx`` may override ``decode_preset``,
    ``decode_batches``, ``new_tokens``, ``prompt_len``, ``fused``, ``compile`` and ``reps``
    (the CPU test runs a tiny model through the same bookkeeping)."""
    device = torch.device(ctx["device"])
    preset = ctx.get("decode_preset", "llama-3.2-1b")
    batches = ctx.get("decode_batches", DECODE_BATCHES)
    new, plen = ctx.get("new_tokens", NEW_TOKENS), ctx.get("prompt_len", SINGLE_CONTEXT)
    fused, do_compile, reps = ctx.get("fused", True), ctx.get("compile", True), ctx.get("reps", 2)
    dtype = ctx.get("dtype", DTYPE)
    left = ctx["left"]
    model, tokenizer = random_model(preset, device, dtype=dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, vocab, (b, plen), generator=gen) for b in batches}
    bases = {b: {"kind": "decode", "model": f"{preset}-random", "dtype": str(dtype).removeprefix("torch."),
                 "batch": b, "prompt_len": plen, "new_tokens": new} for b in batches}
    what = (f"time per output token = one decode step, (T({new}) - T(1)) / {new - 1} of whole generations "
            f"(prefill cancels), medians of {reps}")
    ours: dict[int, float | None] = {}
    engine_notes: dict[int, str] = {}
    for b in batches:
        if left() < 20:
            results.add(BENCHMARK, {**bases[b], "system": "minillm"}, "skipped", None, note="no time left")
            ours[b] = None
            continue
        try:
            tpot, warm_s, step, eager = measure_engine_decode(model, tokenizer, prompts[b].tolist(), new, device, fused,
                                                              reps=max(reps, 3))
            ours[b] = tpot
            engine_notes[b] = (f"minillm engine ({'fused' if fused else 'unfused'}, "
                               f"{'CUDA graphs' if device.type == 'cuda' else 'no CUDA graphs (CPU)'}, "
                                                     f"warm-up {warm_s:.1f} s excluded, median engine decode step "
                                                     f"{step:.3f} ms, {eager} eager steps)")
            results.add(BENCHMARK, bases[b], "tpot_ms", tpot, note=f"{what}; {engine_notes[b]}")
            print(f"  [{BENCHMARK}] decode {preset} x {b}: minillm {tpot:.3f} ms/token", flush=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            ours[b] = None
            results.add(BENCHMARK, {**bases[b], "system": "minillm"}, "error", None,
                        note=f"{type(e).__name__}: {e}"[:300])
            free_memory()
    model.fused_decode = None
    del model
    free_memory()
    hf = hf_random_model(preset, device, vocab, dtype=dtype)
    attn = getattr(hf.config, "_attn_implementation", None)
    import transformers

    for peer, compiled, need_s in (("hf_static", False, 20), ("hf_static_compile", True, 100)):
        for b in batches:
            params = bases[b]
            if compiled and not do_compile:
                results.add(BENCHMARK, {**params, "peer": peer}, "skipped", None, note="compile not asked for")
                continue
            if left() < need_s:  # (after the first compilation: 1.2 x its warm-up time)
                results.add(BENCHMARK, {**params, "peer": peer}, "skipped", None,
                            note=f"time budget ({BUDGET_S:.0f} s) spent")
                continue
            try:
                m = measure_hf_decode(hf, prompts[b].to(device), new, compiled, reps)
            except Exception as e:  # noqa: BLE001 - e.g. torch.compile failing: recorded, not fatal
                traceback.print_exc()
                results.add(BENCHMARK, {**params, "peer": peer}, "error", None,
                            note=f"transformers {transformers.__version__}: {type(e).__name__}: {e}"[:300])
                free_memory()
                continue
            note = (f"{what}; transformers {transformers.__version__} generate, StaticCache, attention {attn}, "
                    + ("torch.compile(model.forward, mode='reduce-overhead', fullgraph=True); compile + graph "
                       f"recording warm-up {m['warm_s']:.1f} s excluded, {m['graphs']} graphs compiled"
                       if compiled else f"eager (generate's compilation disabled); warm-up {m['warm_s']:.1f} s")
                    + (f"; CUDA graphs skipped: {'; '.join(m['skips'])}" if m["skips"] else "")
                    + f"; ours: {engine_notes.get(b, 'not measured')}")
            results.add(BENCHMARK, params, "tpot_ms", ours[b], peer, m["tpot_ms"], note=note[:600])
            if compiled:
                need_s = max(need_s, 1.2 * m["warm_s"] + 10)
            print(f"  [{BENCHMARK}] decode {preset} x {b}: {peer} {m['tpot_ms']:.3f} ms/token (warm-up "
                  f"{m['warm_s']:.1f} s){' skips: ' + str(m['skips']) if m['skips'] else ''}", flush=True)
    del hf
    free_memory()


# == the run ======================================================================================

def selected_parts(spec: str | None = None) -> tuple[str, ...]:
    """The parts ``MINILLM_CH10_PARTS`` (or ``spec``) names, comma-separated, in run order; all
    when empty. An unknown name is a ``ValueError``."""
    spec = os.environ.get("MINILLM_CH10_PARTS", "") if spec is None else spec
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        raise ValueError(f"MINILLM_CH10_PARTS: unknown parts {unknown}; the parts are {list(PARTS)}")
    return tuple(p for p in PARTS if p in names) if names else PARTS


def row_part(row: dict) -> str | None:
    """The part that wrote a row of this benchmark (``None`` if it cannot say)."""
    p = row.get("params") or {}
    if "part" in p:  # error and skipped rows of a whole part (the empty-kernel probe belongs to "step")
        return "step" if p["part"] == "empty_kernel" else p["part"]
    kind = p.get("kind")
    if kind == "offline" and p.get("cuda_graphs") == "off":
        return "offline_eager"
    return {"kernel": "kernels", "step": "step", "single": "single", "offline": "offline",
            "decode": "hf_static", "sampler": "sampling", "sampled": "sampling"}.get(kind)


def keep_unselected_parts(results: Results, parts: tuple[str, ...]) -> None:
    """A partial re-run (``parts`` short of `PARTS`): the saved file keeps the earlier rows of
    the parts not re-run (and of rows no part claims); the re-run parts' rows are replaced."""
    if set(parts) != set(PARTS):
        results.keep_previous(BENCHMARK, lambda row: row_part(row) not in parts,
                              why=f"MINILLM_CH10_PARTS={','.join(parts)}: the other parts' rows")
        print(f"  [{BENCHMARK}] parts {list(parts)}; the others keep their earlier rows", flush=True)


def run(results: Results, device) -> None:
    device = torch.device(device)
    parts = selected_parts()
    if device.type != "cuda":
        raise RuntimeError("the Chapter 10 benchmark runs on a CUDA device")
    keep_unselected_parts(results, parts)
    start = time.perf_counter()
    ceilings = results.ceilings or {}
    if "copy_TBps" not in ceilings:
        from bench.common import measure_ceilings
        ceilings = measure_ceilings(device)
    ctx = {"device": device, "bandwidth": ceilings["copy_TBps"] * 1e12, "artifact": {},
           "left": lambda: BUDGET_S - (time.perf_counter() - start)}
    try:
        ctx["empty_kernel_us"] = empty_kernel_us(device) if "step" in parts else float("nan")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        ctx["empty_kernel_us"] = float("nan")
        results.add(BENCHMARK, {"part": "empty_kernel"}, "error", None, note=f"{type(e).__name__}: {e}"[:300])
    for name, part, need_s in (("step", part_step, 30), ("single", part_single, 30), ("kernels", part_kernels, 20),
                               ("sampling", part_sampling, 30), ("offline", part_offline, 60),
                               ("offline_eager", part_offline_eager, 45),
                               ("hf_static", part_hf_static, 60)):
        if name not in parts:
            continue
        if ctx["left"]() < need_s:
            results.add(BENCHMARK, {"part": name}, "skipped", None, note=f"time budget ({BUDGET_S:.0f} s) spent")
            continue
        t0 = time.perf_counter()
        try:
            part(results, ctx)
        except Exception as e:  # noqa: BLE001 - one part's failure must not stop the others
            traceback.print_exc()
            results.add(BENCHMARK, {"part": name}, "error", None, note=f"{type(e).__name__}: {e}"[:300])
            free_memory()
        print(f"  [{BENCHMARK}] part {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    _save_artifact(results, ctx["artifact"])


def _save_artifact(results: Results, artifact: dict) -> None:
    folder = os.environ.get("MINILLM_ARTIFACTS")
    if folder and artifact:
        path = Path(folder) / f"{results.slug}.ch10_profile.json"
        path.write_text(json.dumps(artifact, separators=(",", ":"), default=float) + "\n")
        print(f"  [{BENCHMARK}] profile and timeline -> {path}", flush=True)


def summary(results: Results | dict) -> str:
    """Each row: params that matter, metric, ours, the peer and the ratio."""
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    lines = [f"{'kind':8s} {'what':32s} {'metric':18s} {'ours':>10} {'peer':>14} {'peer value':>10} {'ratio':>6}"]
    for r in select(data, BENCHMARK):
        p = r["params"]
        if r["metric"].endswith(("_kernels", "_us")) and p.get("kind") == "step" and "mode" in p:
            continue  # the category table lives in the artifact
        what = " ".join(str(p.get(k)) for k in ("kernel", "shape", "mode", "model", "batch", "vocab", "peer", "part")
                        if p.get(k) is not None)
        lines.append(f"{str(p.get('kind', '')):8s} {what[:32]:32s} {r['metric'][:18]:18s} {_g(r['ours']):>10} "
                     f"{str(r['peer'] or ''):>14} {_g(r['peer_value']):>10} {_g(r['ratio']):>6}")
    return "\n".join(lines)


def _g(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


if __name__ == "__main__":
    from bench.run import main

    raise SystemExit(main(["--only", BENCHMARK]))
