"""Beam search over a paged KV cache, with Hugging Face transformers' semantics.

Beam search keeps the ``k`` (``num_beams``) most likely partial continuations of a prompt.
Each step, every live beam proposes every next token; among all ``k · vocab`` candidates,
scored by their total log-probability, the best survive. A beam that is chosen several times
splits into several beams, and a beam that is not chosen dies. Over a paged cache both are
cheap: a split is a `BlockManager.fork` (the children share every block; only the partly
filled last block is copied, when a child writes into it), a death is a `BlockManager.free`.
Most of the ``k`` beams' history is therefore stored once.

The search itself follows transformers' ``generate(num_beams=k, do_sample=False)`` (its
``_beam_search``, v4.50+ / v5), which we match token for token and score for score:

1. **Candidates.** Each step takes the top ``K = max(2, 1 + number of eos ids) · k`` candidates
   by cumulative log-probability (log-softmax of float32 logits, summed in float32). ``K`` is
   more than ``k`` so that at least ``k`` of them do not end in an eos token.
2. **Finishing.** A candidate *finishes* when its token is an eos id or it reaches
   ``max_new_tokens``. Only finished candidates ranked among the top ``k`` of the ``K`` are
   kept, as hypotheses scored ``sum of log-probs / generated_len ** length_penalty``, where
   ``generated_len`` counts the new tokens, the eos included, **not** the prompt. At most ``k``
   hypotheses are kept, the best.
3. **Continuing.** The ``k`` best candidates that did not finish are the next step's beams.
4. **Stopping** (besides ``max_new_tokens``), by ``early_stopping``:

   - ``True``: as soon as ``k`` hypotheses are kept.
   - ``False`` (the default): when the best live beam, scored with its *current* length,
     ``best_sum / cur_len ** length_penalty``, is no better than the worst kept hypothesis
     (once ``k`` are kept). A heuristic: with ``length_penalty > 0`` a longer beam could
     still score better.
   - ``"never"``: the same test, but with ``length_penalty > 0`` the best live beam is scored
     with the longest length it could reach, ``max_new_tokens``: the exact bound, so the
     search stops only when no live beam can improve the result.

5. **Result.** The ``num_return_sequences`` best hypotheses, best first.

Where this departs from "textbook" beam search, it is transformers' choice, kept so that the
oracle test can compare: the length of the prompt is not part of the length penalty, eos
candidates outside the top ``k`` are dropped rather than kept, and ``early_stopping=False``
stops on a heuristic that can be wrong for ``length_penalty > 0``.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minillm.decoding.sampling import KVPool
from minillm.model.paged import PagedKVCache
from minillm.paged import BlockManager
from minillm.decoding.sharing_trace import SharingTrace

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamState", "FinishedHypotheses", "Hypothesis", "beam_search",
           "reassign_beams", "search_is_over", "top_candidates"]


@dataclass(frozen=True)
class BeamSearchParams:
    """The knobs of transformers' beam search, with its defaults.

    Attributes:
        num_beams: ``k``, the beams kept each step (and hypotheses kept in the end).
        max_new_tokens: the longest continuation.
        length_penalty: hypotheses score ``sum_logprob / generated_len ** length_penalty``;
            ``> 0`` favours longer ones, ``< 0`` shorter ones, ``0`` compares sums.
        early_stopping: ``True``, ``False`` or ``"never"`` (see the module docstring).
        num_return_sequences: hypotheses returned, ``<= num_beams``.
        eos_token_ids: tokens that finish a beam.
    """

    num_beams: int = 4
    max_new_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_beams < 1 or self.max_new_tokens < 1:
            raise ValueError(f"num_beams ({self.num_beams}) and max_new_tokens ({self.max_new_tokens}) must be >= 1")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if not 1 <= self.num_return_sequences <= self.num_beams:
            raise ValueError(f"num_return_sequences must lie in [1, num_beams={self.num_beams}], "
                             f"got {self.num_return_sequences}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def num_candidates(self) -> int:
        """``K``: candidates kept per step, enough that ``num_beams`` of them do not end in eos."""
        return max(2, 1 + len(self.eos_token_ids)) * self.num_beams


@dataclass(frozen=True)
class Hypothesis:
    """A finished continuation: its new tokens (the eos included, if it ended on one) and
    its score, ``sum_logprob / len(token_ids) ** length_penalty`` (a float32 value)."""

    token_ids: tuple[int, ...]
    score: float


class FinishedHypotheses:
    """The best ``num_beams`` finished hypotheses so far (transformers' ``BeamHypotheses``).

    Scores are computed in float32 as transformers does, and stored as the Python floats of
    those float32 values, so comparing them compares float32 numbers.
    """

    def __init__(self, num_beams: int, length_penalty: float):
        self.num_beams = num_beams
        self.length_penalty = length_penalty
        self._hyps: list[Hypothesis] = []  # best first

    def __len__(self) -> int:
        return len(self._hyps)

    @property
    def is_full(self) -> bool:
        return len(self._hyps) == self.num_beams

    @property
    def worst_score(self) -> float:
        return self._hyps[-1].score

    def score(self, sum_logprob: torch.Tensor, length: int) -> float:
        """``sum_logprob`` (a float32 scalar tensor) over ``length ** length_penalty``, in float32.

        Any ``length_penalty`` is safe: a power too large for a float (``20 ** 400``) counts
        as infinite (the score is then ``-0.0``), one that underflows to 0 gives ``-inf``, and
        the one undefined case, ``0 / 0``, scores 0."""
        try:
            denominator = length ** self.length_penalty
        except OverflowError:
            denominator = math.inf
        score = float(sum_logprob / denominator)
        return 0.0 if math.isnan(score) else score

    def add(self, token_ids: Sequence[int], sum_logprob: torch.Tensor) -> None:
        """Keep ``token_ids`` if it is among the ``num_beams`` best (dropping the worst if full)."""
        hyp = Hypothesis(tuple(token_ids), self.score(sum_logprob, len(token_ids)))
        # Insert after every hypothesis at least as good: among equals, the older stays ahead.
        at = bisect.bisect_right([-h.score for h in self._hyps], -hyp.score)
        self._hyps.insert(at, hyp)
        del self._hyps[self.num_beams:]

    def best(self, n: int) -> list[Hypothesis]:
        return self._hyps[:n]


@dataclass(frozen=True)
class BeamSearchOutput:
    """The ``num_return_sequences`` best hypotheses, best first, and the block usage.

    Attributes:
        prompt: the prompt's token ids.
        hypotheses: each with its new tokens and score.
        trace: blocks the beams held at every forward step, with and without sharing.
    """

    prompt: tuple[int, ...]
    hypotheses: list[Hypothesis]
    trace: SharingTrace

    @property
    def sequences(self) -> list[list[int]]:
        """Prompt + new tokens of each hypothesis."""
        return [list(self.prompt) + list(h.token_ids) for h in self.hypotheses]

    @property
    def scores(self) -> list[float]:
        return [h.score for h in self.hypotheses]

    def padded(self, pad_token_id: int) -> torch.Tensor:
        """``sequences`` as one int64 tensor ``[num_return_sequences, prompt + longest]``, the
        shorter ones padded with ``pad_token_id`` (transformers pads with ``pad_token_id``, or
        with the first eos id when ``pad_token_id`` is unset or 0)."""
        width = max(len(s) for s in self.sequences)
        return torch.tensor([s + [pad_token_id] * (width - len(s)) for s in self.sequences], dtype=torch.int64)


@dataclass
class _Candidates:
    """The step's top ``K`` candidates, best first: parent beam, token, summed log-prob."""

    parents: list[int]
    tokens: list[int]
    sum_logprobs: torch.Tensor  # [K] float32


class BeamState:
    """One beam search between steps, whatever runs the model: the live beams' new tokens and
    summed log-probs, and the finished hypotheses. `beam_search` drives it over a private
    pool; the engine (`minillm.engine`) drives it inside a continuous batch.

    Attributes:
        token_ids: each live beam's new tokens (the last is the one to feed next).
        sum_logprobs: ``[live]`` float32, each live beam's summed log-prob.
        done: the search is over; `result` holds the hypotheses.
    """

    def __init__(self, params: BeamSearchParams, vocab_size: int):
        if vocab_size < params.num_candidates:
            raise ValueError(f"a vocabulary of {vocab_size} tokens has fewer than the {params.num_candidates} "
                             "candidates a step keeps")
        self.params = params
        self.finished = FinishedHypotheses(params.num_beams, params.length_penalty)
        self.token_ids: list[tuple[int, ...]] = [()]  # step 0: the prompt is the one beam
        self.sum_logprobs = torch.zeros(1)
        self.steps = 0
        self.done = False

    def advance(self, logprobs: torch.Tensor) -> list[int]:
        """One step from the live beams' next-token ``logprobs [live, vocab]``.

        Returns the parent of each new live beam (an index into the previous beams; its new
        token is the last of ``token_ids[i]``), or ``[]`` once the search is over.
        """
        p = self.params
        cands = top_candidates(self.sum_logprobs, logprobs.float().cpu(), p.num_candidates)
        self.steps += 1
        at_max_length = self.steps == p.max_new_tokens  # then every candidate finishes
        ends = [at_max_length or t in p.eos_token_ids for t in cands.tokens]
        # Finished candidates count only among the top k: the K - k extra ones only stand by in
        # case eos ends some of the top k.
        for rank in range(p.num_beams):
            if ends[rank]:
                self.finished.add(self.token_ids[cands.parents[rank]] + (cands.tokens[rank],),
                                  cands.sum_logprobs[rank])
        go_on = [r for r, end in enumerate(ends) if not end][:p.num_beams]  # k of them, unless at the end
        if at_max_length or search_is_over(self.finished, cands.sum_logprobs[go_on[0]], self.steps, p):
            self.done = True
            return []
        parents = [cands.parents[r] for r in go_on]
        self.token_ids = [self.token_ids[cands.parents[r]] + (cands.tokens[r],) for r in go_on]
        self.sum_logprobs = cands.sum_logprobs[go_on]
        return parents

    def result(self) -> list[Hypothesis]:
        """The ``num_return_sequences`` best hypotheses, best first."""
        return self.finished.best(self.params.num_return_sequences)


def reassign_beams(manager: BlockManager, seq_ids: list, parents: list[int], new_seq_id) -> list:
    """Give the new beams their block-manager sequences: a parent's first child takes over
    the parent's sequence, every further child forks it (sharing all its blocks; the partly
    filled last block is copied when the child writes), and parents nobody chose are freed.
    ``new_seq_id()`` names a fork. Returns the new beams' sequence ids."""
    children, taken = [], set()
    for parent in parents:
        if parent in taken:
            child = new_seq_id()
            manager.fork(seq_ids[parent], child)
        else:
            child = seq_ids[parent]
            taken.add(parent)
        children.append(child)
    for p, seq_id in enumerate(seq_ids):
        if p not in taken:
            manager.free(seq_id)
    return children


def beam_search(model, prompt: Sequence[int], params: BeamSearchParams, *, block_size: int = 16,
                manager: BlockManager | None = None, cache: PagedKVCache | None = None) -> BeamSearchOutput:
    """Beam search from ``prompt`` over a paged KV cache (see the module docstring).

    Args:
        model: a `LlamaForCausalLM`.
        prompt: token ids.
        params: the search's settings.
        block_size: tokens per block of a private pool (ignored when ``manager`` is given).
        manager, cache: an existing pool to run in (both, or neither). Every block the search
            takes is freed before it returns, even on an error.
    """
    state = BeamState(params, model.config.vocab_size)
    pool = KVPool.create(model, params.num_beams, len(prompt) + params.max_new_tokens, block_size, manager, cache)
    try:
        seq_ids = [pool.new_seq_id()]
        logits = pool.prefill(seq_ids[0], prompt)[None]                               # [live, vocab]
        while parents := state.advance(torch.log_softmax(logits, dim=-1)):
            seq_ids = reassign_beams(pool.manager, seq_ids, parents, pool.new_seq_id)
            logits = pool.decode(seq_ids, [t[-1] for t in state.token_ids])
    finally:
        pool.release()  # every live beam's blocks, even after an error
    return BeamSearchOutput(tuple(prompt), state.result(), pool.trace())


def top_candidates(sum_logprobs: torch.Tensor, logprobs: torch.Tensor, k: int) -> _Candidates:
    """The ``k`` best of all ``live · vocab`` one-token extensions of the live beams, ranked by
    ``sum_logprobs [live] + logprobs [live, vocab]`` (float32, as transformers adds them)."""
    vocab = logprobs.shape[1]
    totals = (logprobs + sum_logprobs[:, None]).flatten()
    best, index = totals.topk(k)
    return _Candidates((index // vocab).tolist(), (index % vocab).tolist(), best)


def search_is_over(finished: FinishedHypotheses, best_live_sum: torch.Tensor, cur_len: int,
                    params: BeamSearchParams) -> bool:
    """Whether no live beam (the best of which has summed ``best_live_sum`` over ``cur_len``
    new tokens) can improve the kept hypotheses, by ``params.early_stopping``'s rule."""
    if not finished.is_full:
        return False
    if params.early_stopping is True:
        return True
    if params.early_stopping == "never" and params.length_penalty > 0:
        best_length = params.max_new_tokens  # the longest a live beam can get: an exact bound
    else:
        best_length = cur_len                # its current length: transformers' heuristic
    return not finished.score(best_live_sum, best_length) > finished.worst_score
