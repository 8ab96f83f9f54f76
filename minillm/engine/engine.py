"""Chapter 9: the engine. One `LLMEngine.step` is one forward pass of a continuous batch.

A request travels: `LLMEngine.add_request` checks it and queues it; each `step` asks the
`Scheduler` for this step's tokens (taking KV blocks from the `BlockManager`, preempting if
the pool is short), performs the copy-on-write block copies, flattens the tokens into one
`PagedBatch` and runs the model over the paged cache (Triton kernels on a GPU, torch on a
CPU), then samples the next token of every request whose sequences are all computed (with the
fused path of Chapter 10, on the GPU at the end of the step: `minillm.decoding.gpu_sampling`),
checks the stop conditions, and returns what changed. The server (`minillm.server`) runs `step` in a
loop in a background thread; `LLM.generate` runs it until everything is done.

Overlapped decode (`LLMEngine.overlap_decode`, on by default on CUDA with graphs and on-device
sampling; ``EngineConfig(overlap_decode="off")`` turns it off): while every running request is a
plain decoding sequence, the next decode step is launched before this step's tokens reach the
host, with those tokens as its input taken on the device (`Scheduler.schedule_ahead`,
`BlockManager.append_pending`); the host then samples this step, checks the stops and prepares
the next while the GPU computes. A sequence that stopped has its extra token dropped. Each token
is computed as in the plain order (same inputs, same keys); only a step's batch may differ by the
rows of sequences that stopped just before it, which can pick another CUDA-graph bucket and so
move greedy choices at near-ties, as any change of batch can.
"""
from __future__ import annotations

import dataclasses
import itertools
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from minillm.costs import kv_block_bytes
from minillm.decoding.beams import BeamSearchParams, BeamState, reassign_beams
from minillm.decoding.gpu_sampling import SamplingTensors, sample as sample_on_device
from minillm.decoding.logits_processors import apply_logits_processors
from minillm.decoding.sampling import SamplingParams, completion_generator, sample_token
from minillm.engine.config import ContextLengthExceeded, EngineConfig, InvalidRequest
from minillm.engine.detokenizer import Detokenizer
from minillm.engine.guards import check_limits as _check_limits, normalise_params
from minillm.engine.model_runner import ModelRunner
from minillm.engine.request import CompletionOutput, Request, RequestOutput, Sequence as Seq, TokenLogprob
from minillm.engine.scheduler import Scheduler, SchedulerOutput
from minillm.model.fused import enable_fused_decode
from minillm.model.paged import PagedBatch
from minillm.paged import BlockManager, blocks_for

__all__ = ["EngineStats", "LLMEngine", "StepRecord"]


@dataclass(frozen=True)
class StepRecord:
    """What one step did (kept when ``EngineConfig.record_steps``): wall-clock start and end,
    the tokens each request computed, and the queues and the pool after it."""

    start: float
    end: float
    tokens: dict[str, int]       # request id -> tokens computed this step
    num_waiting: int
    num_running: int
    blocks_used: int
    kv_tokens: int               # tokens held in the cache by live sequences


