"""Chapter 9: what the engine does to a step's logits before it picks the next tokens.

One step's logits are a ``[rows, vocab]`` tensor, one row per sequence about to get a token,
each with its own request's `SamplingParams`. Before temperature and the draw (or the argmax),
each row goes through, in vLLM's order (its V1 sampler):

1. **logit bias**: ``logits[t] += bias`` for each ``{t: bias}`` of the request's ``logit_bias``;
2. **min_tokens**: while the sequence has fewer than ``min_tokens`` generated tokens, its stop
   token ids (end-of-sequence unless ``ignore_eos``, and ``stop_token_ids``) get ``-inf``;
3. **penalties** over the sequence's history:

   - repetition (``r``, CTRL's): every token in the prompt *or* the output so far has its logit
     divided by ``r`` if positive, multiplied by ``r`` if not (so ``r > 1`` always lowers it);
   - frequency (``f``, OpenAI's): ``logits[t] -= f * count(t in output)``;
   - presence (``p``, OpenAI's): ``logits[t] -= p * (t in output)``.

The token counts come from one ``scatter_add_`` over the padded histories of the penalized rows
(padding id = ``vocab``, an extra bin that is dropped), as vLLM's ``apply_penalties`` does: no
host loop over tokens, and the same code on a CPU and a GPU tensor. Rows whose request asks for
none of this are not touched (a batch of plain requests costs nothing here).

Then `minillm.decoding.sampling.sample_token` divides by the temperature and applies ``min_p``
(`minillm.decoding.sampling.min_p_filter`), top-k and top-p before the draw. The NumPy
reference of the whole pipeline is `minillm.reference.ch09_sampling`.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from minillm.decoding.sampling import SamplingParams

__all__ = ["apply_logits_processors", "apply_penalties", "token_counts"]


def token_counts(tokens: Sequence[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """``[rows, vocab]`` int32: how often each token occurs in each row's list (one
    ``scatter_add_`` over the lists padded with ``vocab_size``)."""
    width = max((len(t) for t in tokens), default=0)
    counts = torch.zeros(len(tokens), vocab_size + 1, dtype=torch.int32, device=device)
    if width:
        padded = torch.tensor([list(t) + [vocab_size] * (width - len(t)) for t in tokens], dtype=torch.int64,
                              device=device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """The three penalties on ``logits [rows, vocab]`` (in place; also returned), each a
    ``[rows]`` tensor of the rows' values."""
    vocab = logits.shape[-1]
    output_counts = token_counts(output_ids, vocab, logits.device)
    in_output = output_counts > 0
    seen = in_output | (token_counts(prompt_ids, vocab, logits.device) > 0)
    r = torch.where(seen, repetition.unsqueeze(1), torch.ones((), dtype=logits.dtype, device=logits.device))
    logits.copy_(torch.where(logits > 0, logits / r, logits * r))
    logits -= frequency.unsqueeze(1) * output_counts
    logits -= presence.unsqueeze(1) * in_output
    return logits


def apply_logits_processors(logits: torch.Tensor, params: Sequence[SamplingParams],
                            prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                            stop_token_ids: Sequence[Collection[int]]) -> torch.Tensor:
    """Logit bias, min_tokens and the penalties on a step's ``logits [rows, vocab]`` (float32,
    any device); row ``i`` belongs to a sequence with ``params[i]``, ``prompt_ids[i]``, the
    ``output_ids[i]`` generated so far and ``stop_token_ids[i]`` (what min_tokens masks).

    Returns the processed logits: ``logits`` itself when no row asks for anything, else a new
    tensor (the input is left as it is, for the raw log-probabilities).
    """
    active = [i for i, p in enumerate(params) if p.processes_logits]
    if not active:
        return logits
    logits = logits.clone()
    device = logits.device

    def put(rows: list[int], cols: list[int], values, accumulate: bool) -> None:
        if rows:
            index = torch.tensor([rows, cols], dtype=torch.int64, device=device)
            values = torch.as_tensor(values, dtype=logits.dtype).to(device).expand(len(rows))
            logits.index_put_((index[0], index[1]), values, accumulate=accumulate)

    # 1. logit bias
    rows, cols, bias = [], [], []
    for i in active:
        for token, value in (params[i].logit_bias or {}).items():
            rows.append(i), cols.append(token), bias.append(value)
    put(rows, cols, bias, accumulate=True)
    # 2. min_tokens: no stop token before min_tokens tokens
    rows, cols = [], []
    for i in active:
        if len(output_ids[i]) < params[i].min_tokens:
            for token in stop_token_ids[i]:
                rows.append(i), cols.append(token)
    put(rows, cols, -torch.inf, accumulate=False)
    # 3. penalties, on the penalized rows only
    penalized = [i for i in active if params[i].penalized]
    if penalized:
        index = torch.tensor(penalized, dtype=torch.int64, device=device)
        values = torch.tensor([[params[i].repetition_penalty, params[i].frequency_penalty,
                                params[i].presence_penalty] for i in penalized], dtype=logits.dtype).to(device)
        logits[index] = apply_penalties(logits[index], [prompt_ids[i] for i in penalized],
                                        [output_ids[i] for i in penalized], values[:, 0], values[:, 1], values[:, 2])
    return logits
