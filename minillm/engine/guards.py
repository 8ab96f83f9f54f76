"""Chapter 9: the request values that would break a step, caught before the request runs.

A continuous batch samples every request in one step, so a value that makes sampling raise
(a temperature so small that ``logits / temperature`` overflows to ``inf`` and the softmax to
``nan``, a ``top_p`` that rounds to 0 in float32 and drops every token, a beam width that needs
more candidates than the vocabulary has) would end the step for everyone in it. Two defences:

- **Normalise** what has a sensible meaning: a temperature below ``SAMPLING_EPS`` is greedy
  (vLLM's rule; such a temperature already puts all the mass on the argmax), a ``top_p``
  below it keeps only the most likely token, which is what it means, and a
  ``repetition_penalty`` below it (a positive logit divided by ``1e-300`` is ``inf``) acts as
  ``SAMPLING_EPS``, which already makes a seen token with a positive logit all but certain.
- **Refuse**, with `InvalidRequest` (HTTP 400), what has none: non-finite floats, seeds outside
  a 64-bit generator's range, more stop strings or stop token ids than a step can check cheaply,
  stop token ids outside the vocabulary, a beam search whose candidates outnumber the vocabulary.

`LLMEngine.add_request` applies both; the server's request models apply the same ranges first
(`minillm.server.protocol`). The engine still ends a request alone if its step raises anyway
(`LLMEngine._fail`).
"""
from __future__ import annotations

import dataclasses
import math
import numbers

from minillm.decoding.sampling import SamplingParams
from minillm.engine.config import InvalidRequest

__all__ = ["MAX_STOP_STRING_CHARS", "MAX_STOP_STRINGS", "MAX_STOP_TOKEN_IDS", "SAMPLING_EPS", "check_limits",
           "normalise_params"]

SAMPLING_EPS = 1e-5             # temperatures and top_p below it are normalised (vLLM's _SAMPLING_EPS)
MAX_STOP_STRINGS = 64           # every step searches the new text for each
MAX_STOP_STRING_CHARS = 1024    # a stream holds back len(longest stop) - 1 characters
MAX_STOP_TOKEN_IDS = 1024
MAX_SEED = 2**63 - 1            # completion i seeds a 64-bit generator with seed + i


def normalise_params(params: SamplingParams) -> SamplingParams:
    """``params`` with a tiny temperature made greedy and a tiny ``top_p`` raised to
    ``SAMPLING_EPS`` (both mean "the most likely token"; see the module docstring)."""
    changes = {}
    if 0 < params.temperature < SAMPLING_EPS:
        changes["temperature"] = 0.0
    if params.top_p < SAMPLING_EPS:
        changes["top_p"] = SAMPLING_EPS
    if 0 < getattr(params, "repetition_penalty", 1.0) < SAMPLING_EPS:
        changes["repetition_penalty"] = SAMPLING_EPS
    return dataclasses.replace(params, **changes) if changes else params


def check_limits(params: SamplingParams, vocab_size: int, num_eos_ids: int = 1) -> None:
    """Raise `InvalidRequest` for a value no step could run (see the module docstring)."""
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and not math.isfinite(value):
            raise InvalidRequest(f"{f.name} must be a finite number, got {value}", param=f.name)
    seed = params.seed
    if seed is not None and not (isinstance(seed, numbers.Integral) and 0 <= seed <= MAX_SEED - params.n):
        raise InvalidRequest(f"seed must be an integer in [0, {MAX_SEED - params.n}], got {seed!r}", param="seed")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}", param="stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in params.stop):
        raise InvalidRequest(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters", param="stop")
    ids = params.stop_token_ids
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(ids)}", param="stop_token_ids")
    if not all(isinstance(t, numbers.Integral) and 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"stop token ids must lie in [0, {vocab_size})", param="stop_token_ids")
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise InvalidRequest(f"logprobs must be at most the vocabulary's size, {vocab_size}", param="logprobs")
    if params.beam_search:  # each step keeps max(2, 1 + number of eos ids) * width candidates
        candidates = max(2, 1 + len(set(ids)) + (0 if params.ignore_eos else num_eos_ids)) * params.num_beams
        if candidates > vocab_size:
            raise InvalidRequest(f"beam search of width {params.num_beams} with {len(set(ids))} stop token ids "
                                 f"needs {candidates} candidates a step, more than the vocabulary's "
                                 f"{vocab_size} tokens: use fewer stop token ids", param="stop_token_ids")
