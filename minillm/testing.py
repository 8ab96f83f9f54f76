"""The one helper every kernel test uses: compare a kernel with its NumPy reference.

What it checks, and why:

- **Fresh random inputs.** Each test run draws a new seed (printed in any failure message
  and fixed with ``MINILLM_SEED=<n>``), so the suite explores new inputs over time instead of
  passing on one lucky draw.
- **Poisoned outputs.** Output buffers are filled with NaN before the launch
  (`poisoned`), so an element the kernel forgot to write fails the comparison.
- **Dtype-aware tolerances** (`tolerance`): exact-ish for fp32 (dots use
  ``input_precision="ieee"``), looser for fp16 and bf16, whose inputs are already rounded.
- **Infinities compared exactly**: a masked score must be ``-inf``, not a large negative.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import subprocess
import tempfile
import threading
import time

import numpy as np
import torch

from minillm.kernels.base import interpreting  # noqa: F401  (tests define kernels: the switch first)

# The Triton interpreter has no bf16, so CPU runs test fp32 and fp16; bf16 runs on the GPU.
CPU_DTYPES = (torch.float32, torch.float16)
GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def default_device() -> torch.device:
    """CUDA when present, else CPU (where kernels run under ``TRITON_INTERPRET=1``)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def kernel_dtypes(device: torch.device | str | None = None) -> tuple[torch.dtype, ...]:
    """Dtypes kernels are tested in on ``device``."""
    device = torch.device(device or default_device())
    return GPU_DTYPES if device.type == "cuda" else CPU_DTYPES


#: Every seed `fresh_seed` returned, in order (the grader clears it before each test and
#: reports the seeds a failing test drew, so its message always says how to reproduce it).
drawn_seeds: list[int] = []


def fresh_seed() -> int:
    """A new seed per call, unless ``MINILLM_SEED`` pins one to reproduce a failure."""
    pinned = os.environ.get("MINILLM_SEED")
    seed = int(pinned) if pinned else int.from_bytes(os.urandom(4), "little")
    drawn_seeds.append(seed)
    return seed


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for comparing a kernel computed in ``dtype`` with a float64 reference.

    fp16 keeps 11 significant bits (unit roundoff ~4.9e-4) and bf16 8 bits (~3.9e-3); outputs
    of attention are averages of rounded values, so a few ulps of slack suffice.
    """
    return {
        torch.float32: (1e-4, 1e-4),
        torch.float16: (4e-3, 4e-3),
        torch.bfloat16: (3e-2, 3e-2),
    }[dtype]


def random_tensor(shape, dtype: torch.dtype, device, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Standard-normal values (times ``scale``) drawn on the CPU from ``generator`` (so the
    same seed gives the same numbers on any device), then moved to ``device``/``dtype``."""
    return (scale * torch.randn(*shape, generator=generator, dtype=torch.float64)).to(device=device, dtype=dtype)


def poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer full of NaN: every element the kernel leaves unwritten stays NaN."""
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """float64 NumPy copy of a tensor on any device (bf16 included)."""
    return t.detach().to("cpu", torch.float64).numpy()


def assert_close(actual: torch.Tensor, expected: np.ndarray, dtype: torch.dtype, name: str = "output",
                 seed: int | None = None, atol: float | None = None, rtol: float | None = None) -> None:
    """Assert ``actual`` (a kernel's output) matches ``expected`` (the float64 reference).

    ``dtype`` is the dtype the kernel computed in (it picks the tolerance). Infinities must
    match exactly, NaN never matches (poisoned elements), and the error message reports the
    worst element, how many elements are off, and the seed to reproduce.
    """
    default_atol, default_rtol = tolerance(dtype)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    got = to_numpy(actual)
    want = np.asarray(expected, dtype=np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape} != reference shape {want.shape}")

    finite = np.isfinite(want)
    same_inf = ~finite & (got == want)  # -inf == -inf, +inf == +inf
    with np.errstate(invalid="ignore"):  # inf - inf where the reference is infinite
        err = np.where(finite, np.abs(got - want), 0.0)
    ok = np.where(finite, err <= atol + rtol * np.abs(want), same_inf)
    ok &= ~np.isnan(got)
    if ok.all():
        return
    bad = np.argwhere(~ok)
    first = tuple(int(i) for i in bad[0])
    with np.errstate(invalid="ignore"):
        worst_err = np.nanmax(np.where(finite & ~np.isnan(got), err, np.nan)) if (finite & ~np.isnan(got)).any() else float("nan")
    n_nan = int(np.isnan(got).sum())
    raise AssertionError(
        f"{name}: {len(bad)} of {want.size} elements differ from the reference "
        f"(dtype {dtype}, atol {atol:g}, rtol {rtol:g}); first at {first}: got {got[first]!r}, "
        f"expected {want[first]!r}; max abs error over finite elements {worst_err:.3g}; "
        f"{n_nan} NaN (unwritten/poisoned) elements"
        + (f"; reproduce with MINILLM_SEED={seed}" if seed is not None else "")
    )


def assert_grad_close(got: torch.Tensor, want, dtype: torch.dtype, name: str, seed: int | None = None) -> None:
    """Gradients are sums of many rounded products: compare ``got`` with ``want`` (an array
    or a tensor) with an absolute tolerance scaled by the gradient's largest element (at
    least 1), and the dtype's rtol (fp16: twice both, since dS is rounded before its matmuls)."""
    want = to_numpy(want) if isinstance(want, torch.Tensor) else np.asarray(want)
    atol, rtol = tolerance(dtype)
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    factor = 2.0 if dtype == torch.float16 else 1.0
    assert_close(got, want, dtype, name, seed, atol=factor * atol * scale, rtol=factor * rtol)


def skip_fp32_on_gpu(dtype: torch.dtype, device) -> None:
    """Skip the calling test for fp32 on a GPU. fp32 runs exact IEEE dots, which on a GPU
    compile to long FMA sequences (slow to compile, no tensor cores, of no interest there):
    the interpreter checks fp32, the GPU the fp16/bf16 kernels (Chapters 4, 5 and 7)."""
    import pytest

    if dtype == torch.float32 and torch.device(device).type == "cuda":
        pytest.skip("fp32 is checked under the interpreter")


# ----------------------------------------------------------------------------------------
# Paged K/V pools for the kernel tests of Chapters 5 and 7
# ----------------------------------------------------------------------------------------
#: Blocks of NaN (`PagedPool`) or of random values around a pool, where any access outside
#: the pool lands and shows.
GUARD_BLOCKS = 8


