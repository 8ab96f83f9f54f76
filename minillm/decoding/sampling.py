"""Parallel sampling: ``n`` completions of one prompt, sharing the prompt's KV blocks.

The naive way runs the prompt ``n`` times and stores its K/V ``n`` times. Here the prompt is
prefilled once, as one sequence, and `BlockManager.fork` makes ``n - 1`` copies that share
all its blocks. Every sample then draws its first token from the same logits, and from there
on all live samples decode together, one token each per step, in one batch. Only a block a
sample writes into is ever its own: the partly filled last block of the prompt is copied (copy-
on-write) when a sample first appends to it, and every later block is the sample's from the
start. A sample that stops (end-of-sequence token, or ``max_tokens``) frees its blocks at once.

Each sample draws from its own ``torch.Generator`` (seeded ``params.seed + i``), so its tokens do
not depend on how many others there are or when they stop: the ``n`` completions are exactly
what sampling each one alone, with the same generator, would give (the tests check this on
the contiguous-cache model).

This module also holds `KVPool`, the block manager + paged cache pair that beam search uses
too: prefill a prompt, decode a step, and record how many blocks the sequences hold.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from minillm.model.paged import PagedBatch, PagedKVCache
from minillm.paged import BlockManager, blocks_for
from minillm.decoding.sharing_trace import SharingTrace

__all__ = ["Completion", "KVPool", "ParallelSampler", "SamplingOutput", "SamplingParams", "completion_generator",
           "min_p_filter", "parallel_sample", "sample_token", "sampling_probs", "top_p_filter"]

_request_numbers = itertools.count()  # makes sequence ids unique in a manager shared by several requests


# == the paged pool both decoders run on ========================================================

class KVPool:
    """A `BlockManager` and its `PagedKVCache`, driven for one request's sequences.

    Keeps, for the memory measurement, the blocks the request's sequences hold at each forward
    step (``shared``: distinct blocks in their tables) and what they would hold without sharing
    (``unshared``: each sequence's ``ceil(length / block_size)`` on its own).
    """

    def __init__(self, model, manager: BlockManager, cache: PagedKVCache):
        if (manager.num_blocks, manager.block_size) != (cache.num_blocks, cache.block_size):
            raise ValueError(f"the manager ({manager.num_blocks} blocks of {manager.block_size}) and the cache "
                             f"({cache.num_blocks} blocks of {cache.block_size}) must describe the same pool")
        self.model, self.manager, self.cache = model, manager, cache
        self._request = next(_request_numbers)
        self._issued: list = []  # every sequence id handed out, for `release`
        self.shared: list[int] = []
        self.unshared: list[int] = []
        self.copies = 0

    @classmethod
    def create(cls, model, max_seqs: int, max_len: int, block_size: int = 16, manager: BlockManager | None = None,
               cache: PagedKVCache | None = None) -> KVPool:
        """Use ``manager`` and ``cache`` if given (an engine's pool); else a private pool with room
        for ``max_seqs`` sequences of ``max_len`` tokens even if nothing were shared, and with
        prefix caching off (so that only fork sharing shows in the measurement)."""
        if (manager is None) != (cache is None):
            raise ValueError("give both a manager and its cache, or neither")
        if manager is None:
            num_blocks = max_seqs * blocks_for(max_len, block_size)
            manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
            cache = model.new_paged_cache(num_blocks, block_size)
        return cls(model, manager, cache)

    def new_seq_id(self) -> tuple:
        """A sequence id no other request in the manager uses."""
        seq_id = ("request", self._request, len(self._issued))
        self._issued.append(seq_id)
        return seq_id

    def prefill(self, seq_id, prompt: Sequence[int]) -> torch.Tensor:
        """Allocate ``prompt`` as ``seq_id`` and run the tokens the prefix cache did not have;
        returns the last token's logits ``[vocab]`` (float32)."""
        cached = self.manager.allocate(seq_id, prompt)
        return self._forward_last([seq_id], len(prompt) - cached)[0]

    def decode(self, seq_ids: Sequence, token_ids: Sequence[int]) -> torch.Tensor:
        """Append ``token_ids[i]`` to ``seq_ids[i]`` and run them all in one batch; returns the
        logits ``[batch, vocab]`` (float32) that predict each sequence's next token."""
        result = self.manager.append_slots(seq_ids, token_ids)
        self.cache.copy_blocks(result.copies)  # copy-on-write: before the step writes into them
        self.copies += len(result.copies)
        return self._forward_last(seq_ids, 1)

    @torch.no_grad()
    def _forward_last(self, seq_ids: Sequence, num_new_tokens: int) -> torch.Tensor:
        self._record(seq_ids)
        batch = PagedBatch.from_manager(self.manager, seq_ids, num_new_tokens, device=self.cache.pool.device)
        return self.model.forward_paged(batch, self.cache, last_only=True).float()

    def _record(self, seq_ids: Sequence) -> None:
        tables = [self.manager.block_table(s) for s in seq_ids]
        self.shared.append(len(set().union(*tables)))
        self.unshared.append(sum(len(t) for t in tables))

    def free(self, seq_ids: Sequence) -> None:
        for seq_id in seq_ids:
            self.manager.free(seq_id)

    def release(self) -> None:
        """Free every sequence of this request still in the manager (at the end, or on an error)."""
        self.free([s for s in self._issued if s in self.manager])

    def trace(self) -> SharingTrace:
        """Blocks held at every forward step, with and without sharing."""
        return SharingTrace(np.asarray(self.shared), np.asarray(self.unshared), self.copies)


# == sampling one token =========================================================================

@dataclass(frozen=True)
class SamplingParams:
    """How to draw each token, and when to stop (the engine's request parameters too).

    The logits go through, in vLLM's order: ``logit_bias`` and ``min_tokens``, then the three
    penalties (`minillm.decoding.logits_processors`, batched over a step's rows), then, when
    sampling, temperature, ``min_p``, top-k and top-p (`sample_token`). Greedy takes the argmax
    after the penalties. `minillm.reference.ch09_sampling` is the NumPy reference of it all.

    Attributes:
        temperature: logits are divided by it; ``0`` means greedy (argmax).
        top_k: keep only the ``top_k`` most likely tokens (``0``: all).
        top_p: keep the fewest most likely tokens whose probability reaches ``top_p`` (nucleus
            sampling; ``1.0``: all).
        max_tokens: a completion stops after this many tokens.
        stop_token_ids: a completion stops after producing one of these (kept in its token ids;
            its text is left out unless ``include_stop_str_in_output``).
        seed: completion ``i`` draws from a generator seeded ``seed + i`` (on the engine's GPU
            path, Chapter 10, from Philox numbers keyed ``seed + i``:
            `minillm.decoding.gpu_sampling`); ``None``: a fresh random seed (the engine draws
            one per request).
        n: completions per prompt (the engine forks them from one prefill, sharing its blocks).
        stop: strings that end a completion; its text is cut before the first one (the engine).
        ignore_eos: keep going after the model's end-of-sequence token (benchmarks do).
        logprobs: also return, per generated token, its log-probability and the ``logprobs``
            most likely alternatives (0 to 20); ``None``: none.
        num_beams: ``> 1`` runs beam search of that width instead of sampling, returning the
            ``n`` best hypotheses (``minillm.decoding.beams``' semantics). The penalties,
            ``logit_bias``, ``min_p`` and ``min_tokens`` are refused with it.
        length_penalty: beam search's hypothesis score is ``sum_logprob / len ** length_penalty``.
        logit_bias: ``{token_id: bias}`` added to those tokens' logits (the server clamps each
            bias to ``[-100, 100]`` as OpenAI does); ids must lie in the vocabulary.
        min_tokens: the end-of-sequence and stop token ids are masked, and stop strings do not
            count, until this many tokens were generated (``<= max_tokens``).
        repetition_penalty: ``> 0``; every token of the prompt or the output so far has its
            logit divided by it if positive, multiplied by it if not (``1``: off).
        frequency_penalty: in ``[-2, 2]``; subtracts ``frequency_penalty * count`` from the logit
            of each token generated ``count`` times so far (the prompt does not count).
        presence_penalty: in ``[-2, 2]``; subtracts it once from every token generated so far.
        min_p: in ``[0, 1]``; after temperature, drops tokens whose probability is below
            ``min_p`` times the most likely token's.
        include_stop_str_in_output: keep the stop string (or the stop token's text) that ended
            a completion in its text.
        prompt_logprobs: also return each prompt token's log-probability given the tokens
            before it, with the ``prompt_logprobs`` most likely alternatives (0 to 20); the first
            token has none.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = 0
    n: int = 1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self):
        def integer(name, low):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        integer("top_k", 0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        integer("max_tokens", 1)
        integer("n", 1)
        integer("num_beams", 1)
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= self.MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.num_beams > 1 and self.n > self.num_beams:
            raise ValueError(f"beam search returns at most num_beams={self.num_beams} hypotheses, got n={self.n}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._check_processing()

    def _check_processing(self) -> None:
        """The logits-processing fields (messages start with the field's name)."""
        def number(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return float(value)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(name) <= 2:
                raise ValueError(f"{name} must lie in [-2, 2], got {getattr(self, name)}")
        if not number("repetition_penalty") > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= number("min_p") <= 1:
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
        value = self.min_tokens
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {value!r}")
        if value > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {value}")
        if self.prompt_logprobs is not None and not (isinstance(self.prompt_logprobs, int)
                                                     and not isinstance(self.prompt_logprobs, bool)
                                                     and 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {self.MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        if self.logit_bias is not None:
            bias = {}
            for token, value in dict(self.logit_bias).items():
                if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                        or not math.isfinite(value):
                    raise ValueError(f"logit_bias values must be finite numbers, got {value!r} for token {token}")
                bias[int(token)] = float(value)
            object.__setattr__(self, "logit_bias", bias or None)
        if self.beam_search:
            for name, off in (("logit_bias", None), ("min_tokens", 0), ("repetition_penalty", 1.0),
                              ("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("min_p", 0.0)):
                if getattr(self, name) != off:
                    raise ValueError(f"{name} is not supported with beam search")

    __hash__ = None  # logit_bias is a dict

    @property
    def penalized(self) -> bool:
        """Any of the three penalties is on."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def processes_logits(self) -> bool:
        """Anything changes the logits before temperature (so greedy sees it too)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def beam_search(self) -> bool:
        return self.num_beams > 1


def completion_generator(params: SamplingParams, index: int, seed: int | None = None) -> torch.Generator:
    """The CPU generator completion ``index`` draws from: seeded ``seed + index``, where
    ``seed`` defaults to ``params.seed`` (and must be given when that is ``None``)."""
    seed = params.seed if seed is None else seed
    if seed is None:
        raise ValueError("params.seed is None: pass the request's seed")
    return torch.Generator().manual_seed(seed + index)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Draw one token from ``logits [vocab]`` (float32, CPU): temperature, then min-p, then
    top-k, then top-p, then a draw from the softmax of what is left. (The logit bias, min_tokens
    and penalties come before, over the whole batch: `minillm.decoding.logits_processors`.)"""
    if params.temperature == 0:
        return int(logits.argmax())
    if logits.device.type != "cpu":  # Chapter 10: the row stays on the GPU, only the token id comes back
        return draw_on_device(sampling_probs(logits, params), generator)
    return int(torch.multinomial(sampling_probs(logits, params), 1, generator=generator))


def draw_on_device(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from ``probs [vocab]`` on their device by inversion: one uniform ``u`` in
    ``(0, 1]`` from the (CPU) ``generator``, then the first token whose cumulative probability
    reaches ``u`` times the total. The same distribution as ``torch.multinomial``, but other
    draws for the same seed; the host sends one number and reads back one id."""
    u = 1.0 - float(torch.rand((), generator=generator, dtype=torch.float64))
    cdf = probs.double().cumsum(0)
    return min(int((cdf < u * cdf[-1]).sum()), probs.shape[0] - 1)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``[vocab]`` `sample_token` draws from (``temperature > 0``)."""
    logits = logits / params.temperature
    if params.min_p > 0:
        logits = min_p_filter(logits, params.min_p)
    if 0 < params.top_k < logits.shape[0]:
        kth_best = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth_best, -torch.inf)
    if params.top_p < 1:
        logits = top_p_filter(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def min_p_filter(logits: torch.Tensor, min_p: float | torch.Tensor) -> torch.Tensor:
    """Drop (``-inf``) the tokens whose probability is below ``min_p`` times the most likely
    token's; ``logits [..., vocab]``, ``min_p`` a number or one per row (``[...]``)."""
    probs = torch.softmax(logits, dim=-1)
    if isinstance(min_p, torch.Tensor):
        min_p = min_p.to(probs.dtype).unsqueeze(-1)
    return logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -torch.inf)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens until their total probability reaches ``top_p``; the most
    likely token always stays."""
    sorted_logits, order = logits.sort(descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs              # probability of the tokens ranked above
    drop = order[mass_before >= top_p]
    return logits.index_fill(0, drop, -torch.inf)


# == parallel sampling ==========================================================================

@dataclass(frozen=True)
class Completion:
    """One sample: its generated tokens and why it stopped (``"stop"``: a stop token, kept as
    its last token; ``"length"``: ``max_tokens``)."""

    token_ids: list[int]
    finish_reason: str


@dataclass(frozen=True)
class SamplingOutput:
    """The ``n`` completions, in sample order, and the blocks held at every step."""

    completions: list[Completion]
    trace: SharingTrace


class ParallelSampler:
    """``n`` completions of one prompt over a shared paged cache, one decode step at a time.

    Construction prefills the prompt, forks it ``n - 1`` times and draws every sample's first
    token; each `step` then decodes all live samples in one batch. `parallel_sample` runs it to
    the end; stepping by hand lets you look at the block manager in between.

    Args:
        model: a `LlamaForCausalLM`.
        prompt: the prompt's token ids.
        n: number of completions.
        params: how to sample and when to stop.
        block_size: tokens per block of a private pool (ignored when ``manager`` is given).
        manager, cache: an existing pool to run in (both, or neither).
    """

    def __init__(self, model, prompt: Sequence[int], n: int, params: SamplingParams, *, block_size: int = 16,
                 manager: BlockManager | None = None, cache: PagedKVCache | None = None):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.params, self.prompt = params, list(prompt)
        self.pool = KVPool.create(model, n, len(prompt) + params.max_tokens, block_size, manager, cache)
        self.seq_ids = [self.pool.new_seq_id() for _ in range(n)]
        self.generators = [completion_generator(params, i) for i in range(n)]
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.finish_reasons: list[str | None] = [None] * n
        self.live = list(range(n))  # samples still running, by index

        try:
            logits = self.pool.prefill(self.seq_ids[0], prompt).cpu()
            for seq_id in self.seq_ids[1:]:
                self.pool.manager.fork(self.seq_ids[0], seq_id)  # shares every prompt block
            self._sample_live(logits.expand(n, -1))
        except BaseException:
            self.abort()
            raise

    @property
    def done(self) -> bool:
        return not self.live

    def step(self) -> None:
        """Feed every live sample its last token, in one batch, and draw its next one."""
        if self.done:
            raise RuntimeError("every sample has finished")
        logits = self.pool.decode([self.seq_ids[i] for i in self.live], [self.tokens[i][-1] for i in self.live])
        self._sample_live(logits.cpu())

    def _sample_live(self, logits: torch.Tensor) -> None:
        """Draw the next token of each live sample from its row of ``logits [live, vocab]``;
        finish (and free) those that stop. The logit bias, min_tokens and penalties apply as in
        the engine (`minillm.decoding.logits_processors`)."""
        if self.params.processes_logits:
            from minillm.decoding.logits_processors import apply_logits_processors  # it imports this module

            k = len(self.live)
            logits = apply_logits_processors(logits, [self.params] * k, [self.prompt] * k,
                                             [self.tokens[i] for i in self.live], [self.params.stop_token_ids] * k)
        still_live = []
        for i, row in zip(self.live, logits):
            token = sample_token(row, self.params, self.generators[i])
            self.tokens[i].append(token)
            reason = self._finish_reason(self.tokens[i])
            if reason is None:
                still_live.append(i)
            else:
                self.finish_reasons[i] = reason
                self.pool.manager.free(self.seq_ids[i])
        self.live = still_live

    def _finish_reason(self, tokens: list[int]) -> str | None:
        if tokens[-1] in self.params.stop_token_ids:
            return "stop"
        if len(tokens) >= self.params.max_tokens:
            return "length"
        return None

    def result(self) -> SamplingOutput:
        if not self.done:
            raise RuntimeError(f"{len(self.live)} samples are still running")
        completions = [Completion(t, r) for t, r in zip(self.tokens, self.finish_reasons)]
        return SamplingOutput(completions, self.pool.trace())

    def abort(self) -> None:
        """Free the blocks of the samples still running (their completions stay unfinished)."""
        self.pool.release()
        self.live = []


def parallel_sample(model, prompt: Sequence[int], n: int, params: SamplingParams, *, block_size: int = 16,
                    manager: BlockManager | None = None, cache: PagedKVCache | None = None) -> SamplingOutput:
    """``n`` completions of ``prompt``, decoded together over shared prompt blocks (see
    `ParallelSampler` for the arguments). Every block is freed at the end, even on an error."""
    sampler = ParallelSampler(model, prompt, n, params, block_size=block_size, manager=manager, cache=cache)
    try:
        while not sampler.done:
            sampler.step()
    finally:
        sampler.abort()  # a no-op unless something raised
    return sampler.result()
