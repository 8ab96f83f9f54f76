"""How much KV-cache memory a contiguous cache wastes, and how much a paged one does.

The vLLM paper (Kwon et al., SOSP 2023, Fig. 2) reports that serving systems which reserve a
contiguous chunk per request use only 20-38 % of their KV memory for actual tokens (60-80 %
wasted), against 96 % used (under 4 % wasted) with paging. This module measures the same
thing on a synthetic stream of requests whose lengths are documented below, so the numbers
can be checked, and moved, by changing the assumptions.

Model of one request
--------------------
A request has a prompt of ``p`` tokens and produces ``o >= 1`` output tokens in ``o`` steps:
the prefill step stores the prompt's K and V and samples token 1; decode step ``j`` stores the
K and V of token ``j`` and samples token ``j + 1``. The last token is never fed back, so
during its ``o`` steps the request holds ``L = p, p + 1, ..., p + o - 1`` tokens, at most
``p + o - 1``. Memory is counted in **token slots** (one slot = one token's K and V in every
layer), so the answers do not depend on the model.

- **Contiguous** caches reserve, at admission, a fixed number of slots ``R`` for the
  request's whole life: ``max_len`` (the ``"max"`` policy: nothing is known about the output
  length), the next power of two of ``p + o - 1`` (``"pow2"``), or exactly ``p + o - 1``
  (``"oracle"``: an unrealistic best case that knows the output length in advance). These
  are the three "Orca" variants of the paper's Fig. 2.
- **Paged** caches hold ``ceil(L / block_size)`` blocks at each step: only the last block of
  a sequence is partly empty, so a sequence wastes fewer than ``block_size`` slots.

**Waste** is ``1 - used / reserved``, with both summed over every step of every request
(``when="lifetime"``, a time average: what a snapshot of a busy server shows), or taken at
each request's last step (``when="final"``: the waste left once the whole output exists).
Contiguous external fragmentation (holes between chunks) is *not* counted, which flatters the
contiguous cache.

The length distribution
-----------------------
`SHAREGPT_LIKE` stands in for ShareGPT conversations (the real data set is not bundled):
prompt and output lengths are independent lognormals whose means are the ShareGPT means that
the vLLM paper reports (161.31 input and 337.99 output tokens, its Fig. 11a), with shape
parameters ``sigma = 1.0`` (prompts: many short questions, a long tail of pasted documents)
and ``0.8`` (outputs) that are *assumptions*, chosen to look like the paper's histograms, not
fitted. Lengths are rounded, at least 1, and pairs with ``p + o > max_len = 2048`` are redrawn
(as vLLM's benchmark drops them), which lowers the means slightly; `Requests.describe` reports
the means actually drawn. `ALPACA_LIKE` does the same with the paper's Alpaca means (19.31 and
58.45 tokens, Fig. 11b).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "LengthDistribution", "Requests", "SHAREGPT_LIKE", "ALPACA_LIKE", "RESERVE_POLICIES", "DEFAULT_BLOCK_SIZES",
    "contiguous_reservation", "contiguous_waste", "paged_waste", "paged_waste_tokens", "waste_vs_block_size",
    "ServingTrace", "simulate_serving",
]

RESERVE_POLICIES = ("max", "pow2", "oracle")
DEFAULT_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class LengthDistribution:
    """Independent lognormal prompt and output lengths, truncated to ``p + o <= max_len``.

    Attributes:
        name: label for plots.
        prompt_mean, output_mean: means of the lognormals before rounding and truncation (tokens).
        prompt_sigma, output_sigma: standard deviations of the underlying normals (the shape;
            ``sigma = 1`` gives a standard deviation 1.3 times the mean).
        max_len: the model's context length; a contiguous ``"max"`` cache reserves this much.
    """

    name: str
    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float
    max_len: int = 2048

    def sample(self, n: int, seed: int = 0) -> Requests:
        """``n`` requests, deterministic in ``seed``."""
        rng = np.random.default_rng(seed)
        prompts = np.empty(0, dtype=np.int64)
        outputs = np.empty(0, dtype=np.int64)
        while len(prompts) < n:  # rejection sampling: redraw pairs that overflow max_len
            m = 2 * (n - len(prompts)) + 16
            p = self._draw(rng, self.prompt_mean, self.prompt_sigma, m)
            o = self._draw(rng, self.output_mean, self.output_sigma, m)
            keep = p + o <= self.max_len
            prompts, outputs = np.concatenate([prompts, p[keep]]), np.concatenate([outputs, o[keep]])
        return Requests(prompts[:n], outputs[:n], self.max_len)

    @staticmethod
    def _draw(rng, mean: float, sigma: float, m: int) -> np.ndarray:
        mu = np.log(mean) - sigma**2 / 2  # so that E[exp(N(mu, sigma))] = mean
        return np.maximum(1, np.rint(rng.lognormal(mu, sigma, m))).astype(np.int64)


SHAREGPT_LIKE = LengthDistribution("ShareGPT-like", 161.31, 1.0, 337.99, 0.8, 2048)
ALPACA_LIKE = LengthDistribution("Alpaca-like", 19.31, 0.8, 58.45, 0.8, 2048)


@dataclass(frozen=True)
class Requests:
    """A stream of requests: ``prompt_lens[i]`` and ``output_lens[i]`` tokens, int64 ``[n]``."""

    prompt_lens: np.ndarray
    output_lens: np.ndarray
    max_len: int

    def __post_init__(self):
        p, o = np.asarray(self.prompt_lens), np.asarray(self.output_lens)
        if p.shape != o.shape or p.ndim != 1 or len(p) == 0:
            raise ValueError("prompt_lens and output_lens must be 1-D arrays of the same, non-zero length")
        if (p < 1).any() or (o < 1).any():
            raise ValueError("every request needs a prompt and at least one output token")
        if (p + o - 1 > self.max_len).any():
            raise ValueError(f"a request holds more than max_len={self.max_len} tokens")

    @classmethod
    def of(cls, prompt_lens: Sequence[int], output_lens: Sequence[int], max_len: int) -> Requests:
        return cls(np.asarray(prompt_lens, dtype=np.int64), np.asarray(output_lens, dtype=np.int64), max_len)

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def peak_lens(self) -> np.ndarray:
        """The most tokens each request ever holds, ``p + o - 1``."""
        return self.prompt_lens + self.output_lens - 1

    def describe(self) -> dict[str, float]:
        """Means and a few quantiles of the lengths actually drawn (tokens)."""
        p, o = self.prompt_lens, self.output_lens
        return {"n": len(self), "prompt_mean": float(p.mean()), "prompt_median": float(np.median(p)),
                "prompt_p99": float(np.quantile(p, 0.99)), "output_mean": float(o.mean()),
                "output_median": float(np.median(o)), "output_p99": float(np.quantile(o, 0.99)),
                "max_len": self.max_len}


# ----------------------------------------------------------------------- closed forms per request
def _sum_range(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``sum(L for L in a..b)``, elementwise."""
    return (b * (b + 1) - (a - 1) * a) // 2


