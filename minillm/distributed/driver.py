"""Chapter 13: rank 0's side of a tensor-parallel engine, and how the ranks are started.

`load_parallel_model` starts the world and returns a `TensorParallelModel`, which
`minillm.engine.LLMEngine` takes in place of a model: the same attributes and methods the
engine uses (``config``, ``lm_head``, ``new_paged_cache``, ``forward_paged``, ``new_cache``,
calling it), each of which broadcasts a command to the other ranks
(`minillm.distributed.worker`) and then runs rank 0's share. The engine's scheduler, block
manager and sampler never know: they run on rank 0 only, as before.

**Starting the ranks.** By default the engine's process becomes rank 0 and spawns ranks
``1 .. N-1`` with ``torch.multiprocessing`` (start method ``spawn``), which meet it at a TCP
rendezvous on 127.0.0.1. Under ``torchrun --nproc-per-node N`` (the environment has ``RANK``
and ``WORLD_SIZE = N``) nothing is spawned: every process loads its shard, rank 0 returns to
the caller's script and builds the engine, the other ranks serve rank 0 inside
`load_parallel_model` and exit when it shuts down, so the script's code after building the
engine runs on rank 0 only.

One world per process: a new one shuts the previous one down. `shutdown` (also run at exit)
stops the ranks and leaves the process group.
"""
from __future__ import annotations

import atexit
import itertools
import os
import sys
import warnings
from pathlib import Path

import torch

from minillm.distributed.commands import GlooCommands, PipeCommands
from minillm.distributed.parallel_state import (
    backend_for, destroy_parallel_state, free_port, init_parallel_state, set_distributed_env,
)
from minillm.distributed.worker import Worker, batch_fields, serve_commands, worker_main

__all__ = ["ShardedCache", "TensorParallelModel", "TensorParallelRunner", "load_parallel_model", "shutdown"]

_ACTIVE: TensorParallelModel | None = None


class ShardedCache:
    """What the engine holds as its paged KV pool: rank 0's shard of it (``local``), plus the
    copy-on-write copies the engine asks for, kept until the step's command carries them to
    every rank."""

    def __init__(self, cache_id: int, local):
        self.cache_id, self.local = cache_id, local
        self.pending: list[tuple[int, int]] = []

    def copy_blocks(self, copies) -> None:
        self.pending.extend(copies)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending = self.pending, []
        return copies

    def __getattr__(self, name):  # num_blocks, block_size, pool, kernels, nbytes, ...: rank 0's shard
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)


class TensorParallelRunner:
    """The engine's model runner under tensor parallelism: each step is broadcast, then every
    rank runs its own `minillm.engine.model_runner.ModelRunner` (with its own CUDA graphs)."""

    def __init__(self, model: TensorParallelModel, cache: ShardedCache):
        self.model, self.cache = model, cache
        self._copies: list[tuple[int, int]] = []   # the step's copy-on-write copies, sent with it

    @property
    def local(self):
        return self.model.worker.runner

    def forward(self, batch) -> torch.Tensor:
        self._send_step(batch)
        return self.model.worker.op_step(self.cache.cache_id, batch, self._copies)

    def forward_and_sample(self, batch, sampling) -> tuple[torch.Tensor, torch.Tensor]:
        """`ModelRunner.forward_and_sample` on rank 0 (its graphs end with the sampler); the other
        ranks run the same step's forward pass, whose collectives are the same."""
        self._send_step(batch)
        return self.model.worker.step_and_sample(self.cache.cache_id, batch, self._copies, sampling)

    def _send_step(self, batch) -> None:
        self._copies = self.cache.take_copies()
        if self.model.world_size > 1:  # (a world of one has no one to tell: no host copy of the batch)
            self.model.broadcast(("step", self.cache.cache_id, batch_fields(batch), self._copies))

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int = 0,
                            progress: bool = False, sample_tokens: bool = False) -> int:
        """Every rank captures its graphs; only rank 0's end with the sampler (``sample_tokens``)."""
        if not self.local.can_capture():  # the same answer on every rank: nothing to broadcast
            return 0
        command = ("capture", max_num_seqs, max_model_len, max_num_batched_tokens)
        self.model.broadcast(command)
        return self.model.worker.execute((*command, sample_tokens))

    def warm_up(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int = 0,
                sample_tokens: bool = False) -> int:
        """`ModelRunner.warm_up` on every rank (the padding steps' collectives run on all)."""
        if not self.local.can_capture():
            return 0
        command = ("warm_up", max_num_seqs, max_model_len, max_num_batched_tokens)
        self.model.broadcast(command)
        return self.model.worker.execute((*command, sample_tokens))

    @property
    def graphs(self):
        return self.local.graphs

    @property
    def cuda_graphs(self) -> bool:
        return self.local.cuda_graphs

    @property
    def num_eager(self) -> int:
        return self.local.num_eager

    @property
    def num_replays(self) -> int:
        return self.local.num_replays

    def describe(self) -> str:
        return f"{self.local.describe()} on each of {self.model.world_size} ranks"


