"""Chapter 6's measurements: prefix caching on a shared-system-prompt workload, and the memory
that block sharing saves for parallel sampling and beam search, on a real model.

**The workload.** Many chat requests start with the same system prompt: ``S`` tokens shared
by ``R`` requests, each followed by its own user suffix (`PrefixWorkload`). Without prefix
caching every request computes and stores the K/V of the whole prompt. With it
(`minillm.paged.BlockManager` with ``enable_prefix_caching=True``), a later request finds the
system prompt's *full* blocks in the cache, references them, and computes only the rest.

`run_prefix_workload` sends the requests through a `BlockManager` and the model's paged
forward (`LlamaForCausalLM.forward_paged`), either one request per forward pass, in arrival
order (``one_step=False``), or all in one batch (``one_step=True``, where the first request's
blocks are hit by the others *in the same step*). Every request stays live until the end,
as in a server batch, so the blocks held at the end are the memory the batch needs. It
returns, per request, the prompt tokens found in the cache, the tokens the prefill computed,
and the prefill's wall time (``time.perf_counter`` around the forward pass), plus the blocks
held and the last-token logits (identical with and without caching, up to float rounding).

**Timings are CPU timings.** The model runs where it lives, normally the CPU in float32 in
the book. The prefill time saved there says how much *work* caching removes; on a GPU, short
prefills are dominated by fixed per-step costs and the saving in time is smaller than the
saving in tokens. `compare_prefix_caching` runs caching off and on alternately a few times and
keeps each request's fastest run, which is the usual way to measure on a shared, noisy machine.

**Decoders.** `decoder_sharing` runs ``n`` parallel samples and a beam search of width ``k``
(`minillm.decoding.parallel_sample`, `minillm.decoding.beam_search`) on one prompt, and reads
from their traces the blocks they held at every step with fork-sharing and what the same
sequences would have held alone.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from minillm.decoding.beams import BeamSearchOutput, BeamSearchParams, beam_search
from minillm.decoding.sampling import SamplingOutput, SamplingParams, parallel_sample
from minillm.model.paged import PagedBatch
from minillm.paged import BlockManager, blocks_for
from minillm.experiments.ch06_sharing import SharingTrace

__all__ = ["DecoderSharing", "PrefixComparison", "PrefixWorkload", "RequestStats", "WorkloadRun",
           "compare_prefix_caching", "decoder_sharing", "run_prefix_workload", "shakespeare_workload"]


# == the workload ===============================================================================

@dataclass(frozen=True)
class PrefixWorkload:
    """``R`` requests sharing a system prompt: request ``i`` is ``system + suffixes[i]``.

    Attributes:
        system: the shared system prompt's token ids (``S`` tokens).
        suffixes: each request's own tokens (its user message), at least one token each.
    """

    system: tuple[int, ...]
    suffixes: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        object.__setattr__(self, "system", tuple(int(t) for t in self.system))
        object.__setattr__(self, "suffixes", tuple(tuple(int(t) for t in s) for s in self.suffixes))
        if not self.suffixes or min(len(s) for s in self.suffixes) < 1:
            raise ValueError("a workload needs at least one request, and every suffix at least one token")

    @property
    def num_requests(self) -> int:
        return len(self.suffixes)

    @property
    def prompts(self) -> list[list[int]]:
        """Each request's whole prompt, system prompt first."""
        return [list(self.system) + list(s) for s in self.suffixes]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of all requests together."""
        return sum(len(p) for p in self.prompts)

    @classmethod
    def random(cls, system_len: int, num_requests: int, suffix_len: int, vocab_size: int, seed: int = 0,
               low: int = 1) -> PrefixWorkload:
        """Random token ids in ``[low, vocab_size)`` (``low = 1`` keeps clear of id 0, often a
        special token). The suffixes start with distinct tokens (when the vocabulary allows), so
        no two requests share more than the system prompt."""
        rng = np.random.default_rng(seed)
        system = rng.integers(low, vocab_size, system_len)
        suffixes = rng.integers(low, vocab_size, (num_requests, suffix_len))
        if vocab_size - low >= num_requests:
            suffixes[:, 0] = rng.choice(np.arange(low, vocab_size), num_requests, replace=False)
        return cls(tuple(system.tolist()), tuple(map(tuple, suffixes.tolist())))

    def expected_cached_tokens(self, block_size: int) -> list[int]:
        """The prompt tokens a prefix cache serves to each request, if it still holds every block
        of the earlier requests (a pool large enough that nothing is evicted).

        Request ``i`` hits the full blocks of its longest common prefix with any earlier request,
        but never the block holding its last token: at least one token is always computed, to
        produce the logits of the next one. So it gets ``min(lcp // bs, (len - 1) // bs) * bs``
        tokens; for random suffixes that is ``min(S // bs, (len - 1) // bs) * bs`` for every
        request but the first.
        """
        prompts, out = self.prompts, []
        for i, p in enumerate(prompts):
            lcp = max((_common_prefix(p, q) for q in prompts[:i]), default=0)
            out.append(min(lcp // block_size, (len(p) - 1) // block_size) * block_size)
        return out

    def expected_hit_rate(self, block_size: int) -> float:
        """``sum(expected_cached_tokens) / prompt_tokens``: for ``R`` requests with random suffixes
        of ``U`` tokens, ``(R - 1) · ⌊S / bs⌋ · bs / (R · (S + U))``."""
        return sum(self.expected_cached_tokens(block_size)) / self.prompt_tokens


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shakespeare_workload(tokenizer, system_len: int = 256, num_requests: int = 8, suffix_len: int = 32,
                         seed: int = 0) -> PrefixWorkload:
    """A workload cut from the Shakespeare excerpt shipped with the repository
    (`minillm.corpus.SAMPLE`), tokenized with ``tokenizer`` (a ``tokenizers.Tokenizer``).

    The "system prompt" is the excerpt's first ``system_len`` tokens; each "user message" is
    ``suffix_len`` tokens starting at the beginning of a random non-empty line later in the
    text (distinct lines, drawn with ``seed``).
    """
    from minillm.corpus import SAMPLE

    text = SAMPLE.read_text(encoding="utf-8")
    enc = tokenizer.encode(text)
    ids, offsets = enc.ids, enc.offsets
    if len(ids) < system_len + 2 * suffix_len:
        raise ValueError(f"the excerpt has {len(ids)} tokens, too few for system_len={system_len}")
    # Token indices that begin a line, past the system prompt and with room for a whole suffix.
    starts = [i for i in range(system_len, len(ids) - suffix_len)
              if offsets[i][0] > 0 and text[offsets[i][0] - 1] == "\n" and not text[offsets[i][0]].isspace()]
    rng = np.random.default_rng(seed)
    picked = sorted(rng.choice(len(starts), num_requests, replace=False).tolist())
    suffixes = [ids[starts[j]:starts[j] + suffix_len] for j in picked]
    return PrefixWorkload(tuple(ids[:system_len]), tuple(map(tuple, suffixes)))


# == running it =================================================================================

@dataclass(frozen=True)
class RequestStats:
    """One request of a `WorkloadRun`.

    Attributes:
        prompt_tokens: its prompt length.
        cached_tokens: prompt tokens found in the prefix cache (their K/V were not computed).
        computed_tokens: ``prompt_tokens - cached_tokens``, what its prefill ran.
        seconds: wall time of its prefill forward pass (``nan`` in one-step mode, where all
            requests share one forward pass).
        blocks_held: blocks referenced by all the requests admitted so far, this one included.
    """

    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    seconds: float
    blocks_held: int


@dataclass(frozen=True)
class WorkloadRun:
    """The result of `run_prefix_workload`.

    Attributes:
        prefix_caching: whether the manager cached prefixes.
        block_size: tokens per block.
        one_step: whether all requests were prefilled in one forward pass.
        requests: per request, in arrival order.
        prefill_seconds: wall time of all prefill forward passes together.
        blocks_held: blocks referenced once every request was admitted (all are live then).
        peak_blocks: the most blocks referenced at any point, decoding included.
        block_bytes: bytes one block stands for (every layer's K and V).
        logits: ``[R, vocab]`` float32 logits of each request's last prompt token.
        output_ids: the greedy tokens each request decoded (empty lists without decoding).
        device: where the model ran (the timings are for this device).
    """

    prefix_caching: bool
    block_size: int
    one_step: bool
    requests: list[RequestStats]
    prefill_seconds: float
    blocks_held: int
    peak_blocks: int
    block_bytes: int
    logits: torch.Tensor
    output_ids: list[list[int]]
    device: str

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.requests)

    @property
    def computed_tokens(self) -> int:
        """Prefill tokens actually run through the model."""
        return sum(r.computed_tokens for r in self.requests)

    @property
    def hit_rate(self) -> float:
        """Fraction of prompt tokens served from the prefix cache."""
        return self.cached_tokens / self.prompt_tokens

    @property
    def bytes_held(self) -> int:
        return self.blocks_held * self.block_bytes


def run_prefix_workload(model, workload: PrefixWorkload, *, block_size: int = 16, prefix_caching: bool = True,
                        one_step: bool = False, decode_tokens: int = 0, num_blocks: int | None = None
                        ) -> WorkloadRun:
    """Prefill every request of ``workload`` over a fresh paged pool, then (optionally) decode.

    Args:
        model: a `LlamaForCausalLM`; it runs on its own device and dtype.
        workload: the requests.
        block_size: tokens per block.
        prefix_caching: the `BlockManager`'s ``enable_prefix_caching``.
        one_step: prefill all requests in one batch (the first request's full blocks are
            registered at allocation, so the others hit them in the same step and no block is
            stored twice), instead of one forward pass per request in arrival order.
        decode_tokens: greedy tokens to decode afterwards, all requests in one batch per step
            (``0``: prefill only). The tokens land in ``output_ids``.
        num_blocks: pool size; by default room for every request unshared, so nothing is
            evicted and the cache holds every earlier block.
    """
    if decode_tokens < 0:
        raise ValueError(f"decode_tokens must be >= 0, got {decode_tokens}")
    prompts = workload.prompts
    if num_blocks is None:
        num_blocks = sum(blocks_for(len(p) + decode_tokens, block_size) for p in prompts)
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    cache = model.new_paged_cache(num_blocks, block_size)
    device = cache.pool.device
    ids = list(range(len(prompts)))
    stats: list[RequestStats] = []
    peak = 0

    def forward(seq_ids, counts):
        batch = PagedBatch.from_manager(manager, seq_ids, counts, device=device)
        _sync(device)
        start = time.perf_counter()
        logits = model.forward_paged(batch, cache, last_only=True)
        _sync(device)
        return logits.float(), time.perf_counter() - start

    with torch.inference_mode():
        if one_step:
            cached = []
            for i, p in zip(ids, prompts):
                cached.append(manager.allocate(i, p))
                stats.append(RequestStats(len(p), cached[-1], len(p) - cached[-1], math.nan, manager.num_used_blocks))
            logits, total = forward(ids, [len(p) - c for p, c in zip(prompts, cached)])
        else:
            rows, total = [], 0.0
            for i, p in zip(ids, prompts):
                c = manager.allocate(i, p)
                row, seconds = forward([i], len(p) - c)
                rows.append(row)
                total += seconds
                stats.append(RequestStats(len(p), c, len(p) - c, seconds, manager.num_used_blocks))
            logits = torch.cat(rows)
        held = peak = manager.num_used_blocks

        outputs: list[list[int]] = [[] for _ in ids]
        step_logits = logits
        for step in range(decode_tokens):
            tokens = step_logits.argmax(-1).tolist()
            for out, t in zip(outputs, tokens):
                out.append(int(t))
            if step + 1 == decode_tokens:
                break
            result = manager.append_slots(ids, tokens)
            cache.copy_blocks(result.copies)
            peak = max(peak, manager.num_used_blocks)
            batch = PagedBatch.from_manager(manager, ids, 1, device=device)
            step_logits = model.forward_paged(batch, cache, last_only=True).float()

    return WorkloadRun(prefix_caching, block_size, one_step, stats, total, held, peak, cache.block_bytes,
                       logits.cpu(), outputs, str(device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class PrefixComparison:
    """The same workload with prefix caching off and on (see `compare_prefix_caching`)."""

    off: WorkloadRun
    on: WorkloadRun

    @property
    def hit_rate(self) -> float:
        return self.on.hit_rate

    @property
    def tokens_saved(self) -> float:
        """Fraction of prefill tokens caching did not compute."""
        return 1 - self.on.computed_tokens / self.off.computed_tokens

    @property
    def time_saved(self) -> float:
        """Fraction of prefill wall time saved (on the device the model ran on)."""
        return 1 - self.on.prefill_seconds / self.off.prefill_seconds

    @property
    def memory_saved(self) -> float:
        """Fraction of KV blocks saved with every request live."""
        return 1 - self.on.blocks_held / self.off.blocks_held


def compare_prefix_caching(model, workload: PrefixWorkload, *, block_size: int = 16, repeats: int = 3,
                           one_step: bool = False, decode_tokens: int = 0) -> PrefixComparison:
    """Run ``workload`` with prefix caching off and on, alternately, ``repeats`` times each.

    Per request (or, with ``one_step``, per batch) the fastest of the ``repeats`` prefill times
    is kept: the first run pays one-time costs (memory allocation, lazy initialisation), and on
    a shared machine the other runs catch noise from other processes, both of which only ever
    add time. Tokens, blocks and logits do not depend on the repeat.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runs: dict[bool, list[WorkloadRun]] = {False: [], True: []}
    for _ in range(repeats):
        for caching in (False, True):
            runs[caching].append(run_prefix_workload(model, workload, block_size=block_size, prefix_caching=caching,
                                                     one_step=one_step, decode_tokens=decode_tokens))
    return PrefixComparison(_fastest(runs[False]), _fastest(runs[True]))


def _fastest(runs: list[WorkloadRun]) -> WorkloadRun:
    """The first run, with each request's time the minimum over all runs."""
    first = runs[0]
    if first.one_step:
        return dataclasses.replace(first, prefill_seconds=min(r.prefill_seconds for r in runs))
    requests = [dataclasses.replace(req, seconds=min(r.requests[i].seconds for r in runs))
                for i, req in enumerate(first.requests)]
    return dataclasses.replace(first, requests=requests, prefill_seconds=sum(r.seconds for r in requests))


# == parallel sampling and beam search ==========================================================

@dataclass(frozen=True)
class DecoderSharing:
    """``n`` parallel samples and a beam search of width ``k`` of one prompt, with their traces.

    Attributes:
        sampling: the parallel samples (``sampling.trace`` holds the blocks per step).
        beams: the beam search's result (``beams.trace``).
        n: the number of samples.
        beam_width: the beam search's ``k``.
        block_size: tokens per block.
        block_bytes: bytes one block stands for on this model (every layer's K and V).
    """

    sampling: SamplingOutput
    beams: BeamSearchOutput
    n: int
    beam_width: int
    block_size: int
    block_bytes: int

    def traces(self) -> dict[str, SharingTrace]:
        return {f"parallel sampling, n = {self.n}": self.sampling.trace,
                f"beam search, k = {self.beam_width}": self.beams.trace}

    def rows(self) -> list[dict]:
        """One summary per decoder: peak blocks with and without sharing, the time-averaged and
        peak savings, and the copy-on-write copies."""
        return [{"decoder": name, "steps": len(t.shared), "peak_shared": int(t.shared.max()),
                 "peak_unshared": int(t.unshared.max()), "saving": t.saving, "peak_saving": t.peak_saving,
                 "copies": t.copies, "peak_shared_bytes": int(t.shared.max()) * self.block_bytes,
                 "peak_unshared_bytes": int(t.unshared.max()) * self.block_bytes}
                for name, t in self.traces().items()]


def decoder_sharing(model, prompt: Sequence[int], *, n: int = 4, beam_width: int = 4, max_new_tokens: int = 32,
                    block_size: int = 16, temperature: float = 0.8, seed: int = 0,
                    eos_token_ids: Sequence[int] | None = None) -> DecoderSharing:
    """Decode ``prompt`` twice, over private pools with fork-sharing: ``n`` samples at
    ``temperature`` (each stops at an eos token or after ``max_new_tokens``), and a beam search
    of width ``beam_width`` (transformers' defaults otherwise: ``length_penalty = 1``,
    ``early_stopping = False``). ``eos_token_ids`` defaults to the model config's."""
    eos = tuple(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    sampling = parallel_sample(model, prompt, n, SamplingParams(temperature=temperature, max_tokens=max_new_tokens,
                                                                stop_token_ids=eos, seed=seed), block_size=block_size)
    beams = beam_search(model, prompt, BeamSearchParams(beam_width, max_new_tokens, num_return_sequences=beam_width,
                                                        eos_token_ids=eos), block_size=block_size)
    block_bytes = model.new_paged_cache(1, block_size).block_bytes
    return DecoderSharing(sampling, beams, n, beam_width, block_size, block_bytes)