def _paged_prefix_sum(n: np.ndarray, bs: int) -> np.ndarray:
    """``sum(ceil(L / bs) * bs for L in 1..n)``: block ``k`` (1-based) is counted ``bs`` times
    at ``k * bs`` slots, plus ``n % bs`` partial steps at ``(n // bs + 1) * bs``."""
    q, r = n // bs, n % bs
    return bs * (bs * q * (q + 1) // 2 + r * (q + 1))


def contiguous_reservation(requests: Requests, policy: str = "max") -> np.ndarray:
    """Slots a contiguous cache reserves per request (int64 ``[n]``); see the module docstring."""
    peak = requests.peak_lens
    if policy == "max":
        return np.full_like(peak, requests.max_len)
    if policy == "pow2":
        return np.minimum(2 ** np.ceil(np.log2(peak)).astype(np.int64), requests.max_len)
    if policy == "oracle":
        return peak.copy()
    raise ValueError(f"unknown reservation policy {policy!r}; pick one of {RESERVE_POLICIES}")


def _used(requests: Requests, when: str) -> np.ndarray:
    p, o = requests.prompt_lens, requests.output_lens
    if when == "lifetime":
        return _sum_range(p, p + o - 1)
    if when == "final":
        return requests.peak_lens
    raise ValueError(f"when must be 'lifetime' or 'final', got {when!r}")


def contiguous_waste(requests: Requests, policy: str = "max", *, when: str = "lifetime") -> float:
    """Fraction of reserved slots that hold no token, for a contiguous cache."""
    reserve = contiguous_reservation(requests, policy)
    reserved = reserve * requests.output_lens if when == "lifetime" else reserve
    return float(1 - _used(requests, when).sum() / reserved.sum())


def _paged_reserved(requests: Requests, block_size: int, when: str) -> np.ndarray:
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    p, peak = requests.prompt_lens, requests.peak_lens
    if when == "lifetime":
        return _paged_prefix_sum(peak, block_size) - _paged_prefix_sum(p - 1, block_size)
    _used(requests, when)  # validates `when`
    return -(-peak // block_size) * block_size


def paged_waste(requests: Requests, block_size: int, *, when: str = "lifetime") -> float:
    """Fraction of allocated slots that hold no token, for a paged cache of ``block_size``."""
    return float(1 - _used(requests, when).sum() / _paged_reserved(requests, block_size, when).sum())


def paged_waste_tokens(requests: Requests, block_size: int) -> np.ndarray:
    """Empty slots in each request's last block at its last step (int64 ``[n]``); always
    ``< block_size``."""
    return _paged_reserved(requests, block_size, "final") - requests.peak_lens


def waste_vs_block_size(requests: Requests, block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES, *,
                        when: str = "lifetime") -> dict:
    """The data of the waste plot.

    Returns:
        ``{"block_sizes": [...], "paged": [waste per block size], "contiguous": {policy: waste},
        "when": when, "lengths": requests.describe()}``, wastes as fractions in ``[0, 1)``.
    """
    return {
        "block_sizes": list(block_sizes),
        "paged": [paged_waste(requests, bs, when=when) for bs in block_sizes],
        "contiguous": {policy: contiguous_waste(requests, policy, when=when) for policy in RESERVE_POLICIES},
        "when": when,
        "lengths": requests.describe(),
    }


# ----------------------------------------------------------------------- a serving loop on a pool
@dataclass(frozen=True)
class ServingTrace:
    """What `simulate_serving` saw, step by step (each array is ``[steps]``).

    Attributes:
        running: requests in the batch at each step.
        used: slots holding a token.
        reserved: slots reserved (contiguous) or in allocated blocks (paged).
        pool_slots: size of the pool, in slots.
        preemptions: requests evicted mid-generation to make room (paged only), in total.
    """

    running: np.ndarray
    used: np.ndarray
    reserved: np.ndarray
    pool_slots: int
    preemptions: int

    @property
    def steps(self) -> int:
        return len(self.running)

    @property
    def waste(self) -> float:
        """``1 - sum(used) / sum(reserved)``: the time-averaged waste."""
        return float(1 - self.used.sum() / self.reserved.sum())

    @property
    def mean_batch(self) -> float:
        return float(self.running.mean())


def simulate_serving(requests: Requests, pool_slots: int, block_size: int | None = None, *,
                     policy: str = "max") -> ServingTrace:
    """Serve ``requests`` (all waiting at step 0, first come first served) from a KV pool of
    ``pool_slots`` token slots, one token per running request per step.

    With ``block_size=None`` the cache is contiguous: a request is admitted once its whole
    reservation (``policy``, see `contiguous_reservation`) is free, and never grows. Otherwise it
    is paged: a request is admitted once its prompt's blocks are free, takes one more block
    whenever its last one fills, and when none is left the most recently admitted request is
    preempted (its blocks freed, and it waits at the head of the queue to be recomputed with
    everything it generated so far as its prompt), as vLLM does.

    Without preemptions, ``trace.waste`` equals ``contiguous_waste``/``paged_waste`` with
    ``when="lifetime"`` exactly: both sum the same per-step quantities. What only the loop
    shows is the batch size each scheme sustains (``trace.mean_batch``) and the steps it needs.
    Every step counts the same, a recomputed prompt included, so ``trace.steps`` understates
    what preemption costs; ``trace.preemptions`` says how often it happened.
    """
    if block_size is None:
        reserve = contiguous_reservation(requests, policy)
        if reserve.max() > pool_slots:
            raise ValueError(f"a request reserves {reserve.max()} slots, more than the pool's {pool_slots}")
        unit = 1
    else:
        reserve = None
        unit = block_size
        if pool_slots // block_size < -(-int(requests.peak_lens.max()) // block_size):
            raise ValueError("the pool cannot hold the longest request on its own")
    free = pool_slots // unit  # in slots (contiguous) or blocks (paged)
    pool = free * unit

    # queue entries: [request index, tokens held on admission, outputs still to produce]
    queue = deque([i, int(requests.prompt_lens[i]), int(requests.output_lens[i])] for i in range(len(requests)))
    running: list[list[int]] = []  # [index, tokens held L, outputs left, units held]
    trace_running, trace_used, trace_reserved, preemptions = [], [], [], 0

    def units_for(num_tokens: int) -> int:
        return -(-num_tokens // block_size)

    while queue or running:
        while queue:  # admission, first come first served
            i, tokens, left = queue[0]
            need = int(reserve[i]) if reserve is not None else units_for(tokens)
            if need > free:
                break
            queue.popleft()
            free -= need
            running.append([i, tokens, left, need])
        trace_running.append(len(running))
        trace_used.append(sum(r[1] for r in running))
        trace_reserved.append(sum(r[3] for r in running) * unit)

        survivors = []
        for r in running:  # one step: every request produces a token
            r[2] -= 1
            if r[2] == 0:
                free += r[3]
            else:
                r[1] += 1
                survivors.append(r)
        running = survivors
        if reserve is None:  # paged: the grown sequences may need new blocks
            for r in running:
                grow = units_for(r[1]) - r[3]
                while grow > free and running[-1] is not r:  # preempt the newest to make room
                    victim = running.pop()
                    free += victim[3]
                    queue.appendleft([victim[0], victim[1], victim[2]])
                    preemptions += 1
                if grow > free:  # r itself is the newest left: preempt it
                    running.remove(r)
                    free += r[3]
                    queue.appendleft([r[0], r[1], r[2]])
                    preemptions += 1
                    break
                free -= grow
                r[3] += grow

    return ServingTrace(np.asarray(trace_running), np.asarray(trace_used, dtype=np.int64),
                        np.asarray(trace_reserved, dtype=np.int64), pool, preemptions)
