"""Chapter 13: how rank 0's commands reach the other ranks.

Every step of a tensor-parallel engine starts with rank 0 telling the other ranks what to run
(`minillm.distributed.worker`), so the time a command takes to arrive is on the critical path
of every decode step: the other ranks cannot start their forward pass, and rank 0's first
all-reduce waits for them. Two ways to send it:

- `PipeCommands`: one OS pipe per rank, created by rank 0 before it spawns the others (so only
  for ranks on the same host that rank 0 started itself). A command is pickled once and
  written to each pipe; a rank blocks in ``read`` until it arrives, asleep while the server
  is idle, and wakes within microseconds when it does.
- `GlooCommands`: a broadcast over the gloo control group
  (`minillm.distributed.parallel_state`), which works wherever the ranks run (under
  ``torchrun`` they did not come from rank 0, so there is no pipe to inherit). Each broadcast
  is two collectives over TCP (the pickle's size, then its bytes).

Both pickle the command; a step's batch travels as NumPy arrays (`worker.batch_fields`),
which pickle as raw bytes, where torch tensors go through torch's own serializer at ten times
the cost.
"""
from __future__ import annotations

import pickle

import torch.distributed as dist

__all__ = ["GlooCommands", "PipeCommands"]


class PipeCommands:
    """Commands through pipes: ``writers`` (rank 0: one ``multiprocessing`` connection per other
    rank) or ``reader`` (any other rank: its end of rank 0's pipe)."""

    def __init__(self, writers=(), reader=None):
        self.writers, self.reader = list(writers), reader

    def send(self, command: tuple) -> None:
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        for w in self.writers:
            w.send_bytes(data)

    def receive(self) -> tuple:
        """The next command; ``("shutdown",)`` when rank 0's end is closed (it exited)."""
        try:
            return pickle.loads(self.reader.recv_bytes())
        except EOFError:
            return ("shutdown",)

    def close(self) -> None:
        for conn in [*self.writers, self.reader]:
            if conn is not None:
                conn.close()


class GlooCommands:
    """Commands broadcast from rank 0 over ``group`` (the gloo control group)."""

    def __init__(self, group):
        self.group = group

    def send(self, command: tuple) -> None:
        dist.broadcast_object_list([command], src=0, group=self.group)

    def receive(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        pass