class TensorParallelModel:
    """Rank 0's face of the sharded model, for `minillm.engine.LLMEngine` (see the module
    docstring). ``config`` is the full model's; ``local`` rank 0's shard; ``local_kv_heads``
    the KV heads each rank's pool holds (the engine sizes its blocks with it)."""

    def __init__(self, worker: Worker, commands: PipeCommands | GlooCommands, processes=(), torchrun: bool = False):
        self.worker, self.commands, self.processes, self.torchrun = worker, commands, list(processes), torchrun
        self.local = worker.model
        self.config = worker.model.full_config
        self.lm_head = worker.model.lm_head   # the engine reads its device and dtype
        self.local_kv_heads = worker.model.config.num_key_value_heads
        self.world_size, self.rank = worker.state.world_size, worker.state.rank
        self.backend = worker.state.backend
        self._cache_ids = itertools.count(1)
        self.closed = False

    # == commands ==============================================================================
    def broadcast(self, command: tuple) -> None:
        """Send ``command`` to every other rank (they run it; the caller then runs rank 0's)."""
        if self.closed:
            raise RuntimeError("this tensor-parallel model was shut down")
        if self.world_size > 1:
            self.commands.send(command)

    def run_on_all_ranks(self, fn, *args, **kwargs):
        """``fn(worker, *args, **kwargs)`` on every rank (``fn`` must be importable by name);
        returns rank 0's result."""
        command = ("run", fn, args, kwargs)
        self.broadcast(command)
        return self.worker.execute(command)

    # == what the engine calls =================================================================
    def new_paged_cache(self, num_blocks: int, block_size: int, backend: str = "auto",
                        softmax_phi: float | None = None) -> ShardedCache:
        """Every rank allocates its shard of a pool of ``num_blocks`` blocks (replacing the one
        before: one pool at a time)."""
        command = ("new_paged_cache", next(self._cache_ids), num_blocks, block_size, backend, softmax_phi)
        self.broadcast(command)
        return ShardedCache(command[1], self.worker.execute(command))

    def forward_paged(self, batch, cache: ShardedCache, last_only: bool = False) -> torch.Tensor:
        copies = cache.take_copies()
        self.broadcast(("forward_paged", cache.cache_id, batch_fields(batch), last_only, copies))
        return self.worker.op_forward_paged(cache.cache_id, batch, last_only, copies)

    def enable_fused_decode(self, cache: ShardedCache, mode: str = "auto", fold_into_gemv: bool | None = None) -> bool:
        """Chapter 10's fused path on every rank (`minillm.model.fused.enable_fused_decode`, which
        calls this for a tensor-parallel model); returns whether it is on. The row-parallel
        GEMVs add their partial sums and the head gathers the vocabulary as the layers would."""
        command = ("enable_fused_decode", cache.cache_id, mode, fold_into_gemv)
        self.broadcast(command)
        return self.worker.execute(command)

    def make_runner(self, cache: ShardedCache) -> TensorParallelRunner:
        return TensorParallelRunner(self, cache)

    def new_cache(self, batch: int, max_len: int):
        command = ("new_cache", batch, max_len)
        self.broadcast(command)
        return self.worker.execute(command)

    def __call__(self, input_ids: torch.Tensor, start_pos: int = 0, cache=None) -> torch.Tensor:
        with_cache = cache is not None
        self.broadcast(("forward", input_ids.cpu(), start_pos, with_cache))
        return self.worker.op_forward(input_ids, start_pos, with_cache)

    def parameters(self):
        """Rank 0's parameters (its shard)."""
        return self.local.parameters()

    # == the end ===============================================================================
    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group (idempotent)."""
        global _ACTIVE
        if self.closed:
            return
        try:
            if self.world_size > 1 and (self.torchrun or all(p.is_alive() for p in self.processes)):
                self.broadcast(("shutdown",))
        except RuntimeError as e:  # a rank is already gone: nothing to tell it
            warnings.warn(f"tensor-parallel shutdown: {e}", stacklevel=2)
        finally:
            self.closed = True
            self.commands.close()
            destroy_parallel_state()
            for p in self.processes:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
            if _ACTIVE is self:
                _ACTIVE = None


def shutdown() -> None:
    """Shut down this process's tensor-parallel world, if any (`TensorParallelModel.shutdown`)."""
    if _ACTIVE is not None:
        _ACTIVE.shutdown()


