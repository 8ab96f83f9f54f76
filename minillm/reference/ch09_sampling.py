"""Chapter 9 reference: from one sequence's logits to the distribution its next token is drawn
from, with every sampling parameter the engine accepts (vLLM's semantics and order).

Slow and plain: one row, float64, a Python loop over the tokens that matter. The engine's
batched torch version is `minillm.decoding.logits_processors` (bias, min_tokens, penalties) and
`minillm.decoding.sampling.sample_token` (temperature, min-p, top-k, top-p); the tests check
them against this.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

import numpy as np

from minillm.decoding.sampling import SamplingParams

__all__ = ["next_token_probs", "process_logits", "softmax"]


def softmax(x: np.ndarray) -> np.ndarray:
    """``exp(x - max) / sum``; ``-inf`` entries get probability 0."""
    e = np.exp(x - x.max())
    return e / e.sum()


def process_logits(logits: np.ndarray, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams,
                   stop_token_ids: Collection[int] = ()) -> np.ndarray:
    """What happens to the logits before temperature (greedy takes the argmax of this).

    1. ``logit_bias``: add each bias to its token's logit.
    2. ``min_tokens``: while fewer than ``min_tokens`` tokens were generated, every stop token
       (``stop_token_ids``: end-of-sequence and the request's stop ids) gets ``-inf``.
    3. ``repetition_penalty`` ``r``: each distinct token of prompt + output: ``x / r`` if
       ``x > 0``, else ``x * r``.
    4. ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p``, over the output only: a token
       generated ``c > 0`` times loses ``f * c + p``.
    """
    x = np.asarray(logits, dtype=np.float64).copy()
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    if len(output_ids) < params.min_tokens:
        for token in stop_token_ids:
            x[token] = -np.inf
    r = params.repetition_penalty
    for token in set(prompt_ids) | set(output_ids):
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token, count in Counter(output_ids).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


def next_token_probs(logits: np.ndarray, prompt_ids: Sequence[int], output_ids: Sequence[int],
                     params: SamplingParams, stop_token_ids: Collection[int] = ()) -> np.ndarray:
    """The distribution ``[vocab]`` of the next token: one-hot on the argmax for greedy; else
    `process_logits`, then temperature, ``min_p`` (drop tokens less likely than ``min_p`` times
    the most likely one), ``top_k`` (drop tokens below the ``k``-th largest logit), ``top_p``
    (keep the most likely tokens, ties by token id, until the mass before the next one reaches
    ``top_p``), and the softmax of what is left."""
    x = process_logits(logits, prompt_ids, output_ids, params, stop_token_ids)
    if params.temperature == 0:
        probs = np.zeros_like(x)
        probs[int(np.argmax(x))] = 1.0
        return probs
    x = x / params.temperature
    if params.min_p > 0:
        p = softmax(x)
        x[p < params.min_p * p.max()] = -np.inf
    if 0 < params.top_k < len(x):
        kth = np.sort(x)[::-1][params.top_k - 1]
        x[x < kth] = -np.inf
    if params.top_p < 1:
        order = np.argsort(-x, kind="stable")
        p = softmax(x[order])
        before = np.cumsum(p) - p
        x[order[before >= params.top_p]] = -np.inf
    return softmax(x)
