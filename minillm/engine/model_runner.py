"""Chapter 9: runs one step's flat batch through the model and returns the logits that
predict each sequence's next token, eagerly or by replaying a CUDA graph; Chapter 10 adds the
sampler at the end of the step (`forward_and_sample`), so the graph returns the tokens too.

**Why graphs.** A decode step of a small model is a few hundred small kernels: each layer's
norms, projections, RoPE, cache write, attention and MLP. The GPU finishes most of them in a
few microseconds, but launching each one from Python costs more than that (a Triton launch
tens of microseconds), so an eager step is bound by the host, not by the GPU. A CUDA graph
records the kernels of one step once, with their arguments, and `CUDAGraph.replay` launches
them all with one call: the step then costs what the GPU needs.

**What a graph needs.** Every kernel argument is baked in at capture: the shapes, the grid
sizes and the addresses of every tensor. So a graph serves one *shape* of step, and reads
its inputs from *static buffers* that each step fills in place before the replay:

- token ids, positions and slot mapping: ``[max_tokens]``; block tables: ``[max_num_seqs,
  max_blocks]`` with ``max_blocks`` for ``max_model_len``; sequence lengths and
  ``cu_seqlens_q``;
- the step is padded up to the graph's *bucket*: padding tokens get slot ``-1`` (their K/V are
  written nowhere), padding sequences length 0 (attention reads nothing and returns 0), and
  the logits of the real sequences are the first rows of the graph's output;
- flash-decoding sizes its splits from ``max_seq_len``, a Python number: graphs use
  ``max_model_len`` (a sequence shorter than that leaves some splits empty; they exit at once).

Two kinds of graphs, one per bucket (captured largest first, all sharing one memory pool,
since only one runs at a time):

- ``decode``: pure decode steps (one new token per sequence), buckets 1, 2, 4, 8, 16, 32, ...
  up to ``max_num_seqs`` sequences; attention is flash-decoding;
- ``mixed``: any other step (prefill chunks, alone or with decodes), buckets of 64, 128, 256,
  ... tokens up to ``max_num_batched_tokens``, always ``max_num_seqs`` sequences; attention
  is the paged prefill kernel with ``max_seqlen_q`` = the bucket (a grid bound: programs past
  a sequence's own queries exit at once).

Before each capture the bucket's step runs once eagerly: Triton compiles its kernels and
Chapter 8's flat GEMM tunes its tiles then (neither may happen during a capture). On a CPU,
for the torch attention backend, and for a step that fits no bucket, `forward` runs eagerly.
An engine without graphs on CUDA runs padding steps of every shape an eager step can take
once at start-up (`warm_up`): otherwise its requests' steps would pay for compiling and
tuning, a second or more each time. Both also run steps of fresh prompts in each length
class (a prompt-only step runs eagerly either way, and its varlen FlashAttention kernel tunes
its tiles per class of lengths: `_warm_up_prompts`).

**Sampling in the graph (Chapter 10).** With ``capture_cuda_graphs(..., sample_tokens=True)``
each step shape gets the tokens on the GPU too: its graph ends with the argmax of the logits
(what a step of greedy requests needs), and a second, small graph captured right after it,
in the same memory pool, runs `minillm.decoding.gpu_sampling.sample` over those logits, reading
the rows' sampling parameters from one more pair of static buffers (`SamplingTensors` of
``max_num_seqs`` rows, filled before the replay like the others; padding rows are greedy).
`forward_and_sample` replays the sampler's graph only for a step with rows to sample (the
sort over the vocabulary is the sampler's main cost, and a greedy step does not pay it); no
value comes back to the host in between. Eagerly it calls the same functions on the same
logits, so a step gives the same tokens with and without the graphs.
"""
from __future__ import annotations

import dataclasses
import itertools
import warnings
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from minillm.decoding.gpu_sampling import SamplingTensors, sample
from minillm.model.paged import PagedBatch, PagedKVCache
from minillm.paged import blocks_for

