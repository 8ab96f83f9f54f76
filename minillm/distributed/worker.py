"""Chapter 13: one rank of a tensor-parallel engine, and the loop the ranks other than 0 run.

Every rank holds a `Worker`: its shard of the model (`minillm.distributed.tp`), its shard of
the paged KV pool (its KV heads only, with the same number of blocks on every rank: the block
tables are rank 0's and are sent to all), and a `minillm.engine.model_runner.ModelRunner` over
them (eager, or replaying CUDA graphs that each rank captured with its collectives inside).

Rank 0 runs the engine: the scheduler, the block manager, sampling. For each thing the model
must do it sends a **command** to the other ranks (`minillm.distributed.commands`: a pipe per
rank, or the gloo control group under ``torchrun``) and then does it itself; every other rank
sits in `serve_commands`, receives the same command and does the same, so the ranks meet in the
same collectives in the same order. A command is a tuple ``(op, *args)``, run by the method
``op_<op>``:

=====================  ===========================================================================
``new_paged_cache``    allocate this rank's KV pool (``num_blocks, block_size, backend, phi``),
                       replacing the previous one
``step``               one engine step: the copy-on-write copies, then the runner's forward over
                       the step's batch (input ids, positions, slot mapping, ``cu_seqlens_q``,
                       sequence lengths, block tables: NumPy arrays, moved to the rank's device)
``forward_paged``      the model's eager forward over a batch (the engine's memory profiling)
``capture``            capture the CUDA graphs (``max_num_seqs, max_model_len, tokens``)
``new_cache``          a contiguous KV cache (``batch, max_len``) for the prompt-logprobs pass
``forward``            the contiguous forward (``input_ids, start_pos``) over that cache
``run``                ``fn(worker, *args)`` on every rank (a module-level function: it is
                       pickled by name); rank 0 gets its own result (benchmarks, tests)
``shutdown``           leave the loop and the process group
=====================  ===========================================================================

The logits come back on every rank (the LM head all-gathers them); only rank 0 samples.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from minillm.distributed.commands import GlooCommands, PipeCommands
from minillm.distributed.parallel_state import ParallelState, destroy_parallel_state, init_parallel_state
from minillm.distributed.tp import load_tp_model
from minillm.engine.model_runner import ModelRunner
from minillm.model.paged import PagedBatch

__all__ = ["BATCH_FIELDS", "RankRunner", "Worker", "batch_fields", "batch_from_fields", "command_delay_us",
           "describe_rank", "gather_to_rank0", "serve_commands", "time_all_reduce", "worker_main"]

log = logging.getLogger(__name__)

#: The `PagedBatch` fields a step sends (tensors travel as NumPy arrays, the rest as they are).
BATCH_FIELDS = ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables",
                "max_seqlen_q", "max_seq_len", "fresh_prefill")


def batch_fields(batch: PagedBatch) -> dict:
    """``batch`` as a picklable dict of NumPy arrays (its integer tensors) and numbers. A batch
    on a GPU comes back in one device-to-host copy per dtype (int64 rows, int32 rest), not one
    per field."""
    out = {name: getattr(batch, name) for name in BATCH_FIELDS}
    tensors = [n for n in BATCH_FIELDS if isinstance(out[n], torch.Tensor)]
    on_device = [n for n in tensors if out[n].device.type != "cpu"]
    for dtype in {out[n].dtype for n in on_device}:
        names = [n for n in on_device if out[n].dtype == dtype]
        flat = torch.cat([out[n].reshape(-1) for n in names]).cpu()
        for n, part in zip(names, flat.split([out[n].numel() for n in names])):
            out[n] = part.view(out[n].shape)
    for n in tensors:
        out[n] = out[n].numpy()
    return out


def batch_from_fields(fields: dict, device) -> PagedBatch:
    """The `PagedBatch` of `batch_fields`' dict, on ``device``."""
    return PagedBatch(**{k: torch.from_numpy(v).to(device, non_blocking=True) if isinstance(v, np.ndarray) else v
                         for k, v in fields.items()})


class RankRunner(ModelRunner):
    """`minillm.engine.model_runner.ModelRunner` whose graphs are captured in ``thread_local``
    mode: NCCL's watchdog thread may query the events of earlier collectives while a rank
    captures, which the default (``global``) mode counts as an illegal call during the
    capture. The captured steps are the same."""

    capture_error_mode = "thread_local"