atexit.register(shutdown)


def _torchrun_rank(world_size: int) -> tuple[int, int] | None:
    """``(rank, local_rank)`` when this process was started by ``torchrun`` for this world."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env and int(env["WORLD_SIZE"]) == world_size:
        return int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"]))
    return None


def load_parallel_model(path: str | Path, world_size: int, device: str | None = None,
                        dtype: str | torch.dtype | None = None) -> TensorParallelModel:
    """Start a tensor-parallel world of ``world_size`` ranks over the checkpoint folder ``path``
    and return rank 0's `TensorParallelModel` (see the module docstring for how ranks start).

    ``device``: ``"cuda"`` (NCCL; rank ``r`` on ``cuda:r``) or ``"cpu"`` (gloo); ``None``: CUDA
    when available. ``dtype``: as `minillm.model.load_model`'s (``None``: the checkpoint's).
    A world of one runs the same code in this process alone.
    """
    global _ACTIVE
    from minillm.distributed.tp import check_tensor_parallel
    from minillm.model.config import ModelConfig

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = backend_for(device)
    config = ModelConfig.from_json(Path(path) / "config.json")
    check_tensor_parallel(config.num_attention_heads, config.num_key_value_heads, world_size)
    if getattr(config, "is_mla", False):
        raise ValueError("tensor parallelism here splits Llama/Qwen2 attention heads; an MLA model is not supported")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    if _ACTIVE is not None:
        warnings.warn("a tensor-parallel world was running in this process: shutting it down", stacklevel=2)
        _ACTIVE.shutdown()
    set_distributed_env()  # before anything starts NCCL, and inherited by the spawned ranks

    launched = _torchrun_rank(world_size)
    if launched is not None:
        rank, local_rank = launched
        state = init_parallel_state(rank, world_size, backend, None, local_rank=local_rank)
        worker = Worker(state, path, dtype)
        if rank != 0:  # serve rank 0 until it shuts down, then end this process
            try:
                serve_commands(worker, GlooCommands(state.control))
            finally:
                destroy_parallel_state()
            sys.exit(0)
        _ACTIVE = TensorParallelModel(worker, GlooCommands(state.control), torchrun=True)
        return _ACTIVE

    init_method = f"tcp://127.0.0.1:{free_port()}"
    threads = max(1, torch.get_num_threads() // world_size) if backend == "gloo" else None
    context = torch.multiprocessing.get_context("spawn")
    pipes = [context.Pipe(duplex=False) for _ in range(1, world_size)]   # (rank r's end, rank 0's end)
    processes = [context.Process(target=worker_main, name=f"minillm-tp-rank{rank}", daemon=True,
                                 args=(rank, world_size, init_method, str(path), dtype, backend, threads, os.getpid(),
                                       reader))
                 for rank, (reader, _) in zip(range(1, world_size), pipes)]
    for p in processes:
        p.start()
    for reader, _ in pipes:  # each rank holds its own copy now: rank 0 keeps only the writing ends
        reader.close()
    commands = PipeCommands(writers=[writer for _, writer in pipes])
    try:
        state = init_parallel_state(0, world_size, backend, init_method)
        worker = Worker(state, path, dtype)
    except BaseException:
        destroy_parallel_state()
        commands.close()
        for p in processes:
            p.terminate()
        raise
    _ACTIVE = TensorParallelModel(worker, commands, processes)
    return _ACTIVE
