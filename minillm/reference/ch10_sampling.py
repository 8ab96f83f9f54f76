"""Chapter 10 reference: the draw at the end of the sampler, given its random numbers (NumPy).

`minillm.kernels.ch10_fused_decode.exponential_race` draws one token per row from its
probabilities with the *exponential race*: every token ``i`` gets an exponential clock
``E_i = -log U_i`` (``U_i`` uniform in ``(0, 1)``), scaled by ``1 / p_i``, and the first to ring
wins: ``argmin_i E_i / p_i = argmax_i p_i / E_i``. Since ``E_i / p_i`` is exponential with rate
``p_i`` and independent clocks race fairly, token ``i`` wins with probability ``p_i / sum p``
(Devroye 1986, ch. 9; Gumbel-max in log space: ``log p_i - log E_i`` is ``log p_i`` plus a
Gumbel variable). Unlike inversion (a cumulative sum and a search) it needs no prefix sum and
no normalisation, one pass over the row, and every token's number is its own.

The kernel makes its uniforms with Philox (`minillm.kernels.ch10_fused_decode.race_uniforms`
returns them); this reference takes them as input and gives the token the kernel must give.
The distribution the probabilities come from is `minillm.reference.ch09_sampling.next_token_probs`.
"""
from __future__ import annotations

import numpy as np

__all__ = ["exponential_race"]


def exponential_race(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """``probs, uniforms: [B, vocab]`` -> ``[B]`` int64: ``argmax_i p_i / (-log u_i)`` over the
    tokens with ``p_i > 0`` (the lowest id on a tie; 0 for a row with no such token). Float64."""
    p = np.asarray(probs, dtype=np.float64)
    e = -np.log(np.asarray(uniforms, dtype=np.float64))
    score = np.where(p > 0, p / e, -1.0)
    return np.argmax(score, axis=-1).astype(np.int64)   # np.argmax: the first maximum
