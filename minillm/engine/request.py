"""Chapter 9: what the engine knows about a request while it runs, and what it hands back.

A `Request` is one prompt with its `SamplingParams`. It owns one or more `Sequence` objects:
one while the prompt is prefilled; ``n`` after it, for parallel sampling (forked from the
prompt, sharing its blocks); ``num_beams`` during beam search. The scheduler moves whole
requests between its queues, so a request's sequences always run in the same steps, which
is what beam search needs (every beam's logits at once) and keeps preemption simple.

A sequence's tokens are its prompt plus what it generated. ``num_computed`` of them have their
K and V in the paged cache; the rest (the whole prompt at first, then the one token sampled
last) are what the next steps compute.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from minillm.decoding.beams import BeamState
from minillm.decoding.sampling import SamplingParams
from minillm.engine.detokenizer import Detokenizer

__all__ = ["CompletionOutput", "Request", "RequestOutput", "RequestStatus", "Sequence", "TokenLogprob"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"    # queued, or preempted: holds no blocks
    RUNNING = "running"    # holds blocks and is scheduled every step it fits the budget
    FINISHED = "finished"  # every completion stopped, or it was aborted


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability (of the model's raw distribution, before
    temperature, top-k and top-p) and the ``k`` most likely tokens at that position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None     # 1 + how many tokens were more likely (prompt log-probabilities)


class Sequence:
    """One completion in progress: ``token_ids`` = prompt + generated tokens.

    ``seq_id`` is its name in the `minillm.paged.BlockManager` (unique for the engine's life);
    ``index`` is its completion number in the request (``0 .. n-1``).
    """

    def __init__(self, seq_id: int, index: int, token_ids: list[int], num_prompt_tokens: int,
                 generator: torch.Generator | None, detokenizer: Detokenizer):
        self.seq_id, self.index = seq_id, index
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed = 0          # leading tokens whose K/V are in the cache
        self.generator = generator
        self.detokenizer = detokenizer
        self.logprobs: list[TokenLogprob] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """``len(output_ids)``, without copying them."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def fork(self, seq_id: int, index: int, generator: torch.Generator | None) -> Sequence:
        """A copy with its own name, index and generator (the prompt's K/V are shared in the
        block manager by `BlockManager.fork`)."""
        child = Sequence(seq_id, index, list(self.token_ids), self.num_prompt_tokens, generator,
                         self.detokenizer.copy())
        child.num_computed = self.num_computed
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, index={self.index}, tokens={len(self.token_ids)}, "
                f"computed={self.num_computed}, finish={self.finish_reason})")


@dataclass(frozen=True)
class CompletionOutput:
    """One completion as it stands.

    Attributes:
        index: completion number, ``0 .. n-1``.
        text: the generated text. While running, only the part that can no longer change
            (held back: a possible start of a stop string, an incomplete UTF-8 character).
        token_ids: generated token ids (a stop token included; tokens past a stop string too).
        finish_reason: ``"stop"`` (eos, a stop token or string), ``"length"`` (``max_tokens``),
            ``"abort"``, or ``None`` while running.
        logprobs: per generated token, when the request asked for them.
        cumulative_logprob: sum of the tokens' log-probs; for beam search, the hypothesis score.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.perf_counter`` seconds) of a request's life."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)  # completion 0's token times

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step: every completion so far, and whether it is done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprob | None] | None = None   # when the request asked (the first is None)


class Request:
    """A prompt, its parameters, and its sequences (see the module docstring)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_index: int, seed: int, eos_token_ids: tuple[int, ...]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_index = arrival_index  # FCFS order; preemption takes the largest first
        self.seed = seed                    # completion i samples with a generator seeded seed + i
        self.stop_token_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                                 else frozenset(eos_token_ids))
        # One sequence drawing from the raw logits, nothing read back but its token (no n > 1,
        # beams, logit processing or logprobs): the engine's fast paths (overlapped decode, the
        # one-token-per-request sampling step). Fixed for the request's life.
        self.plain = (params.n == 1 and not params.beam_search and not params.processes_logits
                      and params.logprobs is None and params.prompt_logprobs is None)
        # Its token is drawn inside the step by the on-device sampler (`LLMEngine._sampling_rows`).
        self.draws_in_step = not params.greedy and not params.beam_search and not params.processes_logits
        self.status = RequestStatus.WAITING
        self.seqs: list[Sequence] = []      # live sequences (for beam search: the live beams)
        self.done: dict[int, Sequence] = {}  # finished completions by index
        self.beams: BeamState | None = None
        self.beam_outputs: list[CompletionOutput] = []  # beam search's result, once done
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # params.prompt_logprobs: before the 1st token
        self.num_cached_tokens: int | None = None  # prompt tokens the prefix cache served (first admission)
        self.num_preemptions = 0
        self.metrics = RequestMetrics(arrival=time.perf_counter())

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def ready_to_sample(self) -> bool:
        """Every live sequence has all its tokens computed: the last step produced the logits
        of each one's next token."""
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, without a generator
            return seqs[0].num_uncomputed == 0
        return bool(seqs) and all(s.num_uncomputed == 0 for s in seqs)

    def output(self) -> RequestOutput:
        if self.params.beam_search:  # the hypotheses exist only once the search is over
            outputs = list(self.beam_outputs)
        else:
            seqs = sorted([*self.done.values(), *self.seqs], key=lambda s: s.index)
            outputs = [self._completion(s) for s in seqs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.finished,
                             self.num_cached_tokens or 0, self.metrics, prompt_logprobs=self.prompt_logprobs)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        det = seq.detokenizer
        det.update(seq.output_ids)
        return CompletionOutput(seq.index, det.text if seq.finish_reason else det.stable_text, list(seq.output_ids),
                                seq.finish_reason, list(seq.logprobs) if self.params.logprobs is not None else None,
                                seq.cumulative_logprob, seq.stop_reason)