class PagedPool:
    """K/V pools ``[num_blocks, block_size, kv_heads, head_dim]`` holding ``len(seq_lens)``
    sequences of random tokens in randomly placed blocks, every other slot NaN.

    ``tables``: int32 ``[batch, max_blocks]`` padded with -1 (a column more than the longest
    sequence needs, so padding is always present); ``k_seq[b], v_seq[b]``: sequence ``b``'s
    tokens ``[len, kv_heads, head_dim]`` as written (the contiguous truth). The pool is the
    middle of a NaN buffer with `GUARD_BLOCKS` more blocks on each side.

    ``shared_prefix_blocks``: sequences after the first reuse sequence 0's first blocks (and
    tokens), as prefix caching does; ``spare_blocks``: unused blocks (all NaN)."""

    def __init__(self, seq_lens, block_size, kv_heads, head_dim, dtype, device, gen, spare_blocks=3,
                 shared_prefix_blocks=0):
        from minillm.paged import padded_block_tables, write_slots
        from minillm.reference.ch05_paged_attention import paged_kv_addresses

        self.seq_lens, self.block_size = list(seq_lens), block_size
        need = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = sum(need) + spare_blocks
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        tables, used = [], 0
        for b, n_blocks in enumerate(need):
            if b > 0 and shared_prefix_blocks:  # prefix caching: reuse sequence 0's first blocks
                shared = tables[0][:min(shared_prefix_blocks, n_blocks)]
                tables.append(shared + perm[used:used + n_blocks - len(shared)])
                used += n_blocks - len(shared)
            else:
                tables.append(perm[used:used + n_blocks])
                used += n_blocks
        self.table_lists = tables
        self.tables = padded_block_tables(tables, max(need, default=0) + 1, device=device)
        # The pool is the middle of a NaN buffer with GUARD_BLOCKS more on each side: a read
        # just outside the pool (block -1, or past the last one) also meets NaN.
        shape = (num_blocks + 2 * GUARD_BLOCKS, block_size, kv_heads, head_dim)
        inside = slice(GUARD_BLOCKS, GUARD_BLOCKS + num_blocks)
        self.k = torch.full(shape, float("nan"), dtype=dtype, device=device)[inside]
        self.v = torch.full(shape, float("nan"), dtype=dtype, device=device)[inside]
        self.k_seq, self.v_seq = [], []
        for b, n in enumerate(seq_lens):
            k = random_tensor((n, kv_heads, head_dim), dtype, device, gen)
            v = random_tensor((n, kv_heads, head_dim), dtype, device, gen)
            if b > 0 and shared_prefix_blocks:  # the shared blocks hold sequence 0's tokens
                m = min(shared_prefix_blocks * block_size, n, seq_lens[0])
                k[:m], v[:m] = self.k_seq[0][:m], self.v_seq[0][:m]
            slots = paged_kv_addresses(tables[b], np.arange(n), block_size)
            write_slots(self.k, slots, k)
            write_slots(self.v, slots, v)
            self.k_seq.append(k)
            self.v_seq.append(v)

    def unused_blocks(self) -> list[int]:
        """Blocks of the pool that no sequence uses (all NaN)."""
        used = {blk for table in self.table_lists for blk in table}
        return [blk for blk in range(self.k.shape[0]) if blk not in used]

    def lens(self, device, dtype=torch.int32):
        return torch.tensor(self.seq_lens, dtype=dtype, device=device)

    def numpy(self):
        """``(k, v, tables)`` as NumPy, for the references."""
        return to_numpy(self.k), to_numpy(self.v), self.tables.cpu().numpy()


@contextlib.contextmanager
def serve_in_thread(app, log_level: str = "critical", timeout_s: float = 30.0):
    """Serve the ASGI ``app`` with uvicorn on a free port of 127.0.0.1, in a daemon thread;
    yields the base URL (``http://127.0.0.1:PORT``) and stops the server on exit."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError("the test server did not start")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)


def wait_idle(app, timeout_s: float = 20) -> None:
    """Wait until the server's engine thread reports nothing queued, nothing running and no KV
    block in use. Its snapshot is taken after each step's outputs are delivered, so once it
    reads idle, ``/metrics`` and the engine's own counters agree."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = app.state.runner.snapshot
        if s.running == s.waiting == s.blocks_used == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"the engine is not idle: {app.state.runner.snapshot}")


# ----------------------------------------------------------------------------------------
# Tiny DeepSeek-V2/V3 (multi-head latent attention) models for the tests of Chapter 12
# ----------------------------------------------------------------------------------------
#: A tiny dense MLA config (every layer dense: ``first_k_dense_replace = num_hidden_layers``);
#: its latent row is ``kv_lora_rank + qk_rope_head_dim = 28`` wide.
TINY_MLA_SIZES = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3,
                      kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=2,
                      max_position_embeddings=256)


def tiny_llama(seed: int = 0, *, vocab_size: int = 256, kv_heads: int = 2, head_dim: int = 16, layers: int = 2,
               max_position_embeddings: int = 512, family: str = "llama", intermediate_size: int = 128,
               **config_fields):
    """A random minillm `LlamaForCausalLM` (hidden 64, 4 query heads), in eval mode, with sharper
    weights than its init so that greedy choices are not near ties: what the engine tests run.
    ``family``: ``"llama"`` or ``"qwen2"``; ``config_fields``: more `ModelConfig` fields
    (``qkv_bias``, ``rope_theta``, ...)."""
    from minillm.model import LlamaForCausalLM, ModelConfig

    config = ModelConfig(model_type=family, vocab_size=vocab_size, hidden_size=64, intermediate_size=intermediate_size,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=max_position_embeddings, **config_fields)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.5 if "embed" in name else 0.1)
    return model


