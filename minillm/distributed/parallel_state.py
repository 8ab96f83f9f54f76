"""Chapter 13: the process group of a tensor-parallel engine, and the environment of its ranks.

One process per rank. Rank ``r`` computes on ``cuda:r`` with the NCCL backend, or on the CPU
with gloo (how the tests and the chapter run it). Besides the data group (the all-reduces of
the forward pass), every rank joins a second, **gloo** group over TCP, the *control* group,
for what the ranks agree on outside a step on the CPU (whether every rank captured its graphs,
the answers gathered for tests and benchmarks) and, under ``torchrun``, for rank 0's commands
(`minillm.distributed.commands`): an idle server's ranks can wait for the next command for as
long as it takes (the control group's timeout is a year; the data group keeps torch's
default, since its collectives only run inside a step).

`set_distributed_env` is the one place that sets the environment NCCL ranks start with; the
engine calls it before it spawns a rank and again in each rank before
``init_process_group``.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DISTRIBUTED_ENV", "ParallelState", "backend_for", "destroy_parallel_state", "device_for",
           "free_port", "get_parallel_state", "init_parallel_state", "is_initialized", "set_distributed_env"]

#: Set in every rank's environment before NCCL starts: no NVLink SHARP (NVLS) multicast and no
#: symmetric-memory multicast. The engine's collectives are plain ring/tree all-reduces and
#: all-gathers; multicast objects need a fabric set-up that shared or partitioned machines
#: may not grant, and NCCL would otherwise try them on NVSwitch systems.
DISTRIBUTED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

#: How long a rank waits for the next command of rank 0 (an idle server sends none).
CONTROL_TIMEOUT = datetime.timedelta(days=365)


def set_distributed_env() -> dict[str, str]:
    """Put `DISTRIBUTED_ENV` into ``os.environ`` (spawned ranks inherit it); returns it."""
    os.environ.update(DISTRIBUTED_ENV)
    return dict(DISTRIBUTED_ENV)


def backend_for(device: str | torch.device) -> str:
    """``"nccl"`` for CUDA, ``"gloo"`` for the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def device_for(backend: str, local_rank: int) -> torch.device:
    """Where a rank computes: ``cuda:local_rank`` under NCCL, else the CPU."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on now (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ParallelState:
    """This process's place in the tensor-parallel world.

    Attributes:
        rank, world_size: this rank and the number of ranks.
        backend: ``"nccl"`` or ``"gloo"`` (the data group's).
        device: where this rank computes.
        group: the data group (all-reduces and all-gathers of the forward pass).
        control: the gloo group rank 0 broadcasts commands through.
    """

    rank: int
    world_size: int
    backend: str
    device: torch.device
    group: object
    control: object


_STATE: ParallelState | None = None


def init_parallel_state(rank: int, world_size: int, backend: str, init_method: str | None = None,
                        local_rank: int | None = None, timeout: datetime.timedelta | None = None) -> ParallelState:
    """Join the process group (``init_method``: ``tcp://host:port``; ``None``: the ``MASTER_ADDR``
    / ``MASTER_PORT`` environment ``torchrun`` sets) and create the control group."""
    global _STATE
    if _STATE is not None:
        raise RuntimeError("this process already belongs to a tensor-parallel group: destroy it first "
                           "(minillm.distributed.shutdown())")
    set_distributed_env()
    local_rank = rank if local_rank is None else local_rank
    device = device_for(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if backend == "nccl":
        kwargs["device_id"] = device  # binds the communicator to this rank's GPU at once
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                            **kwargs)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)  # a group of its own even under gloo
    _STATE = ParallelState(rank, world_size, backend, device, dist.group.WORLD, control)
    return _STATE


def is_initialized() -> bool:
    return _STATE is not None


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("no tensor-parallel group in this process (init_parallel_state first)")
    return _STATE


def destroy_parallel_state() -> None:
    """Leave the process group (a no-op when there is none)."""
    global _STATE
    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()