class Worker:
    """One rank's shard of the model, of the KV pool and its runner (see the module docstring).

    Args:
        state: this rank's `ParallelState`.
        path: the checkpoint folder (every rank reads it and keeps its slices).
        dtype: the compute dtype (``None``: the checkpoint's).
    """

    def __init__(self, state: ParallelState, path: str | Path, dtype=None):
        self.state = state
        self.model = load_tp_model(path, state.world_size, state.rank, device=state.device, dtype=dtype,
                                   group=state.group)
        self.cache = None        # the paged pool of this rank
        self.cache_id = 0
        self.runner = None
        self.contiguous = None   # the contiguous cache of the prompt-logprobs pass

    def execute(self, command: tuple):
        op, *args = command
        return getattr(self, "op_" + op)(*args)

    # == the ops ================================================================================
    def op_new_paged_cache(self, cache_id: int, num_blocks: int, block_size: int, backend: str = "auto",
                           softmax_phi: float | None = None):
        self.cache = self.runner = None
        if self.state.device.type == "cuda":
            torch.cuda.empty_cache()  # the profiling pass's memory: rank 0 measured without it
        self.cache = self.model.new_paged_cache(num_blocks, block_size, backend=backend, softmax_phi=softmax_phi)
        self.cache_id = cache_id
        self.runner = RankRunner(self.model, self.cache)
        return self.cache

    def _batch(self, batch) -> PagedBatch:
        return batch if isinstance(batch, PagedBatch) else batch_from_fields(batch, self.state.device)

    @torch.inference_mode()
    def op_step(self, cache_id: int, batch, copies) -> torch.Tensor:
        self._prepare(cache_id, copies)
        return self.runner.forward(self._batch(batch))

    @torch.inference_mode()
    def step_and_sample(self, cache_id: int, batch, copies, sampling) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0's side of a step whose tokens it draws on its GPU (`ModelRunner.forward_and_sample`;
        ``sampling=None``: all greedy); the other ranks run `op_step`, with the same collectives."""
        self._prepare(cache_id, copies)
        return self.runner.forward_and_sample(self._batch(batch), sampling)

    @torch.inference_mode()
    def op_forward_paged(self, cache_id: int, batch, last_only: bool, copies=()) -> torch.Tensor:
        self._prepare(cache_id, copies)
        return self.model.forward_paged(self._batch(batch), self.cache, last_only=last_only)

    def op_enable_fused_decode(self, cache_id: int, mode: str, fold_into_gemv: bool | None = None) -> bool:
        """Chapter 10's fused path on this rank's shard, for steps over its pool (the same answer
        on every rank: the same code on the same kind of device)."""
        from minillm.model.fused import enable_fused_decode

        self._check_cache(cache_id)
        on = enable_fused_decode(self.model, self.cache, mode)
        if on and fold_into_gemv is not None:
            self.model.fused_decode.fold_into_gemv = fold_into_gemv
        return on

    def op_capture(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int = 0,
                   sample_tokens: bool = False) -> int:
        """Capture on every rank (``sample_tokens``: this rank's graphs end with the sampler; rank
        0's only); if any rank fails, none keeps its graphs (all run eagerly)."""
        ok, count = 1, 0
        try:
            count = self.runner.capture_cuda_graphs(max_num_seqs, max_model_len, max_num_batched_tokens,
                                                    sample_tokens=sample_tokens)
        except Exception:  # noqa: BLE001 - agreed on below, so that no rank replays alone
            log.warning("rank %d: CUDA graph capture failed; every rank runs eagerly:\n%s", self.state.rank,
                        traceback.format_exc())
            ok = 0
        flag = torch.tensor([ok], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.state.control)
        if not flag.item():
            self.runner.graphs.clear()
            if self.state.device.type == "cuda":
                torch.cuda.synchronize(self.state.device)
            return 0
        return count

    def op_warm_up(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int = 0,
                   sample_tokens: bool = False) -> int:
        return self.runner.warm_up(max_num_seqs, max_model_len, max_num_batched_tokens, sample_tokens)

    def op_new_cache(self, batch: int, max_len: int):
        self.contiguous = self.model.new_cache(batch, max_len)
        return self.contiguous

    @torch.inference_mode()
    def op_forward(self, input_ids: torch.Tensor, start_pos: int, with_cache: bool) -> torch.Tensor:
        return self.model(input_ids.to(self.state.device), start_pos=start_pos,
                          cache=self.contiguous if with_cache else None)

    def op_run(self, fn, args=(), kwargs=None):
        return fn(self, *args, **(kwargs or {}))

    def _prepare(self, cache_id: int, copies) -> None:
        """Before a step over pool ``cache_id``: check it is the current one, run the step's
        copy-on-write block copies."""
        self._check_cache(cache_id)
        if copies:
            self.cache.copy_blocks(copies)

    def _check_cache(self, cache_id: int) -> None:
        if self.cache is None or cache_id != self.cache_id:
            raise RuntimeError(f"rank {self.state.rank}: KV pool {cache_id} is not the current one ({self.cache_id})")


def serve_commands(worker: Worker, commands: PipeCommands | GlooCommands) -> None:
    """The loop of every rank but 0: receive rank 0's next command, run it, until ``shutdown``."""
    while True:
        command = commands.receive()
        if command[0] == "shutdown":
            return
        worker.execute(command)


def _exit_with_parent(parent_pid: int) -> None:
    """A spawned rank ends when the process that started it is gone (killed, crashed): it would
    otherwise wait for a command forever."""
    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)
    threading.Thread(target=watch, daemon=True, name="minillm-parent-watch").start()