__all__ = ["ModelRunner", "choose_tokens", "decode_buckets", "step_shapes", "token_buckets",
           "warm_up_widths"]


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes of the decode graphs: 1, 2, 4, 8, then every 16 (as nano-vllm), and
    ``max_num_seqs`` itself. A step of ``B`` sequences runs the smallest bucket >= ``B``."""
    sizes = {1, 2, 4, 8, *range(16, max_num_seqs + 1, 16), max_num_seqs}
    return sorted(b for b in sizes if b <= max_num_seqs)


def step_shapes(max_num_seqs: int, max_num_batched_tokens: int = 0, smallest_mixed: int = 64
                ) -> list[tuple[str, int]]:
    """The step shapes that get a graph, largest first: ``("decode", b)`` for every decode
    bucket, and with ``max_num_batched_tokens > 0`` ``("mixed", t)`` for every token bucket
    from ``smallest_mixed``."""
    shapes = [("decode", b) for b in decode_buckets(max_num_seqs)]
    if max_num_batched_tokens > 0:
        shapes += [("mixed", t) for t in token_buckets(max_num_batched_tokens, smallest_mixed)]
    return sorted(shapes, key=lambda s: -s[1])


def warm_up_widths(max_blocks: int) -> list[int]:
    """Block-table widths an eager warm-up runs: 1, 2, 3, 4, 6, 9, 13, ... (each about 1.5
    times the one before, never more than twice) and ``max_blocks``. The split count of
    flash-decoding follows the width, and its merge tile is the split count's next power of
    two: widths that at most double between steps meet every power of two on the way, so every
    variant compiles."""
    widths, w = {max_blocks}, 1
    while w < max_blocks:
        widths.add(w)
        w = max(w + 1, (3 * w) // 2)
    return sorted(widths)


def token_buckets(max_num_batched_tokens: int, smallest: int = 64) -> list[int]:
    """Token counts of the mixed graphs: powers of two from ``smallest``, and the step's
    token budget itself."""
    sizes, b = {max_num_batched_tokens}, smallest
    while b < max_num_batched_tokens:
        sizes.add(b)
        b *= 2
    return sorted(sizes)


@dataclass
class CapturedGraph:
    """One captured step shape: the graph, the static batch it reads and the logits it writes
    (and, captured with the sampler: the argmax it writes, and the sampler's graph with the
    static sampling rows it reads and the tokens it writes)."""
    graph: torch.cuda.CUDAGraph
    batch: PagedBatch       # views of the static buffers, at the bucket's size
    logits: torch.Tensor    # the graph's output, [bucket sequences, vocab]
    argmax: torch.Tensor | None = None                 # [bucket sequences] int64, the greedy tokens
    sampler: torch.cuda.CUDAGraph | None = None        # `sample` over `logits` with `sampling`
    sampling: SamplingTensors | None = None            # views of the static sampling rows
    tokens: torch.Tensor | None = None                 # the sampler's output, [bucket sequences] int64


class ModelRunner:
    """The model and its paged KV cache: ``forward(batch) -> logits [batch_size, vocab]``, and
    ``forward_and_sample(batch, sampling) -> (logits, tokens [batch_size])``.

    Eager by default; `capture_cuda_graphs` records graphs for the step shapes listed in the
    module docstring, which both replay from then on whenever a step fits one.
    """

    #: `torch.cuda.graph`'s ``capture_error_mode``; a tensor-parallel rank needs ``thread_local``
    #: (`minillm.distributed.worker.RankRunner`).
    capture_error_mode = "global"

    def __init__(self, model, cache: PagedKVCache):
        self.model, self.cache = model, cache
        self.graphs: dict[tuple[str, int], CapturedGraph] = {}
        self.num_replays = 0
        self.num_eager = 0

    @torch.inference_mode()
    def forward(self, batch: PagedBatch) -> torch.Tensor:
        graph = self._graph_for(batch) if self.graphs else None
        if graph is None:
            self.num_eager += 1
            return self.model.forward_paged(batch.to(self.cache.pool.device), self.cache, last_only=True)
        self.num_replays += 1
        return self.replay(graph, batch)

    @torch.inference_mode()
    def forward_and_sample(self, batch: PagedBatch, sampling: SamplingTensors | None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's logits ``[batch_size, vocab]`` and one token per sequence ``[batch_size]``
        (int64, on the device): drawn by `minillm.decoding.gpu_sampling.sample` with the rows
        of ``sampling``, or, with ``sampling=None`` (every row greedy), the argmax. From the
        graphs when they were captured with the sampler, else eagerly after the forward pass."""
        graph = self._graph_for(batch) if self.graphs else None
        if graph is None:
            self.num_eager += 1
            logits = self.model.forward_paged(batch.to(self.cache.pool.device), self.cache, last_only=True)
            return logits, choose_tokens(logits, sampling)
        self.num_replays += 1
        logits = self.replay(graph, batch, sampling)
        B = batch.batch_size
        if graph.argmax is None:                  # captured without the sampler
            return logits, choose_tokens(logits, sampling)
        if sampling is None:
            return logits, graph.argmax[:B]
        graph.sampler.replay()
        return logits, graph.tokens[:B]

    # == capture ===================================================================================
    @property
    def cuda_graphs(self) -> bool:
        return bool(self.graphs)

    @torch.inference_mode()
    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int = 0,
                            progress: bool = False, sample_tokens: bool = False) -> int:
        """Capture the decode graphs for up to ``max_num_seqs`` sequences of up to
        ``max_model_len`` tokens, and, when ``max_num_batched_tokens`` > 0, the mixed graphs
        for steps of up to that many tokens; with ``sample_tokens``, each graph ends with the
        sampler (`forward_and_sample`). Returns the number of graphs (0 where graphs cannot
        run: a CPU, or the torch attention backend)."""
        if not self.can_capture():
            return 0
        self.graphs.clear()
        self._static_buffers(max_num_seqs, max_model_len, max_num_batched_tokens, sample_tokens)
        pool = None
        # Largest first: the first capture sizes the shared pool, the smaller ones fit in it.
        for kind, bucket in tqdm(step_shapes(max_num_seqs, max_num_batched_tokens), desc="capturing CUDA graphs",
                                 disable=not progress):
            batch, sampling = self._padding_step(kind, bucket)   # compiles and tunes, then record
            self.graphs[(kind, bucket)], pool = self.capture(batch, pool, sampling)
        self._warm_up_prompts()  # a fresh prompt's step runs eagerly
        self._keep_alive = _reused_kernel_buffers()
        return len(self.graphs)

    @torch.inference_mode()
    def warm_up(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int = 0,
                sample_tokens: bool = False) -> int:
        """Without graphs: run a padding step of every shape an eager step can take, and the
        sampler with ``sample_tokens``, so that Triton compiles every variant of the kernels and
        the GEMMs and GEMVs time their tiles before the first request rather than inside a
        request's step (each compile is a second or more). An eager step is not padded: its
        batch can have any size and its block tables any width, on which the attention kernels
        specialize (the width, and the split count it leads to, `warm_up_widths`). Decode steps
        run every size up to Chapter 8's `GEMV_MAX_ROWS` (a GEMV compiles per row count; the
        smallest batches also reach every split count) and the decode buckets above it (the flat
        GEMM tunes per power of two of rows); mixed steps the token buckets down to 16, Chapter
        8's smallest flat-GEMM bucket. Returns the number of steps run (0 where graphs could not
        run either: the torch backend, a CPU)."""
        if not self.can_capture():
            return 0
        from minillm.kernels.ch08_flat_gemm import GEMV_MAX_ROWS

        self._static_buffers(max_num_seqs, max_model_len, max_num_batched_tokens, sample_tokens)
        sizes = set(range(1, min(GEMV_MAX_ROWS, max_num_seqs) + 1)) | set(decode_buckets(max_num_seqs))
        shapes = [("decode", b) for b in sorted(sizes, reverse=True)]
        shapes += [s for s in step_shapes(max_num_seqs, max_num_batched_tokens, smallest_mixed=16) if s[0] == "mixed"]
        widths = warm_up_widths(self.max_blocks)
        for kind, bucket in shapes:
            for width in widths:
                self._padding_step(kind, bucket, width)
        prompts = self._warm_up_prompts()
        torch.cuda.synchronize(self.cache.pool.device)
        return len(shapes) * len(widths) + prompts

    def _warm_up_prompts(self) -> int:
        """Run steps of fresh prompts in each length class the varlen FlashAttention kernel of a
        prompt-only step tunes for (`minillm.kernels.ch04_flash_attention.seq_bucket`: powers
        of two from 64), so that it picks its tiles now and not inside a request's first step.
        The kernel also specializes on the longest prompt and the step's total tokens being
        multiples of 16 or not, and compiles a variant for each pair: each class runs the four
        pairs. (A step of one-token prompts has a decode step's shape and takes
        flash-decoding.) Returns the number of steps run."""
        from minillm.kernels.ch04_flash_attention import seq_bucket

        rows = self._buf["input_ids"].shape[0]
        longest = min(self.max_model_len, rows)
        steps = []
        for top in sorted({min(1 << e, longest) for e in range(6, seq_bucket(longest).bit_length())}, reverse=True):
            steps += [[top], [top - 1], [top - 1, 1], [top, 1] if top < rows else [top - 16, 1]]
        steps = [lengths for lengths in steps if max(lengths) >= 2 and min(lengths) >= 1]
        for lengths in steps:
            self._prompt_step(lengths)
        return len(steps)

    def _prompt_step(self, lengths: list[int]) -> None:
        """Run one step of fresh prompts of ``lengths`` padding tokens (slots -1: nothing is
        written; attention reads and computes over the pool's unwritten rows, so that the
        varlen kernel tunes on real lengths)."""
        b, total = self._buf, sum(lengths)
        batch = dataclasses.replace(self._static_batch("mixed", total), max_seqlen_q=max(lengths), fresh_prefill=True)
        b["slot_mapping"].fill_(-1)
        ends = torch.tensor(list(itertools.accumulate(lengths)), dtype=b["cu_seqlens_q"].dtype)
        b["cu_seqlens_q"].fill_(total)
        b["cu_seqlens_q"][0] = 0
        b["cu_seqlens_q"][1:len(lengths) + 1].copy_(ends)
        b["seq_lens"].zero_()
        b["seq_lens"][:len(lengths)].copy_(torch.tensor(lengths, dtype=b["seq_lens"].dtype))
        self.model.forward_paged(batch, self.cache, last_only=True)
        b["seq_lens"].zero_()
        b["cu_seqlens_q"].zero_()

    def _static_buffers(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                        sample_tokens: bool) -> None:
        """The step buffers the graphs read (`_static_batch`), sized for the largest step: views
        of two contiguous device buffers (the int64 rows, the int32 rest), each with two pinned
        host mirrors, so that a step built on the host reaches them in two copies (`_stage`)."""
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_blocks = blocks_for(max_model_len, self.cache.block_size)
        T, S, W = max(max_num_seqs, max_num_batched_tokens), max_num_seqs, self.max_blocks
        device = self.cache.pool.device
        wide = torch.zeros(3 * T, device=device, dtype=torch.int64)        # input ids | positions | slots
        narrow = torch.zeros(S + S * W + S + 1, device=device, dtype=torch.int32)  # lens | tables | cu
        self._buf = dict(
            input_ids=wide[:T], positions=wide[T:2 * T], slot_mapping=wide[2 * T:],
            seq_lens=narrow[:S], block_tables=narrow[S:S + S * W].view(S, W),
            cu_seqlens_q=narrow[S + S * W:],                                   # mixed steps: filled per step
            cu_decode=torch.arange(S + 1, device=device, dtype=torch.int32),  # decode steps: one row each, fixed
        )
        self._buf["slot_mapping"].fill_(-1)
        self._buf["block_tables"].fill_(-1)
        self._rows = (wide, narrow)
        pin = device.type == "cuda"
        self._mirrors = [[wide.cpu().pin_memory() if pin else wide.clone(),
                          narrow.cpu().pin_memory() if pin else narrow.clone(), None] for _ in range(2)]
        self._turn = 0
        self._sampling = SamplingTensors.empty(max_num_seqs, device) if sample_tokens else None

    def _padding_step(self, kind: str, bucket: int, width: int | None = None
                      ) -> tuple[PagedBatch, SamplingTensors | None]:
        """Run one step of ``bucket`` padding rows eagerly (and the sampler, if the buffers have
        its rows): nothing is written, nothing read, every kernel of that shape compiled and
        tuned. Returns the static batch and sampling rows, for `capture`. ``width``: block
        tables of that many blocks (contiguous, as an eager step's are) instead of the static
        ones, with ``max_seq_len`` to match (`warm_up`)."""
        batch = self._static_batch(kind, bucket)
        if width is not None:
            tables = torch.full((batch.block_tables.shape[0], width), -1, dtype=torch.int32,
                                device=batch.block_tables.device)
            batch = dataclasses.replace(batch, block_tables=tables,
                                        max_seq_len=min(width * self.cache.block_size, self.max_model_len))
        self._buf["slot_mapping"].fill_(-1)
        self._buf["seq_lens"].zero_()
        self._buf["cu_seqlens_q"].zero_()
        logits = self.model.forward_paged(batch, self.cache, last_only=True)
        sampling = self._sampling.view(logits.shape[0]) if self._sampling is not None else None
        if sampling is not None:
            sample(logits, sampling)
        return batch, sampling

    def can_capture(self) -> bool:
        """Whether graphs can run here: a CUDA pool and the Triton attention kernels."""
        return self.cache.pool.is_cuda and self.cache.kernels is not None

    def _static_batch(self, kind: str, bucket: int) -> PagedBatch:
        b = self._buf
        seqs = bucket if kind == "decode" else self.max_num_seqs
        cu = b["cu_decode"] if kind == "decode" else b["cu_seqlens_q"]
        return PagedBatch(b["input_ids"][:bucket], b["positions"][:bucket], b["slot_mapping"][:bucket],
                          cu[:seqs + 1], b["seq_lens"][:seqs], b["block_tables"][:seqs],
                          max_seqlen_q=1 if kind == "decode" else bucket, max_seq_len=self.max_model_len)

    def capture(self, batch: PagedBatch, pool, sampling: SamplingTensors | None = None
                ) -> tuple[CapturedGraph, tuple]:
        """Record one forward pass over the static ``batch`` (given the static ``sampling``
        rows: then its argmax, and the sampler over its logits in a graph of its own); returns
        the captured step and the memory pool (shared by every graph of the runner)."""
        torch.cuda.synchronize(self.cache.pool.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=self.capture_error_mode):
            logits = self.model.forward_paged(batch, self.cache, last_only=True)
            argmax = logits.argmax(-1) if sampling is not None else None
        if sampling is None:
            return CapturedGraph(graph, batch, logits), graph.pool()
        sampler = torch.cuda.CUDAGraph()
        try:
            # reads `logits`, which stay allocated
            with torch.cuda.graph(sampler, pool=graph.pool(), capture_error_mode=self.capture_error_mode):
                tokens = sample(logits, sampling)
        except RuntimeError as e:  # an op that cannot be captured here: the sampler runs eagerly
            warnings.warn(f"the sampler could not be captured in a CUDA graph ({e}); it runs eagerly",
                          RuntimeWarning, stacklevel=2)
            return CapturedGraph(graph, batch, logits), graph.pool()
        return CapturedGraph(graph, batch, logits, argmax, sampler, sampling, tokens), graph.pool()

    # == replay ====================================================================================
    def _graph_for(self, batch: PagedBatch) -> CapturedGraph | None:
        """The smallest graph the step fits, or ``None`` (run it eagerly)."""
        B, n = batch.batch_size, batch.num_tokens
        if B > self.max_num_seqs or batch.block_tables.shape[1] > self.max_blocks:
            return None
        if batch.max_seq_len is not None and batch.max_seq_len > self.max_model_len:
            return None
        kind = "decode" if batch.max_seqlen_q == 1 else "mixed"
        best = None
        for (k, bucket), graph in self.graphs.items():
            if k == kind and bucket >= n and (best is None or bucket < best[0]):
                best = (bucket, graph)
        return best[1] if best else None

    def replay(self, graph: CapturedGraph, batch: PagedBatch, sampling: SamplingTensors | None = None
               ) -> torch.Tensor:
        """Copy the step (and its sampling rows, if given and the graph samples) into the
        graph's static buffers, pad the rest, replay; returns the first ``batch_size`` rows of
        the graph's logits (valid until the next replay, as ``graph.tokens``). A batch on the
        host (the engine's, `LLMEngine`) is staged in two copies (`_stage`); one on the device
        is copied field by field."""
        if batch.seq_lens.device.type == "cpu" and self.cache.pool.is_cuda:
            self._stage(graph, batch)
        else:
            self._copy_fields(graph, batch)
        if sampling is not None and graph.sampling is not None:
            graph.sampling.copy_(sampling)
        graph.graph.replay()
        return graph.logits[:batch.batch_size]

    def _copy_fields(self, graph: CapturedGraph, batch: PagedBatch) -> None:
        s, n, B = graph.batch, batch.num_tokens, batch.batch_size
        s.input_ids[:n].copy_(batch.input_ids)
        s.positions[:n].copy_(batch.positions)
        s.slot_mapping[:n].copy_(batch.slot_mapping)
        s.slot_mapping[n:].fill_(-1)
        s.seq_lens[:B].copy_(batch.seq_lens)
        s.seq_lens[B:].zero_()
        # Columns past the step's widest table keep stale ids: no length reaches them.
        s.block_tables[:B, :batch.block_tables.shape[1]].copy_(batch.block_tables)
        if s.max_seqlen_q > 1:  # mixed: the padding sequences have no queries (cu repeats n)
            s.cu_seqlens_q[:B + 1].copy_(batch.cu_seqlens_q)
            s.cu_seqlens_q[B + 1:].fill_(n)

    def _stage(self, graph: CapturedGraph, batch: PagedBatch) -> None:
        """A host ``batch`` into the static buffers: written, padding included, into a pinned
        mirror of the two device buffers with NumPy (no kernel, no torch op per field), then
        moved by two asynchronous copies. Where the old code made nine small copies and fills,
        each a launch of tens of microseconds of host time, this is two.

        Two mirrors are used in turn: the one written now was last copied from two steps ago,
        and its copy is waited for first (long done: a whole step ran on the GPU since), so a
        mirror is never rewritten while the GPU may still read it. Input ids on the device (a
        step launched ahead: `LLMEngine`) are copied after, from the device."""
        self._turn ^= 1
        wide, narrow, copied = self._mirrors[self._turn]
        if copied is not None:
            copied.synchronize()
        s, n, B = graph.batch, batch.num_tokens, batch.batch_size
        T, S = self._buf["input_ids"].shape[0], self._buf["seq_lens"].shape[0]
        bucket_tokens, bucket_seqs = s.num_tokens, s.batch_size
        w, m = wide.numpy(), narrow.numpy()
        on_device = batch.input_ids.device.type != "cpu"
        if not on_device:
            w[:n] = batch.input_ids.numpy()
        w[n:bucket_tokens] = 0                  # padding tokens: a valid id, written nowhere
        w[T:T + n] = batch.positions.numpy()
        w[2 * T:2 * T + n] = batch.slot_mapping.numpy()
        w[2 * T + n:2 * T + bucket_tokens] = -1
        m[:B] = batch.seq_lens.numpy()
        m[B:bucket_seqs] = 0                    # padding sequences: length 0, attention reads nothing
        tables = m[S:S + S * self.max_blocks].reshape(S, self.max_blocks)
        # Columns past the step's widest table keep stale ids: no length reaches them.
        tables[:B, :batch.block_tables.shape[1]] = batch.block_tables.numpy()
        if s.max_seqlen_q > 1:                  # mixed: the padding sequences have no queries (cu repeats n)
            cu = m[S + S * self.max_blocks:]
            cu[:B + 1] = batch.cu_seqlens_q.numpy()
            cu[B + 1:bucket_seqs + 1] = n
        dev_wide, dev_narrow = self._rows
        dev_wide.copy_(wide, non_blocking=True)
        dev_narrow.copy_(narrow, non_blocking=True)
        if on_device:
            s.input_ids[:n].copy_(batch.input_ids)
        if dev_wide.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self._mirrors[self._turn][2] = event

    def describe(self) -> str:
        """``"eager"``, or the captured graphs by kind and bucket."""
        if not self.graphs:
            return "eager"
        kinds = sorted({k for k, _ in self.graphs})
        return "cuda graphs: " + ", ".join(
            f"{k} {sorted(b for kk, b in self.graphs if kk == k)}" for k in kinds)


def choose_tokens(logits: torch.Tensor, sampling: SamplingTensors | None) -> torch.Tensor:
    """The step's tokens from its logits, eagerly: `sample` with ``sampling``, or the argmax
    when ``sampling`` is ``None`` (what the graphs compute)."""
    return logits.argmax(-1) if sampling is None else sample(logits, sampling)


def _reused_kernel_buffers() -> list:
    """The workspaces flash-decoding reuses across calls (`minillm.kernels.ch07_flash_decoding`):
    the graphs captured their addresses, so the runner holds a reference to each, lest the
    kernel module's cache drop one and its memory go to another tensor."""
    try:
        from minillm.kernels.ch07_flash_decoding import workspace_cache
    except ImportError:
        return []
    return list(workspace_cache().values())
