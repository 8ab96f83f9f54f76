"""Chapter 10: sampling a whole batch on the GPU, inside the decode step's CUDA graph.

`minillm.decoding.sampling.sample_token` draws one sequence's token at a time with a
``torch.Generator``: the logits (or, on the fused path, each drawn id) cross to the host once
per sequence per step, and every crossing waits for the GPU to finish the step. Here the
whole step's tokens are drawn by one fixed sequence of GPU operations over ``[B, vocab]``
logits, with every request's parameters as a row of a tensor, so the sampler can be recorded
at the end of the step's CUDA graph and only the ``B`` token ids come back.

Per row, in the order and with the semantics of `minillm.reference.ch09_sampling.next_token_probs`:

1. greedy rows (``temperature == 0``) take the argmax (the first maximum);
2. the others: logits / temperature, then ``min_p`` (drop tokens less likely than ``min_p``
   times the most likely one), ``top_k`` (drop tokens below the ``k``-th largest logit; ``0``:
   off), ``top_p`` (keep the most likely tokens, ties by token id, until the mass before the
   next reaches ``top_p``; ``1``: off), all from one stable descending sort of the row;
3. a draw from the softmax of what is left: the exponential race of
   `minillm.kernels.ch10_fused_decode.exponential_race`, with Philox numbers keyed by the row's
   seed and counted by its position, so a sequence's token depends only on its request's seed,
   its sample index (``seed + index``, as `minillm.decoding.sampling.completion_generator`),
   its position and its logits, never on what else is in the batch or on earlier steps.

Nothing reads a value back to the host and every shape is fixed by ``[B, vocab]``: the same
function runs eagerly and under a CUDA graph (`minillm.engine.model_runner.ModelRunner`), and
gives the same tokens on the same logits. The logit bias, min_tokens and penalties stay with
`minillm.decoding.logits_processors` (their inputs are ragged token histories); the engine
runs them on the device for the rows that need them and then this same sampler.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minillm.decoding.sampling import SamplingParams

__all__ = ["SamplingTensors", "filtered_logits", "sample"]


@dataclass
class SamplingTensors:
    """The sampling parameters of ``B`` rows as two tensors (two host-to-device copies a step):

    - ``floats: [3, B]`` float32: temperature (``0``: greedy), top_p, min_p;
    - ``ints: [3, B]`` int64: top_k (``0``: off), seed (the Philox key: request seed + sample
      index), position (of the token being drawn: the sequence's length before it).
    """

    floats: torch.Tensor
    ints: torch.Tensor

    @property
    def temperature(self) -> torch.Tensor:
        return self.floats[0]

    @property
    def top_p(self) -> torch.Tensor:
        return self.floats[1]

    @property
    def min_p(self) -> torch.Tensor:
        return self.floats[2]

    @property
    def top_k(self) -> torch.Tensor:
        return self.ints[0]

    @property
    def seeds(self) -> torch.Tensor:
        return self.ints[1]

    @property
    def positions(self) -> torch.Tensor:
        return self.ints[2]

    @property
    def batch_size(self) -> int:
        return self.floats.shape[1]

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int],
                    device) -> SamplingTensors:
        """Row ``i``: ``params[i]``, drawing with key ``seeds[i]`` at ``positions[i]``."""
        floats = torch.tensor([[p.temperature for p in params], [p.top_p for p in params],
                               [p.min_p for p in params]], dtype=torch.float32).reshape(3, len(params))
        ints = torch.tensor([[p.top_k for p in params], list(seeds), list(positions)],
                            dtype=torch.int64).reshape(3, len(params))
        return cls(floats.to(device, non_blocking=True), ints.to(device, non_blocking=True))

    @classmethod
    def empty(cls, rows: int, device) -> SamplingTensors:
        """``rows`` greedy rows (static buffers to fill)."""
        floats = torch.zeros(3, rows, dtype=torch.float32, device=device)
        floats[1] = 1.0
        return cls(floats, torch.zeros(3, rows, dtype=torch.int64, device=device))

    def view(self, rows: int) -> SamplingTensors:
        """The first ``rows`` rows (views: writes go to this object's tensors)."""
        return SamplingTensors(self.floats[:, :rows], self.ints[:, :rows])

    def copy_(self, other: SamplingTensors) -> None:
        """Copy ``other``'s rows into the first rows of this one; the rows after them become
        greedy (padding: harmless, and cheap to reason about)."""
        B = other.batch_size
        self.floats[:, :B].copy_(other.floats)
        self.ints[:, :B].copy_(other.ints)
        self.floats[0, B:].zero_()


def filtered_logits(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """``[B, vocab]`` float32: each row divided by its temperature (greedy rows: by 1), with
    ``-inf`` on the tokens ``min_p``, ``top_k`` and ``top_p`` drop (in that order); the softmax of
    a row is the distribution its token is drawn from."""
    x = logits.float()
    vocab = x.shape[-1]
    t = sampling.temperature
    x = x / torch.where(t > 0, t, torch.ones_like(t))[:, None]
    # min_p, relative to the most likely token (a row with min_p = 0 drops nothing)
    probs = torch.softmax(x, dim=-1)
    x = x.masked_fill(probs < sampling.min_p[:, None] * probs.amax(-1, keepdim=True), -torch.inf)
    # One stable descending sort serves top-k and top-p: ties stay in token-id order.
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    k = sampling.top_k
    k = torch.where((k > 0) & (k < vocab), k, torch.full_like(k, vocab))
    kth = sorted_x.gather(1, (k - 1)[:, None])
    sorted_x = sorted_x.masked_fill(sorted_x < kth, -torch.inf)          # still sorted: the tail goes
    p = torch.softmax(sorted_x, dim=-1)
    mass_before = p.cumsum(-1) - p
    top_p = sampling.top_p[:, None]
    sorted_x = sorted_x.masked_fill((mass_before >= top_p) & (top_p < 1), -torch.inf)
    return torch.empty_like(x).scatter_(1, order, sorted_x)             # back to token order


def sample(logits: torch.Tensor, sampling: SamplingTensors, out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits [B, vocab]`` (any float dtype, on the device the kernels
    run on): ``[B]`` int64 (in ``out`` if given). Graph-capturable; see the module docstring."""
    from minillm.kernels.ch10_fused_decode import exponential_race

    if logits.dim() != 2 or sampling.batch_size != logits.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and {sampling.batch_size} rows of parameters do not match")
    probs = torch.softmax(filtered_logits(logits, sampling), dim=-1)
    drawn = exponential_race(probs, sampling.seeds, sampling.positions)
    tokens = torch.where(sampling.temperature > 0, drawn, logits.argmax(-1))
    return tokens if out is None else out.copy_(tokens)