def worker_main(rank: int, world_size: int, init_method: str, path: str, dtype, backend: str,
                num_threads: int | None = None, parent_pid: int | None = None, commands=None) -> None:
    """The entry point of a spawned rank (``rank >= 1``): join the group, load the shard, serve
    the commands that arrive through ``commands`` (this rank's end of rank 0's pipe; ``None``:
    the gloo control group)."""
    if num_threads:
        torch.set_num_threads(num_threads)
    # Ctrl-C reaches every process of the terminal's group: rank 0 decides when the ranks
    # stop (it drains its requests, then sends "shutdown"), so the others ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    state = init_parallel_state(rank, world_size, backend, init_method)
    channel = PipeCommands(reader=commands) if commands is not None else GlooCommands(state.control)
    try:
        serve_commands(Worker(state, path, dtype), channel)
    finally:
        channel.close()
        destroy_parallel_state()


def gather_to_rank0(worker: Worker, value):
    """``[value of rank 0, value of rank 1, ...]`` on every rank (over the control group)."""
    out = [None] * worker.state.world_size
    dist.all_gather_object(out, value, group=worker.state.control)
    return out


def time_all_reduce(worker: Worker, hidden: int, tokens: tuple[int, ...] = (1,), dtype=None, calls: int = 50,
                    repeats: int = 5, in_graph: bool = False) -> dict[int, float]:
    """A ``run`` function: microseconds per all-reduce of a ``[tokens, hidden]`` activation over
    the data group, alone (no model), for each count in ``tokens``: ``calls`` all-reduces back
    to back between two CUDA events (``time.perf_counter`` on a CPU), the median of
    ``repeats``, after a warm-up. With ``in_graph`` (GPU only) the ``calls`` all-reduces are
    captured in one CUDA graph and replayed, as inside a captured decode step: no launch cost,
    only NCCL's own latency. Rank 0's numbers (every rank takes part)."""
    device, group = worker.state.device, worker.state.group
    dtype = dtype or worker.model.lm_head.weight.dtype
    cuda = device.type == "cuda"
    if in_graph and not cuda:
        raise ValueError("in_graph needs CUDA graphs: ranks on GPUs")
    out = {}
    for n in tokens:
        x = torch.randn(n, hidden, device=device).to(dtype) * 1e-3   # small: 50 doublings stay finite
        for _ in range(5):
            dist.all_reduce(x, group=group)

        def calls_back_to_back():
            for _ in range(calls):
                dist.all_reduce(x, group=group)

        run = calls_back_to_back
        if cuda and in_graph:
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode=RankRunner.capture_error_mode):
                calls_back_to_back()
            run = graph.replay
            run()
        times = []
        for _ in range(repeats):
            dist.barrier(group=worker.state.control)
            if cuda:
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / calls)
            else:
                t0 = time.perf_counter()
                run()
                times.append((time.perf_counter() - t0) * 1e6 / calls)
        out[n] = sorted(times)[len(times) // 2]
    return out


def command_delay_us(worker: Worker, sent_at: float, payload=None) -> list[float]:
    """A ``run`` function: microseconds from ``sent_at`` (rank 0's ``time.perf_counter()`` just
    before it sent the command; the clock is the host's, shared by its processes) to this
    rank's receiving it, gathered from every rank (rank 0's entry: its own send). ``payload``
    (e.g. a step's `batch_fields`) rides along, to time a command of that size."""
    return gather_to_rank0(worker, (time.perf_counter() - sent_at) * 1e6)


def describe_rank(worker: Worker) -> list[dict]:
    """A ``run`` function: what each rank holds, gathered from every rank: its device, its
    shard's heads, MLP slice and vocabulary rows, its parameter shapes, the shape of its KV
    pool, whether Chapter 10's fused path is on (and folds into its GEMVs), and the
    `DISTRIBUTED_ENV` variables in its environment."""
    from minillm.distributed.parallel_state import DISTRIBUTED_ENV

    m, c = worker.model, worker.model.config
    return gather_to_rank0(worker, {
        "rank": worker.state.rank, "pid": os.getpid(), "device": str(worker.state.device),
        "q_heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
        "intermediate": c.intermediate_size, "vocab_rows": (m.model.embed_tokens.start, m.model.embed_tokens.end),
        "shapes": {k: tuple(v.shape) for k, v in m.state_dict().items()},
        "kv_pool": tuple(worker.cache.pool.shape) if worker.cache is not None else None,
        "fused_decode": (None if getattr(m, "fused_decode", None) is None
                         else {"fold_into_gemv": m.fused_decode.fold_into_gemv}),
        "env": {k: os.environ.get(k) for k in DISTRIBUTED_ENV},
    })
