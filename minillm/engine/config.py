"""Chapter 9: the engine's knobs, how big its KV pool is, and the errors a request can get."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ContextLengthExceeded", "EngineConfig", "InvalidRequest"]

MiB = 2**20


@dataclass
class EngineConfig:
    """How the engine runs (``minillm serve --help`` shows the same knobs).

    Attributes:
        device: ``"cuda"`` or ``"cpu"``; ``None``: CUDA when available.
        dtype: compute dtype; ``None``: the checkpoint's on a GPU, float32 on a CPU (which has
            no fast half-precision matmul).
        block_size: tokens per KV block.
        num_blocks: the pool's size in blocks; ``None``: from the memory budget below.
        gpu_memory_utilization: on CUDA, the fraction of the GPU's memory the engine may use
            in all (weights, activations, KV pool); the pool gets what is left.
        kv_cache_memory_mb: on a CPU, the pool's size in MiB.
        max_num_seqs: most sequences running at once (a request with ``n`` samples counts ``n``).
        max_num_batched_tokens: the per-step token budget (chunked prefill splits longer prompts).
        max_model_len: longest prompt + completion; ``None``: the model's
            ``max_position_embeddings``, capped by the pool.
        enable_prefix_caching: reuse the KV blocks of prompts seen before (paged cache only).
        attention_backend: ``"auto"`` (Triton kernels on CUDA in fp16/bf16, torch otherwise),
            ``"torch"`` or ``"triton"``.
        cuda_graphs: on CUDA with the Triton kernels, replay captured CUDA graphs for
            ``"all"`` steps (decode and mixed), ``"decode"`` steps only, or ``"off"`` (eager);
            see `minillm.engine.model_runner`. Ignored elsewhere.
        max_n: the largest ``n`` (and beam width) a request may ask for.
        seed: the engine's seed for requests that give none.
        record_steps: keep a `StepRecord` per step (the chapter's timeline plot).
        tensor_parallel_size: ranks the model is split over (Chapter 13, `minillm.distributed`):
            one process and one GPU each (gloo on a CPU); 1 runs in this process alone.
        fused_decode: Chapter 10's fused kernels and merged projections (`minillm.model.fused`):
            ``"auto"`` (on CUDA with the Triton attention kernels), ``"on"`` (force: on a CPU
            the kernels run in Triton's interpreter) or ``"off"`` (the torch layers).
        kv_cache: ``"paged"`` (Chapters 5-6: blocks of ``block_size`` tokens, block tables,
            prefix caching) or ``"virtual"`` (Chapter 11, `minillm.vmm.manager`: each sequence
            contiguous in a slot of reserved virtual memory, physical pages mapped as it
            grows; on CUDA through the driver's VMM API (needs ``cuda-bindings``), elsewhere
            over a simulated allocator whose page is ``block_size`` tokens). Virtual mode has
            no prefix cache (``enable_prefix_caching`` is set to False), copies the prompt for
            each fork instead of sharing it, counts ``num_blocks`` in pages of every layer's K
            and V, and runs in one process with a K/V (not MLA) model.
        overlap_decode: launch a pure decode step before the previous step's tokens reach the
            host, its input ids taken on the device, so that the host's scheduling and sampling
            overlap the GPU's work (`LLMEngine.overlap_decode`). ``"auto"`` (on CUDA with CUDA
            graphs and on-device sampling) or ``"off"``.
    """

    device: str | None = None
    dtype: str | torch.dtype | None = None
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_mb: float = 64
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    cuda_graphs: str = "all"
    max_n: int = 16
    seed: int | None = None
    record_steps: bool = False
    tensor_parallel_size: int = 1
    fused_decode: str = "auto"
    kv_cache: str = "paged"
    overlap_decode: str = "auto"

    def __post_init__(self):
        if self.kv_cache not in ("paged", "virtual"):
            raise ValueError(f"kv_cache must be 'paged' or 'virtual', got {self.kv_cache!r}")
        if self.kv_cache == "virtual":
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_cache='virtual' runs in one process: tensor_parallel_size must be 1")
            self.enable_prefix_caching = False  # a virtual cache shares nothing (vAttention has no prefix cache)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.cuda_graphs not in ("all", "decode", "off"):
            raise ValueError(f"cuda_graphs must be 'all', 'decode' or 'off', got {self.cuda_graphs!r}")
        if self.overlap_decode not in ("auto", "off"):
            raise ValueError(f"overlap_decode must be 'auto' or 'off', got {self.overlap_decode!r}")
        if self.fused_decode not in ("auto", "on", "off"):
            raise ValueError(f"fused_decode must be 'auto', 'on' or 'off', got {self.fused_decode!r}")
        if self.max_num_seqs < self.max_n:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) must be >= max_n ({self.max_n})")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_n", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class InvalidRequest(ValueError):
    """A request the engine refuses; the server answers HTTP 400 with ``message``.

    Attributes:
        param: the offending request field, as the OpenAI API names it (or ``None``).
        code: a short machine-readable reason (or ``None``).
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class ContextLengthExceeded(InvalidRequest):
    """Prompt + ``max_tokens`` is longer than ``max_model_len``."""

    def __init__(self, max_model_len: int, prompt_len: int, max_tokens: int):
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the length of the prompt or of max_tokens.",
            param="max_tokens", code="context_length_exceeded")
