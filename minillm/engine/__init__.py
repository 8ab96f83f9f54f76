"""Chapter 9: the minillm engine: continuous batching over the paged KV cache.

- `minillm.engine.llm`: ``LLM(path).generate(prompts, SamplingParams(...))``, the offline API.
- `minillm.engine.engine`: `LLMEngine` (``add_request`` / ``step`` / ``abort``), one step = one
  forward pass of the running batch.
- `minillm.engine.scheduler`: waiting and running queues, the token budget, chunked prefill,
  admission and preemption.
- `minillm.engine.request`: a request's sequences and what the engine returns.
- `minillm.engine.detokenizer`: incremental text and stop strings.
- `minillm.engine.config`: the knobs, the KV pool's size, the request errors.
- `minillm.engine.gemm_table`: Chapter 8's measured flat-GEMM dispatch tables, read per GPU.

The OpenAI-compatible server around it is `minillm.server`.
"""
from minillm.decoding.sampling import SamplingParams
from minillm.engine.config import ContextLengthExceeded, EngineConfig, InvalidRequest
from minillm.engine.engine import EngineStats, LLMEngine, StepRecord
from minillm.engine.llm import BUNDLED_MODEL, LLM
from minillm.engine.request import CompletionOutput, RequestOutput, TokenLogprob

__all__ = ["BUNDLED_MODEL", "LLM", "CompletionOutput", "ContextLengthExceeded", "EngineConfig", "EngineStats",
           "InvalidRequest", "LLMEngine", "RequestOutput", "SamplingParams", "StepRecord", "TokenLogprob"]