def tiny_mla_model(version: str = "v3", seed: int = 0, **overrides):
    """A random transformers ``DeepseekV2ForCausalLM`` (``version="v2"``) or
    ``DeepseekV3ForCausalLM`` of `TINY_MLA_SIZES` (``overrides`` on top), in eval mode, with
    sharper weights than its init (greedy choices not near ties) and no EOS in its generation
    config (``generate`` makes every token asked for, as the engine does with ``ignore_eos``).
    Save it with ``save_pretrained(path)`` for minillm to load."""
    import transformers

    if version == "v2":
        config, cls = transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM
    else:
        config, cls = transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config(**{**TINY_MLA_SIZES, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 1.0 if "embed" in name else 1.0 / math.sqrt(p.shape[-1]))
    model.generation_config.eos_token_id = None
    return model


def run_to_completion(engine, prompts, params, max_steps: int = 10_000) -> list:
    """Add every prompt to ``engine`` (an `LLMEngine`) at once and step until all finish; the
    final `RequestOutput` of each, in prompt order. ``params``: one `SamplingParams` for all,
    or a list with one per prompt. Checks that the finished requests freed every block."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests(), f"not finished after {max_steps} steps"
    assert engine.manager.num_used_blocks == 0, "finished requests must free every block"
    return [done[i] for i in ids]


def compiled_kernel_variants() -> dict[str, int]:
    """``{"chNN_module.kernel": count}``: how many compiled variants (specializations) each
    ``@triton.jit`` kernel of `minillm.kernels` holds in this process, and ``"....tuned_keys"``
    the keys each ``triton.autotune``'d kernel has tuned for. Two snapshots around some work
    tell whether it compiled or tuned anything (an engine's requests should not)."""
    import importlib
    import pkgutil

    import triton

    import minillm.kernels as kernels

    counts = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"minillm.kernels.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction) and obj.fn.__module__ == module.__name__:
                caches = getattr(obj, "device_caches", {})
                counts[f"{info.name}.{name}"] = sum(len(entry[0]) for entry in caches.values())
            elif isinstance(obj, triton.runtime.Autotuner) and obj.base_fn.__module__ == module.__name__:
                # an autotuned kernel: the keys it has benchmarked its configs for (a new key
                # times every config, a stall as long as a compile)
                counts[f"{info.name}.{name}.tuned_keys"] = len(obj.cache)
    return counts


def fp8_quantized_inputs(prepared: tuple, q_len: int, kv_len: int, block_m: int,
                         block_n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The float64 ``(q, k, v)`` an FP8 attention kernel multiplies, dequantized from what its
    quantizer prepared: ``prepared = (q8, k8, v8ᵀ, (q_scales, k_scales, v_scales))`` as
    `prepare_fp8` and `prepare_gluon_fp8` return them (Q in blocks of ``block_m`` rows, K in
    blocks of ``block_n``, Vᵀ in blocks of keys or one per head), cut to ``q_len`` / ``kv_len``.
    A reference fed these quantizes them again to the same values: it then checks the kernel's
    arithmetic, not whether two quantizers round the same ties the same way. (Vᵀ's keys must be
    in order: `prepare_gluon_fp8` with ``p_in_registers=False``.)"""
    from minillm.reference.ch04_fp8 import dequantize_blocks

    q8, k8, v8t, (q_scales, k_scales, v_scales) = prepared[:4]
    assert len(prepared) == 4 or not prepared[4], "Vᵀ's keys are permuted: prepare with p_in_registers=False"
    v8 = np.swapaxes(to_numpy(v8t), -1, -2)
    return (dequantize_blocks(to_numpy(q8), to_numpy(q_scales), block_m)[:, :, :q_len],
            dequantize_blocks(to_numpy(k8), to_numpy(k_scales), block_n)[:, :, :kv_len],
            dequantize_blocks(v8, to_numpy(v_scales), v8.shape[2] // v_scales.shape[-1])[:, :, :kv_len])


def assert_within_fp8_bound(out: torch.Tensor, q, k, v, block_m: int, block_n: int, causal: bool,
                            v_block: int | None, what: str = "", seed: int | None = None,
                            p_rel_error: float = 0.0, nonvacuous: bool = True, rounded_sum: bool = False) -> None:
    """Assert an FP8 attention kernel's ``out`` is within the error that FP8 allows of exact
    attention of the block-quantized inputs (`minillm.reference.ch04_fp8`), elementwise:
    rounding P to e4m3, on a GPU the tensor cores' ~14-bit FP8 accumulation, and the rounding
    of ``out`` to its dtype. ``q, k, v``: float64 NumPy arrays of what the kernel quantized
    (`fp8_quantized_inputs`); ``block_m``/``block_n``/``v_block``: the rows per scale of Q, K
    and V (``v_block`` None: ``block_n``); ``p_rel_error``: the relative error of the kernel's
    exponentials before any rounding (e.g. `minillm.reference.ch04_fp8.EXP2_POLY_REL_ERROR`),
    which reaches both P·V and ℓ: the bound's unit roundoff grows by three times it. Also checks
    that the bound is not vacuous (well below the output's own size), unless ``nonvacuous`` is
    False: over many keys of random inputs the output, an average, shrinks while the bound does
    not, and the caller must then catch a lost block another way. ``rounded_sum``: the kernel's
    row sums ℓ add P as rounded to e4m3, on the tensor cores (`ref8.p_rounding_bound`)."""
    from minillm.reference import ch04_fp8 as ref8

    kw = dict(causal=causal, v_block=v_block)
    want = ref8.fp8_attention(q, k, v, block_m, block_n, **kw)
    bound = ref8.p_rounding_bound(q, k, v, block_m, block_n, unit_roundoff=ref8.UNIT_ROUNDOFF + 3 * p_rel_error,
                                  rounded_sum=rounded_sum, **kw)
    if out.is_cuda:  # exact products and sums under the interpreter
        bound = bound + ref8.fp8_accumulation_bound(q, k, v, block_m, block_n, rounded_sum=rounded_sum, **kw)
    out_rounding = {torch.float32: 1e-6, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[out.dtype]
    err = np.abs(to_numpy(out) - want)
    allowed = bound + out_rounding * np.abs(want) + 1e-5
    worst = np.unravel_index(np.argmax(err - allowed), err.shape)
    assert np.all(err <= allowed), (f"seed {seed}, {what}: fp8 error {err[worst]:.3e} > bound {allowed[worst]:.3e} "
                                    f"at {worst} (want {want[worst]:.4e}; {int((err > allowed).sum())} of "
                                    f"{err.size} elements)")
    # A wrong scale or a lost block would move the output by about its own size.
    assert not nonvacuous or np.linalg.norm(bound) < 0.5 * np.linalg.norm(want)


# ----------------------------------------------------------------------------------------
# Compiling Gluon kernels for sm_90 on a machine without a GPU
# ----------------------------------------------------------------------------------------
#: The start of a script that compiles kernels for sm_90 without a GPU (run by
#: `compile_for_sm90`): Gluon functions must be defined with the interpreter off (under
#: TRITON_INTERPRET=1 they become interpreted functions, which the compiler cannot call), and
#: Triton's active driver is replaced by one that names an sm_90 target and launches nothing,
#: which is enough for ``warmup`` to compile. It imports the readers of the machine code
#: (`stack_bytes`, `sass_ops`, `exps_before_wait`, `key_loop_events`), then goes on to import
#: the kernels, compile them and print one JSON line last.
SM90_COMPILE_PRELUDE = r"""
import json, os, sys, torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime import driver


class CompileOnlySm90(DriverBase):
    def __init__(self):
        pass

    @staticmethod
    def is_active():
        return True

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def map_python_to_cpp_type(self, ty):
        from triton.backends.nvidia.driver import ty_to_cpp
        return ty_to_cpp(ty)

    def get_benchmarker(self):
        raise NotImplementedError

    def get_empty_cache_for_benchmark(self):
        raise NotImplementedError

    def clear_cache(self, cache):
        pass


driver.set_active(CompileOnlySm90())

from minillm.testing import exps_before_wait, key_loop_events, sass_ops, stack_bytes  # noqa: E402
"""


def compile_for_sm90(script: str) -> dict:
    """Run ``script`` (`SM90_COMPILE_PRELUDE` + its own part) in a fresh Python with the
    repository on the path and the interpreter off; returns the JSON of its last line."""
    import json
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cuobjdump(cubin: bytes, option: str) -> str:
    """What the ``cuobjdump`` that ships with Triton prints for ``cubin`` with ``option``."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, option, f.name], capture_output=True, text=True, check=True).stdout


def stack_bytes(cubin: bytes) -> int:
    """The bytes of stack of a compiled kernel's machine code (``asm["cubin"]``): ptxas spills
    registers to a stack frame in local memory, which the PTX does not show."""
    out = _cuobjdump(cubin, "-res-usage")
    return max(int(field.split(":")[1]) for field in out.split() if field.startswith("STACK:"))


def sass_ops(cubin: bytes) -> list[str]:
    """The instructions of ``cubin`` (a compiled kernel's ``asm["cubin"]``) in order, each as its
    text without the address and the encoding (``"MUFU.EX2 R12, R13"``): what ptxas scheduled,
    which the PTX does not show."""
    found = (re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line) for line in _cuobjdump(cubin, "-sass").splitlines())
    return [m.group(1) for m in found if m]


def _sass_event(op: str) -> str | None:
    """What a key-loop instruction of a Gluon forward kernel does, for `key_loop_events` (None:
    something else)."""
    if re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x[12]$", op):
        return "wait for S"  # the first wait of a block leaves P V (and the row sums) in flight
    if op == "WARPGROUP.DEPBAR.LE gsb0, 0x0":
        return "wait for P·V"
    for prefix, name in (("MUFU.EX2", "exp"), ("BAR.SYNC", "bar.sync"), ("STS", "store")):
        if op.startswith(prefix):
            return name
    return "release a slot" if "SYNCS.ARRIVE" in op else None


def exps_before_wait(ops: list[str]) -> int:
    """In the first key loop of a Gluon forward kernel (``ops``: `sass_ops`), the exponentials
    (``MUFU.EX2``) between the wait for the scores and the next wait for every matmul in flight."""
    start = next(i for i, op in enumerate(ops) if _sass_event(op) == "wait for S")
    end = next(i for i in range(start + 1, len(ops)) if _sass_event(ops[i]) == "wait for P·V")
    return sum(_sass_event(op) == "exp" for op in ops[start:end])


def key_loop_events(ops: list[str]) -> str:
    """The first key loop of a Gluon forward kernel (``ops``: `sass_ops`) from the wait for the
    scores to the next matmul, as its events in order (`_sass_event`), repeats counted:
    ``"wait for S → bar.sync → release a slot → 66× exp → …"``."""
    start = next(i for i, op in enumerate(ops) if _sass_event(op) == "wait for S")
    seen: list[list] = []
    for op in ops[start:]:
        if seen and "GMMA" in op:
            break
        name = _sass_event(op)
        if name and seen and seen[-1][0] == name:
            seen[-1][1] += 1
        elif name:
            seen.append([name, 1])
    return " → ".join(f"{n}× {name}" if n > 1 else name for name, n in seen)


def sm90_compile_mark(versions: tuple):
    """The skip mark of a test that compiles Gluon kernels for sm_90 with `SM90_COMPILE_PRELUDE`'s
    stand-in driver: it runs on a CPU-only machine whose Triton is one of ``versions`` (the
    Gluon APIs the module knows; Gluon renames things between releases)."""
    import pytest
    import triton

    from minillm.kernels.base import TRITON_VERSION

    if TRITON_VERSION not in versions:
        reason = f"the module's Gluon API is that of Triton {versions}, not {triton.__version__}"
    elif torch.cuda.is_available():
        reason = "compiles with a stand-in driver: CPU-only machines"
    else:
        reason = None
    return pytest.mark.skipif(reason is not None, reason=reason or "")
