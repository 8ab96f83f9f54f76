"""Chapter 6: decoding several sequences of one prompt over a paged KV cache.

Both methods keep several continuations of one prompt alive at once, so both gain from
sharing KV blocks (`minillm.paged.BlockManager.fork`, copy-on-write): the prompt's K/V are
computed and stored once, whatever the number of continuations.

- `minillm.decoding.sampling`: parallel sampling, ``n`` independent completions of one prompt
  (`parallel_sample`, `SamplingParams`, `sample_token`).
- `minillm.decoding.beams`: beam search with Hugging Face transformers' semantics
  (`beam_search`, `BeamSearchParams`, `FinishedHypotheses`).

Chapter 10 adds `minillm.decoding.gpu_sampling`: a whole step's tokens drawn on the GPU from
per-row parameters (`SamplingTensors`), graph-capturable, with counter-based random numbers.

Each returns, with its tokens, a `minillm.decoding.sharing_trace.SharingTrace` of the blocks it held at
every forward step and the blocks the same sequences would have held without sharing: the
measurement of the chapter, taken on real decoding rather than the simulator.
"""
from minillm.decoding.beams import BeamSearchOutput, BeamSearchParams, FinishedHypotheses, beam_search
from minillm.decoding.gpu_sampling import SamplingTensors
from minillm.decoding.sampling import (
    Completion, ParallelSampler, SamplingOutput, SamplingParams, parallel_sample, sample_token,
)

__all__ = [
    "BeamSearchOutput", "BeamSearchParams", "Completion", "FinishedHypotheses", "ParallelSampler", "SamplingOutput",
    "SamplingParams", "SamplingTensors", "beam_search", "parallel_sample", "sample_token",
]
