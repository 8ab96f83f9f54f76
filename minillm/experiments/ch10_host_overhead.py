"""Chapter 10: the engine's host time per decode step, with the model taken out.

An engine's decode step is host work (schedule, take slots, build the step's batch, sample,
check the stop conditions) around the GPU's forward pass. Here the engine runs on a CPU over a
1-layer random Llama (`minillm.testing.tiny_llama`) whose runner is replaced by `FreeRunner`,
which returns a fixed logits tensor and its argmax without running any model: what remains of
`LLMEngine._step` is the host's work. The tokens come "from the device" as in a CUDA step
(`LLMEngine.sample_on_device`), so the sampling path is the one a GPU step takes.
``bench/ch10_host_overhead.py`` turns this into benchmark rows; Chapter 10's notebook runs it
at a small size.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time

import torch

NUM_SEQS = 64
PROMPT_LEN = 256
STEPS = 200
MODES = ("paged", "virtual")


class FreeRunner:
    """A stand-in for `minillm.engine.model_runner.ModelRunner` that runs no model: every step
    returns the first ``batch_size`` rows of one fixed logits tensor ``[max_seqs, vocab]``
    (float32, random, fixed seed) and, for `forward_and_sample`, their argmax (int64)."""

    def __init__(self, max_seqs: int, vocab_size: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(max_seqs, vocab_size, generator=gen)
        self.argmax = self.logits.argmax(-1)
        self.num_replays, self.num_eager = 0, 0

    def forward(self, batch) -> torch.Tensor:
        self.num_eager += 1
        return self.logits[:batch.batch_size]

    def forward_and_sample(self, batch, sampling) -> tuple[torch.Tensor, torch.Tensor]:
        if sampling is not None:
            raise ValueError("FreeRunner serves greedy steps only")
        self.num_eager += 1
        return self.logits[:batch.batch_size], self.argmax[:batch.batch_size]

    def describe(self) -> str:
        return "free (no model)"


def build_engine(kv_cache: str, num_seqs: int = NUM_SEQS, max_len: int = 2048, record_steps: bool = True):
    """An `LLMEngine` on the CPU over a 1-layer tiny Llama whose runner is a `FreeRunner`, with
    room for ``num_seqs`` sequences of ``max_len`` tokens in either KV-cache mode."""
    from minillm.cli import BUNDLED_MODEL
    from minillm.engine import EngineConfig, LLMEngine
    from minillm.model import load_tokenizer
    from minillm.paged import blocks_for
    from minillm.testing import tiny_llama

    tokenizer, _ = load_tokenizer(BUNDLED_MODEL)   # the Detokenizer of each request needs one
    model = tiny_llama(layers=1, vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=max_len)
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_blocks=num_seqs * blocks_for(max_len, 16),
                          max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs), max_model_len=max_len,
                          max_n=1, cuda_graphs="off", fused_decode="off", attention_backend="torch",
                          kv_cache=kv_cache, seed=0, record_steps=record_steps)
    engine = LLMEngine(model, tokenizer, config)
    engine.runner = FreeRunner(num_seqs, model.config.vocab_size)
    engine.sample_on_device = True   # the tokens come with the logits, as from a CUDA graph
    return engine


def start_decoding(engine, num_seqs: int = NUM_SEQS, prompt_len: int = PROMPT_LEN, max_tokens: int = 1024,
                   seed: int = 0) -> None:
    """Admit ``num_seqs`` greedy requests of ``prompt_len`` random tokens and step until every
    one has its first token (all prefilled: the next steps are pure decode steps)."""
    from minillm.decoding.sampling import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(num_seqs):
        engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params)
    while engine.scheduler.waiting or any(not r.seqs[0].output_ids for r in engine.scheduler.running):
        engine._step()


def decoding_engine(kv_cache: str, num_seqs: int, prompt_len: int, steps: int):
    """A `build_engine` engine whose ``num_seqs`` requests are all prefilled (`start_decoding`)
    and can each decode ``steps`` more tokens without finishing."""
    prefill_steps = -(-num_seqs * prompt_len // 2048) + 1   # the earliest requests decode meanwhile
    max_tokens = steps + prefill_steps + 8
    engine = build_engine(kv_cache, num_seqs, max_len=prompt_len + max_tokens)
    start_decoding(engine, num_seqs, prompt_len, max_tokens=max_tokens)
    return engine


def time_steps(engine, steps: int = STEPS) -> list[float]:
    """Wall seconds of each of ``steps`` engine steps (`LLMEngine._step`)."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine._step()
        times.append(time.perf_counter() - t)
    return times


def host_step_ms(kv_cache: str, num_seqs: int = NUM_SEQS, prompt_len: int = PROMPT_LEN, steps: int = STEPS,
                 warmup: int = 10) -> float:
    """Median wall milliseconds of one pure decode step of ``num_seqs`` sequences (the host's
    work alone: `FreeRunner`), after ``warmup`` untimed steps."""
    engine = decoding_engine(kv_cache, num_seqs, prompt_len, warmup + steps)
    time_steps(engine, warmup)
    times = time_steps(engine, steps)
    if len(engine.scheduler.running) != num_seqs:
        raise RuntimeError(f"{len(engine.scheduler.running)} sequences ran, not {num_seqs}: the steps were not all "
                           "full decode steps")
    return 1e3 * statistics.median(times)


def profile_steps(kv_cache: str, num_seqs: int = NUM_SEQS, prompt_len: int = PROMPT_LEN, steps: int = 20,
                  top: int = 20) -> str:
    """cProfile's top ``top`` functions (by own time) over ``steps`` pure decode steps."""
    engine = decoding_engine(kv_cache, num_seqs, prompt_len, 5 + steps)
    time_steps(engine, 5)
    profile = cProfile.Profile()
    profile.enable()
    time_steps(engine, steps)
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()