@dataclass
class EngineStats:
    """Running totals for ``/metrics`` and the benchmarks."""

    steps: int = 0
    prompt_tokens: int = 0            # of the requests admitted so far (counted once, at admission)
    cached_prompt_tokens: int = 0     # of those, served by the prefix cache
    prompt_tokens_computed: int = 0   # prompt tokens run, recomputations after preemption included
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0          # ended by an error in their own sampling (`LLMEngine.failures`)
    overlapped_steps: int = 0         # decode steps launched before the step ahead of them was sampled

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of admitted prompt tokens the prefix cache served. (The block manager's own
        rate counts only what `allocate` sees: a chunked prompt's first chunk, and a resumed
        request's output as prompt.)"""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Launched:
    """A step launched on the device and not sampled yet: its schedule, logits and tokens
    (device tensors), the tokens' copy on the host (``host``, pinned, valid once ``ready`` has
    passed; ``None`` when not copied), its launch time and its tokens per request (``record_steps``)."""
    sched: SchedulerOutput
    logits: torch.Tensor
    drawn: torch.Tensor | None
    host: torch.Tensor | None
    ready: object | None          # a torch.cuda.Event, or None (nothing to wait for)
    start: float
    tokens: dict[str, int]


def _copy_to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, object | None]:
    """``tokens`` copied to the host without waiting, and the CUDA event that marks the copy
    done (``None`` off CUDA, where the copy is made at once)."""
    if not tokens.is_cuda:
        return tokens.clone(), None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class LLMEngine:
    """Continuous batching over a paged KV cache.

    Args:
        model: a `minillm.model.LlamaForCausalLM`, on its device and dtype.
        tokenizer: a ``tokenizers.Tokenizer``.
        config: the `EngineConfig`.
        chat_template: the checkpoint's Jinja chat template, if any.
        model_name: the name ``/v1/models`` reports.
    """

    def __init__(self, model, tokenizer, config: EngineConfig | None = None, *, chat_template: str | None = None,
                 model_name: str = "minillm"):
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        self.model_config = model.config
        self.chat_template, self.model_name = chat_template, model_name
        self.device = model.lm_head.weight.device
        num_blocks = self._pool_blocks()
        if num_blocks < 1:
            raise ValueError("no memory is left for the KV pool: lower the model's size or raise the memory budget")
        from minillm.vmm.manager import build_kv_cache  # Chapter 11: kv_cache="virtual"
        self.manager, self.cache = build_kv_cache(model, config, num_blocks)
        self.scheduler = Scheduler(self.manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings, self.manager.num_blocks * self.manager.block_size)
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.failures: dict[str, Exception] = {}   # request id -> the error that ended it (`_fail`)
        self.stats = EngineStats()
        self.steps: list[StepRecord] = []
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count()
        # Chapter 10: the fused kernels and merged projections (on CUDA by default; before capture).
        self.fused_decode = enable_fused_decode(model, self.cache, getattr(config, "fused_decode", "off"))
        # ... and the step's tokens drawn on the device, inside the CUDA graph (`gpu_sampling`).
        self.sample_on_device = self.fused_decode
        # A tensor-parallel model (Chapter 13) brings its own runner: each rank runs its shard.
        self.runner = model.make_runner(self.cache) if hasattr(model, "make_runner") else ModelRunner(model, self.cache)
        self._ahead: _Launched | None = None   # a decode step launched before the last one was sampled
        if config.cuda_graphs != "off":  # a no-op off CUDA or with the torch backend
            self.runner.capture_cuda_graphs(config.max_num_seqs, self.max_model_len,
                                            config.max_num_batched_tokens if config.cuda_graphs == "all" else 0,
                                            **({"sample_tokens": True} if self.sample_on_device else {}))
        else:  # compile and tune each decode batch size now, not inside the first requests' steps
            self.runner.warm_up(config.max_num_seqs, self.max_model_len, config.max_num_batched_tokens,
                                sample_tokens=self.sample_on_device)
        # Overlapped decode: with the tokens drawn on the GPU, a pure decode step is launched
        # before the last one's tokens reach the host (its input ids are taken on the device),
        # so the host schedules and samples while the GPU computes (`_step`).
        # Not under tensor parallelism: every rank embeds the step's tokens, which would have to
        # reach them from rank 0's GPU.
        self.overlap_decode = bool(config.overlap_decode == "auto" and self.sample_on_device
                                   and self.device.type == "cuda" and getattr(self.runner, "cuda_graphs", False)
                                   and not hasattr(model, "make_runner"))
        # With graphs, the step's batch is built on the host and staged by the runner into its
        # graphs' buffers in two copies (`ModelRunner.replay`), rather than sent field by field
        # (a tensor-parallel runner's ranks each stage it: rank 0 sends them the host's copy).
        self._batch_device = torch.device("cpu") if getattr(self.runner, "cuda_graphs", False) else self.device

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        """Load a local Hugging Face-format checkpoint folder and build the engine around it."""
        from minillm.model import load_model, load_tokenizer

        config = config or EngineConfig()
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        config.device = device
        dtype = config.dtype or ("float32" if device == "cpu" else None)
        if config.tensor_parallel_size > 1:  # Chapter 13: this process becomes rank 0 of the world
            from minillm.distributed import load_parallel_model
            model = load_parallel_model(path, config.tensor_parallel_size, device=device, dtype=dtype)
        else:
            model, _ = load_model(path, device=device, dtype=dtype)
        tokenizer, template = load_tokenizer(path)
        return cls(model, tokenizer, config, chat_template=template, model_name=Path(path).name)

    # == the KV pool's size ========================================================================
    @property
    def block_bytes(self) -> int:
        c = self.model_config
        if self.config.kv_cache == "virtual":  # Chapter 11: a block is one page of every layer's K and V
            from minillm.vmm.manager import page_group_bytes
            return page_group_bytes(self.model, self.config, self.device)
        if getattr(c, "is_mla", False):  # Chapter 12: one latent row per token and layer, no separate V
            return c.num_hidden_layers * self.config.block_size * c.latent_dim * self.model.lm_head.weight.element_size()
        kv_heads = getattr(self.model, "local_kv_heads", c.num_key_value_heads)  # tensor parallel: a rank's
        return kv_block_bytes(c.num_hidden_layers, kv_heads, c.head_dim, self.config.block_size,
                              self.model.lm_head.weight.element_size())

    def _pool_blocks(self) -> int:
        """``num_blocks`` if set; on CUDA, what ``gpu_memory_utilization`` leaves after the
        weights and the activations of the largest step (measured by running it once); on a
        CPU, ``kv_cache_memory_mb``."""
        c = self.config
        if c.num_blocks is not None:
            return c.num_blocks
        if self.device.type != "cuda":
            return int(c.kv_cache_memory_mb * 2**20) // self.block_bytes
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        peak_activations = self._profile_activations()
        budget = total * c.gpu_memory_utilization - (total - free) - peak_activations
        return max(int(budget) // self.block_bytes, 0)

    @torch.inference_mode()
    def _profile_activations(self) -> int:
        """Bytes a forward pass of ``max_num_batched_tokens`` tokens allocates beyond the weights."""
        n, bs = self.config.max_num_batched_tokens, self.config.block_size
        cache = self.model.new_paged_cache(blocks_for(n, bs), bs, backend=self.config.attention_backend)
        manager = BlockManager(cache.num_blocks, bs, enable_prefix_caching=False)
        manager.allocate("profile", [0] * n)
        batch = PagedBatch.from_manager(manager, ["profile"], n, device=self.device)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model.forward_paged(batch, cache, last_only=True)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del cache
        torch.cuda.empty_cache()
        return peak

    # == requests ==================================================================================
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, prompt_token_ids: Sequence[int] | None = None) -> str:
        """Check a request and queue it; returns its id. ``prompt`` is text or token ids;
        ``prompt_token_ids``, when given, are the text's tokens (the server tokenizes off the
        engine thread). Parameters are normalised first (`normalise_params`).

        Raises:
            InvalidRequest: an empty prompt, token ids outside the vocabulary, ``n`` or the
                beam width over ``max_n``, a request that could never fit in the KV pool; and
                `ContextLengthExceeded` when prompt + ``max_tokens`` > ``max_model_len``.
        """
        params = normalise_params(params or SamplingParams())
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is not None:
            ids = [int(t) for t in prompt_token_ids]
        elif text is not None:
            try:
                ids = self.tokenizer.encode(text).ids
            except Exception as e:  # e.g. a lone surrogate, which no encoding can write
                raise InvalidRequest(f"the prompt cannot be tokenized: {e}", param="prompt") from None
        else:
            ids = [int(t) for t in prompt]
        self._check(ids, params)
        seed = params.seed if params.seed is not None else (self.config.seed if self.config.seed is not None
                                                            else secrets.randbits(62))
        request = Request(request_id, text, ids, params, next(self._arrivals), seed, self.eos_token_ids)
        root = Seq(next(self._seq_ids), 0, list(ids), len(ids),
                   None if params.greedy or params.beam_search else completion_generator(params, 0, seed),
                   Detokenizer(self.tokenizer, ids, params.stop, stop_token_ids=request.stop_token_ids,
                               include_stop=params.include_stop_str_in_output, min_tokens=params.min_tokens))
        request.seqs = [root]
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequest("the prompt is empty: it must contain at least one token", param="prompt")
        if len(ids) + params.max_tokens > self.max_model_len:   # before any scan of the ids
            raise ContextLengthExceeded(self.max_model_len, len(ids), params.max_tokens)
        vocab = self.model_config.vocab_size
        if not all(0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must lie in [0, {vocab})", param="prompt")
        if params.logit_bias and not all(t < vocab for t in params.logit_bias):
            bad = sorted(t for t in params.logit_bias if t >= vocab)
            raise InvalidRequest(f"logit_bias token ids must lie in [0, {vocab}), got {bad[:5]}", param="logit_bias")
        if (params.prompt_logprobs or 0) > vocab:
            raise InvalidRequest(f"prompt_logprobs must be at most the vocabulary's size, {vocab}",
                                 param="prompt_logprobs")
        width = params.num_beams if params.beam_search else params.n
        if width > self.config.max_n:
            name = "num_beams" if params.beam_search else "n"
            raise InvalidRequest(f"{name} must be at most {self.config.max_n}, got {width}", param=name)
        _check_limits(params, vocab, len(self.eos_token_ids))
        # A request needing more than the pool can never run (paged: its sequences share the
        # prompt's full blocks; virtual: each holds its own pages; see `kv_blocks_needed`).
        from minillm.vmm.manager import kv_blocks_needed
        bs = self.manager.block_size
        needed = kv_blocks_needed(self.manager, len(ids), params.max_tokens, width)
        if needed > self.manager.num_blocks:
            raise InvalidRequest(f"this request needs up to {needed} KV blocks of {bs} tokens but the pool has "
                                 f"{self.manager.num_blocks}: lower n, the beam width or max_tokens", param="n")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; its unfinished completions end with
        ``"abort"``. Returns its last output (``None`` for an unknown or finished id)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            seq.finish_reason = "abort"
            request.done[seq.index] = seq
        self.scheduler.finish(request)
        request.seqs = []
        request.metrics.finished = time.perf_counter()
        self.stats.requests_aborted += 1
        return request.output()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # == one step ==================================================================================
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns the outputs of the requests that made
        progress (a new token, or finished). A request whose own sampling or output raised is
        ended alone (`_fail`): its error is in `failures`, and the others go on."""
        outputs = []
        for request in self._step():
            try:
                outputs.append(request.output())
            except Exception as e:
                self._fail(request, e)
                outputs.append(RequestOutput(request_id=request.request_id, prompt=request.prompt,
                                             prompt_token_ids=request.prompt_token_ids, outputs=[], finished=True,
                                             num_cached_tokens=request.num_cached_tokens or 0,
                                             metrics=request.metrics))
        return outputs

    @torch.inference_mode()
    def _step(self) -> list[Request]:
        """One step: schedule and launch it (or take the step launched ahead by the previous
        call), launch the next decode step ahead of it when it can (`overlap_decode`), then
        sample it; returns the requests that progressed."""
        start = time.perf_counter()
        current, self._ahead = self._ahead, None
        if current is None:
            sched = self.scheduler.schedule()
            if not sched.seqs:
                return []
            current = self._launch(sched, start)
        if self.overlap_decode and self._can_launch_ahead(current.sched):
            self._ahead = self._launch_ahead(current)
        progressed = self._sample_launched(current)
        if self._ahead is not None:
            self._resolve_ahead(self._ahead)
        return progressed

    def _launch(self, sched: SchedulerOutput, start: float, input_ids: torch.Tensor | None = None) -> _Launched:
        """Copy-on-write copies, the step's batch, the forward pass (and on-device sampling),
        without waiting for the GPU; the tokens' copy to the host is queued (`overlap_decode`).
        ``input_ids``: the step's tokens already on the device (a step launched ahead); else
        the manager's. Counts the tokens as computed (a step launched ahead: `_resolve_ahead`)."""
        if sched.copies:  # most steps copy nothing (on CUDA, an empty call still costs a host-to-device copy)
            self.cache.copy_blocks(sched.copies)
        batch = PagedBatch.from_manager(self.manager, [s.seq_id for s in sched.seqs], sched.num_new_tokens,
                                        device=self._batch_device)
        if input_ids is not None:
            batch = dataclasses.replace(batch, input_ids=input_ids)
        host = event = None
        if self.sample_on_device:  # Chapter 10: the tokens come out of the step with the logits
            rows = self._sampling_rows(sched, ahead=input_ids is not None)
            logits, drawn = self.runner.forward_and_sample(batch, rows)
            if self.overlap_decode:
                host, event = _copy_to_host(drawn)
        else:
            logits, drawn = self.runner.forward(batch), None                          # [seqs, vocab]
        if input_ids is None:
            for seq, count in zip(sched.seqs, sched.num_new_tokens):
                self.stats.prompt_tokens_computed += max(0, min(seq.num_computed + count, seq.num_prompt_tokens)
                                                         - seq.num_computed)
                seq.num_computed += count
        for request in sched.requests:
            if request.metrics.first_scheduled is None:  # admitted for the first time
                request.metrics.first_scheduled = start
                self.stats.prompt_tokens += len(request.prompt_token_ids)
                self.stats.cached_prompt_tokens += request.num_cached_tokens or 0
        tokens: dict[str, int] = {}
        if self.config.record_steps:
            for request, count in zip(sched.owners, sched.num_new_tokens):
                tokens[request.request_id] = tokens.get(request.request_id, 0) + count
        return _Launched(sched, logits, drawn, host, event, start, tokens)

    def _sample_launched(self, step: _Launched) -> list[Request]:
        """Wait for ``step``'s tokens, sample, retire what stopped; record the step."""
        sched, logits = step.sched, step.logits
        if step.ready is not None:
            step.ready.synchronize()   # this step's tokens only: a step launched after it may still run
        drawn = step.host if step.host is not None else step.drawn
        try:
            progressed = self.sample(sched, logits, drawn)
        except Exception:  # a batched part raised (before any request changed): one request at a time
            progressed = []
            for request in sched.requests:
                try:
                    progressed += self.sample(dataclasses.replace(sched, requests=[request]), logits, drawn)
                except Exception as e:
                    self._fail(request, e)
                    progressed.append(request)
        self.stats.steps += 1
        if self.config.record_steps:
            # A step launched ahead began while the one before it ran: its record starts when
            # that one's ended, so that the records of consecutive steps do not overlap.
            start = max(step.start, self.steps[-1].end) if self.steps else step.start
            self.steps.append(StepRecord(start, time.perf_counter(), step.tokens, len(self.scheduler.waiting),
                                         len(self.scheduler.running), self.manager.num_used_blocks, self.kv_tokens()))
        return progressed

    # == overlapped decode (on CUDA: the host's work for one step while the GPU runs the last) ====
    def _can_launch_ahead(self, sched: SchedulerOutput) -> bool:
        """Whether the next step can be launched before ``sched``'s tokens are known: ``sched``
        ran every running request, each a single sequence drawing its next token on the
        device from the raw logits (no logprobs, processors, beams or forks: nothing that needs
        the logits or the token on the host before the next step), and the next step would
        admit nobody (nobody waits, or the batch is full)."""
        sch = self.scheduler
        if sched.preempted or len(sched.requests) != len(sch.running):
            return False
        if sch.waiting and sch.num_running_seqs < sch.max_num_seqs:
            return False
        for request in sch.running:
            if not request.plain or len(request.seqs) != 1 or request.seqs[0].num_uncomputed != 0:
                return False
        return True

    def _launch_ahead(self, current: _Launched) -> _Launched | None:
        """Launch the decode step after ``current`` with ``current``'s tokens as its input, taken
        on the device: every running sequence gets a slot for its next token, whose id the
        managers learn in `_resolve_ahead`. ``None`` when the pool is short (the next step
        then runs as usual, after this one, and preempts if it must)."""
        sched = self.scheduler.schedule_ahead()
        if sched is None:
            return None
        row_of = {seq.seq_id: i for i, seq in enumerate(current.sched.seqs)}
        rows = [row_of[seq.seq_id] for seq in sched.seqs]
        in_order = rows == list(range(len(rows)))
        index = slice(0, len(rows)) if in_order else torch.tensor(rows, device=current.drawn.device)
        self.stats.overlapped_steps += 1
        return self._launch(sched, time.perf_counter(), input_ids=current.drawn[index])

    def _resolve_ahead(self, ahead: _Launched) -> None:
        """After the step before ``ahead`` was sampled: each sequence still running has its new
        token as the one ``ahead`` computes (given to the manager, counted as computed); a
        sequence that stopped meanwhile gets nothing (its blocks are free already, and its
        token from ``ahead`` is dropped: its request is no longer ready to sample)."""
        live, manager = False, self.manager
        for seq in ahead.sched.seqs:
            if seq.finish_reason is None and seq.seq_id in manager:
                manager.set_last_token(seq.seq_id, seq.token_ids[-1])
                seq.num_computed = len(seq.token_ids)
                live = True
        if not live:   # everyone stopped: nothing of it will be read
            self._ahead = None

    def _sampling_rows(self, sched: SchedulerOutput, ahead: bool = False) -> SamplingTensors | None:
        """The sampling parameters of every row of the step (`SamplingTensors`): each
        sequence's request's parameters, key ``seed + index``, position = its length (the
        position of the token it will draw; rows that draw nothing this step are ignored).
        ``None`` when no row samples in the step itself (greedy, beam search, and requests whose
        logits are processed first: `_sample_from_device` draws those): the argmax suffices.
        ``ahead``: a step launched before its input tokens joined the sequences (one each)."""
        if not any(r.draws_in_step for r in sched.requests):
            return None
        return SamplingTensors.from_params([r.params for r in sched.owners],
                                           [r.seed + s.index for r, s in zip(sched.owners, sched.seqs)],
                                           [len(s.token_ids) + ahead for s in sched.seqs], self.device)

    def sample(self, sched: SchedulerOutput, logits: torch.Tensor, tokens: torch.Tensor | None = None
               ) -> list[Request]:
        """Draw the next token of every sequence of every request whose sequences are all
        computed, and retire what stopped (the sampling phase of `step`; if it raises, `step`
        retries one request at a time and fails only the requests that raise again).
        ``tokens``: the step's tokens drawn on the device (`sample_on_device`), one per row of
        ``logits``; else each sequence draws its own (`sample_token`)."""
        row_of = {seq.seq_id: i for i, seq in enumerate(sched.seqs)}
        ready = [r for r in sched.requests if r.ready_to_sample()]
        if not ready:
            return []
        if tokens is not None:
            return self._sample_from_device(ready, [row_of[s.seq_id] for r in ready for s in r.seqs], logits, tokens)
        # One argmax and one log-softmax for the whole step, one copy to the CPU for sampling.
        rows = torch.tensor([row_of[s.seq_id] for r in ready for s in r.seqs], device=logits.device)
        logits = logits[rows].float()
        need_lp = any(r.params.logprobs is not None or r.params.beam_search for r in ready)
        logprobs = torch.log_softmax(logits, dim=-1) if need_lp else None   # of the raw logits, as vLLM's
        logits = self._process_logits(ready, logits)      # logit bias, min_tokens, penalties
        argmax = logits.argmax(-1).tolist()
        self._fill_prompt_logprobs(ready)
        sampled = any(not r.params.greedy and not r.params.beam_search for r in ready)
        # Fused, with sample_on_device off: the logits stay on the device; each draw sends back its token id.
        logits_cpu = (logits if self.fused_decode else logits.cpu()) if sampled else None
        now = time.perf_counter()

        def advance(i: int, request: Request, view: slice) -> None:
            if request.params.beam_search:
                self._advance_beams(request, logprobs[view])
            else:
                self.advance_samples(request, argmax[view], logits_cpu[view] if logits_cpu is not None else None,
                                     logprobs[view] if logprobs is not None else None, now)
        return self._advance_each(ready, advance, now)

    def _sample_from_device(self, ready: list[Request], rows: list[int], logits: torch.Tensor,
                            tokens: torch.Tensor) -> list[Request]:
        """`sample` with the tokens the step drew on the device (``tokens``, one per row of
        ``logits``; ``rows``: the rows of the ready requests' sequences, in order). A request
        with a logit bias, min_tokens or penalties has its rows processed (on the device) and
        drawn again by the same sampler, as does the first step of ``n > 1`` (each of the ``n``
        samples draws from the prompt's logits with its own key); all the tokens come to the
        host in one copy."""
        if all(r.plain for r in ready):   # the common step: one sequence per request, its token drawn
            return self._advance_plain(ready, self._chosen(rows, tokens).tolist())
        redraw: list[tuple[int, SamplingParams, int, int]] = []    # (row in rows, params, key, position)
        spans: list[tuple[int, int] | None] = []                   # per request: its tokens' slice of `host`
        at = 0
        for request in ready:
            k, params = request.num_seqs, request.params
            if params.beam_search:
                spans.append(None)
            elif params.n > 1 and not request.done and k == 1 and not request.seqs[0].output_ids:
                spans.append((len(rows) + len(redraw), params.n))
                position = len(request.seqs[0].token_ids)
                redraw += [(at, params, request.seed + i, position) for i in range(params.n)]
            elif params.processes_logits:
                spans.append((len(rows) + len(redraw), k))
                redraw += [(at + j, params, request.seed + s.index, len(s.token_ids))
                           for j, s in enumerate(request.seqs)]
            else:
                spans.append((at, k))
            at += k
        in_order = rows == list(range(len(rows)))
        index = slice(0, len(rows)) if in_order else torch.tensor(rows, device=tokens.device)
        chosen = tokens[index]   # on the host already when the step's tokens were copied (`overlap_decode`)
        need_lp = any(r.params.logprobs is not None or r.params.beam_search for r in ready)
        if need_lp or redraw:
            logits = logits[index if in_order else index.to(logits.device)].float()
        logprobs = torch.log_softmax(logits, dim=-1) if need_lp else None   # of the raw logits, as vLLM's
        if redraw:
            processed = self._process_logits(ready, logits)              # logit bias, min_tokens, penalties
            again = SamplingTensors.from_params([p for _, p, _, _ in redraw], [key for *_, key, _ in redraw],
                                                [pos for *_, pos in redraw], logits.device)
            redrawn = processed[torch.tensor([row for row, *_ in redraw], device=logits.device)]
            chosen = torch.cat([chosen, sample_on_device(redrawn, again).to(chosen.device)])
        host = chosen.tolist() if any(span is not None for span in spans) else []
        self._fill_prompt_logprobs(ready)
        now = time.perf_counter()

        def advance(i: int, request: Request, view: slice) -> None:
            span = spans[i]
            if span is None:
                self._advance_beams(request, logprobs[view])
            else:
                self.advance_samples(request, None, None, logprobs[view] if logprobs is not None else None, now,
                                     tokens=host[span[0]:span[0] + span[1]])
        return self._advance_each(ready, advance, now)

    @staticmethod
    def _chosen(rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """``tokens[rows]``. The ready rows are most often the step's first rows in order (a
        pure decode step): then a view, not a gather (on CUDA: no host-to-device copy, no kernel)."""
        if rows == list(range(len(rows))):
            return tokens[:len(rows)]
        return tokens[torch.tensor(rows, device=tokens.device)]

    def _advance_plain(self, ready: list[Request], tokens: list[int]) -> list[Request]:
        """`_sample_from_device` for a step whose ready requests are all `Request.plain`: each
        appends its one token (``tokens[i]``, drawn on the device), and stops or not. A request
        whose own step raises is ended alone (`_fail`). Returns ``ready``."""
        now = time.perf_counter()
        for request, token in zip(ready, tokens):
            try:
                metrics = request.metrics
                metrics.first_token = metrics.first_token or now
                metrics.last_token = now
                self._append_token(request, request.seqs[0], token, now)
            except Exception as e:
                self._fail(request, e)
                continue
            if not request.seqs:
                self._finish(request, now)
        return ready

    def _append_token(self, request: Request, seq: Seq, token: int, now: float) -> bool:
        """Append ``token`` to ``seq`` and, if it stops there, retire it (out of
        ``request.seqs``, its blocks freed). Returns whether it still runs."""
        seq.token_ids.append(token)
        self.stats.generation_tokens += 1
        if seq.index == 0:
            request.metrics.token_times.append(now)
        if not self._stopped(request, seq, token):
            return True
        request.done[seq.index] = seq
        self.scheduler.free_seq(seq)
        request.seqs = [s for s in request.seqs if s is not seq]
        return False

    def _fill_prompt_logprobs(self, ready: list[Request]) -> None:
        """The prompt logprobs of the requests that ask for them and have none yet."""
        for request in ready:
            if request.params.prompt_logprobs is not None and request.prompt_logprobs is None:
                request.prompt_logprobs = self._prompt_logprobs(request)

    def _advance_each(self, ready: list[Request], advance, now: float) -> list[Request]:
        """``advance(i, request, view)`` for each ready request, ``view`` its sequences' slice
        of the step's sampled rows; a request whose own advance raises is ended alone
        (`_fail`), one left without sequences is finished. Returns ``ready``."""
        at = 0
        for i, request in enumerate(ready):
            view = slice(at, at + request.num_seqs)
            at += request.num_seqs
            try:  # one request's error ends that request alone
                advance(i, request, view)
            except Exception as e:
                self._fail(request, e)
                continue
            if not request.seqs:
                self._finish(request, now)
        return ready

    @staticmethod
    def _process_logits(ready: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """The rows of requests with a logit bias, min_tokens or penalties, processed in one
        batch (`minillm.decoding.logits_processors`); the others as they are."""
        if not any(r.params.processes_logits for r in ready):
            return logits
        rows = [(r, s) for r in ready for s in r.seqs]
        return apply_logits_processors(logits, [r.params for r, _ in rows], [r.prompt_token_ids for r, _ in rows],
                                       [s.output_ids for _, s in rows], [r.stop_token_ids for r, _ in rows])

    @torch.inference_mode()
    def _prompt_logprobs(self, request: Request) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability given the tokens before it (the first has none),
        with the ``prompt_logprobs`` most likely alternatives and its rank.

        A pass over the prompt on the side, in chunks of at most 256 tokens, through the
        model's contiguous cache: the engine's own prefill computes only the last position's
        logits, and skips the prompt blocks the prefix cache holds (vLLM turns the prefix cache
        off for such requests instead). It costs one more prefill of the prompt."""
        ids, k = request.prompt_token_ids, request.params.prompt_logprobs
        out: list[TokenLogprob | None] = [None]
        if len(ids) < 2:
            return out
        tokens = torch.tensor([ids], device=self.device)
        cache = self.model.new_cache(1, len(ids))
        step = min(self.config.max_num_batched_tokens, 256)   # logits [step, vocab] at a time
        for start in range(0, len(ids) - 1, step):
            end = min(start + step, len(ids) - 1)
            lp = torch.log_softmax(self.model(tokens[:, start:end], start_pos=start, cache=cache)[0].float(), -1)
            target = tokens[0, start + 1:end + 1]
            chosen = lp.gather(1, target[:, None])[:, 0]
            ranks = ((lp > chosen[:, None]).sum(-1) + 1).tolist()
            tops = [()] * (end - start)
            if k:
                values, top_ids = lp.topk(k)
                tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
            out += [TokenLogprob(t, v, top, r) for t, v, top, r in zip(target.tolist(), chosen.tolist(), tops, ranks)]
        return out

    def advance_samples(self, request: Request, argmax: list[int] | None, logits: torch.Tensor | None,
                        logprobs: torch.Tensor | None, now: float, tokens: list[int] | None = None) -> None:
        """Append the next token of each of ``request``'s sampled sequences (``tokens[i]`` when
        given, drawn already; else greedy: its row of ``argmax``, or drawn from its row of
        ``logits``) and retire the sequences that stop. Called by `sample` for one request at a
        time; an error fails that request alone."""
        params = request.params
        if params.n > 1 and not request.done and len(request.seqs) == 1 and not request.seqs[0].output_ids:
            self._fork_samples(request)  # the prompt is computed: every sample starts from its logits
            argmax = argmax * params.n if argmax is not None else None
            logits = logits.expand(params.n, -1) if logits is not None else None
            logprobs = logprobs.expand(params.n, -1) if logprobs is not None else None
        metrics = request.metrics
        metrics.first_token = metrics.first_token or now
        metrics.last_token = now
        still_running = []
        for i, seq in enumerate(request.seqs):
            if tokens is not None:
                token = tokens[i]
            else:
                token = argmax[i] if params.greedy else sample_token(logits[i], params, seq.generator)
            seq.token_ids.append(token)
            self.stats.generation_tokens += 1
            if seq.index == 0:
                metrics.token_times.append(now)
            if logprobs is not None:
                self._record_logprob(seq, logprobs[i], token, params.logprobs)
            if self._stopped(request, seq, token):
                request.done[seq.index] = seq
                self.scheduler.free_seq(seq)
            else:
                still_running.append(seq)
        request.seqs = still_running

    def _fork_samples(self, request: Request) -> None:
        root = request.seqs[0]
        for i in range(1, request.params.n):
            child = root.fork(next(self._seq_ids), i, completion_generator(request.params, i, request.seed))
            self.manager.fork(root.seq_id, child.seq_id)
            request.seqs.append(child)

    @staticmethod
    def _record_logprob(seq: Seq, logprobs: torch.Tensor, token: int, k: int) -> None:
        lp = float(logprobs[token])
        top = ()
        if k:
            values, ids = logprobs.topk(k)
            top = tuple(zip(ids.tolist(), values.tolist()))
        seq.logprobs.append(TokenLogprob(token, lp, top))
        seq.cumulative_logprob += lp

    def _stopped(self, request: Request, seq: Seq, token: int) -> bool:
        """Set ``seq.finish_reason`` if it stops here: a stop token (eos unless ``ignore_eos``),
        a stop string, or ``max_tokens``."""
        params = request.params
        if token in request.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif params.stop and (hit := seq.detokenizer.update(seq.output_ids)) is not None:
            seq.finish_reason, seq.stop_reason = "stop", hit
        elif seq.num_output_tokens >= params.max_tokens:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _advance_beams(self, request: Request, logprobs: torch.Tensor) -> None:
        """One beam-search step for the request's live beams (`minillm.decoding.beams`)."""
        params = request.params
        if request.beams is None:
            search = BeamSearchParams(num_beams=params.num_beams, max_new_tokens=params.max_tokens,
                                      length_penalty=params.length_penalty, num_return_sequences=params.n,
                                      eos_token_ids=tuple(sorted(request.stop_token_ids)))
            request.beams = BeamState(search, self.model_config.vocab_size)
        state = request.beams
        parents = state.advance(logprobs)
        self.stats.generation_tokens += len(request.seqs)
        request.metrics.first_token = request.metrics.first_token or time.perf_counter()
        if state.done:
            for seq in request.seqs:
                self.scheduler.free_seq(seq)
            request.seqs = []
            request.beam_outputs = [self._hypothesis_output(request, i, h) for i, h in enumerate(state.result())]
            return
        old = request.seqs
        new_ids = reassign_beams(self.manager, [s.seq_id for s in old], parents, lambda: next(self._seq_ids))
        prompt, det = request.prompt_token_ids, old[0].detokenizer
        request.seqs = []
        for i, (seq_id, tokens) in enumerate(zip(new_ids, state.token_ids)):
            seq = Seq(seq_id, i, [*prompt, *tokens], len(prompt), None, det)
            seq.num_computed = len(seq.token_ids) - 1   # the parent's tokens are in the cache
            request.seqs.append(seq)

    def _hypothesis_output(self, request: Request, index: int, hyp) -> CompletionOutput:
        det = Detokenizer(self.tokenizer, request.prompt_token_ids, request.params.stop,
                          stop_token_ids=request.stop_token_ids, include_stop=request.params.include_stop_str_in_output)
        det.update(hyp.token_ids)
        ended = bool(hyp.token_ids) and hyp.token_ids[-1] in request.stop_token_ids
        reason = "stop" if ended or det.stop_reason else "length"
        return CompletionOutput(index, det.text, list(hyp.token_ids), reason, None, hyp.score,
                                hyp.token_ids[-1] if ended else det.stop_reason)

    def _fail(self, request: Request, error: Exception) -> None:
        """End ``request`` because its own step raised ``error``: free its blocks, finish its
        unfinished completions with ``"error"``, keep the error in ``failures`` (the server
        answers that request alone with it). Every other request goes on as if it never came."""
        self.requests.pop(request.request_id, None)
        for seq in request.seqs:
            seq.finish_reason = seq.finish_reason or "error"
            request.done[seq.index] = seq
        self.scheduler.finish(request)
        request.seqs = []
        request.metrics.finished = time.perf_counter()
        self.failures[request.request_id] = error
        self.stats.requests_failed += 1

    def _finish(self, request: Request, now: float) -> None:
        self.scheduler.finish(request)
        self.requests.pop(request.request_id, None)
        request.metrics.finished = now
        self.stats.requests_finished += 1

    # == state, for metrics ========================================================================
    def kv_tokens(self) -> int:
        """Tokens the live sequences hold in the cache (a shared block's counted once per holder)."""
        return sum(self.manager.num_tokens(s) for s in self.manager.seq_ids())

    def kv_waste(self) -> float:
        """Fraction of the slots in used blocks that hold no token: the partly filled last
        blocks (0 when nothing is held; can read below 0 when forks share blocks)."""
        used = self.manager.num_used_blocks * self.manager.block_size  # virtual mode: pages, not blocks
        return 1 - self.kv_tokens() / used if used else 0.0
