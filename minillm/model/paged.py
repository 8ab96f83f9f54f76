"""Chapter 6: the model's side of a paged KV cache: the pools, one step's batch, attention.

Chapter 2's `KVCache` gave every sequence of a batch the same contiguous stretch of slots,
so every sequence had to sit at the same position. With paging (`minillm.paged`), each
sequence owns a list of blocks, sequences have any lengths, and forks share blocks. A forward
step then looks like nano-vllm's:

1. The scheduler (or a decoding loop) asks the `minillm.paged.BlockManager` for slots:
   ``allocate`` a prompt, or ``append_slots`` the tokens just sampled, and performs the block
   copies copy-on-write asks for (`PagedKVCache.copy_blocks`) before anything is written.
2. `PagedBatch.from_manager` flattens the step's new tokens, every sequence's back to back,
   into one batch: their ids, positions and slots, plus each sequence's block table and length.
3. `LlamaForCausalLM.forward_paged` runs the model on that flat batch. In every layer the new
   tokens' K and V go to their slots (`write_kv`), then each new query attends over its own
   sequence's pages (`paged_attention`).

There is no padding anywhere: a prefill of 7 tokens and three decodes of 1 token are a batch
of 10 rows, told apart by ``cu_seqlens_q = [0, 7, 8, 9, 10]``.

Layout (the `minillm.paged` contract): per layer ``k_cache, v_cache: [num_blocks, block_size,
kv_heads, head_dim]``; slot ``block_id * block_size + offset``; block tables int32, ``-1``
padded; slot mappings int64. Chapter 11's virtual cache (`minillm.vmm.manager.SlotKVCache`) is
this layout with one block per sequence (``block_size`` = a slot's capacity, tables of one
column), over memory that is mapped only up to each sequence's length: so nothing here reads
or writes a row past a sequence's tokens, and nothing assumes the pools are one flat run.

Attention backends: on CUDA in fp16/bf16, the Triton kernels: decode steps (one new token
per sequence) run Chapter 7's flash-decoding (`minillm.kernels.ch07_flash_decoding`, each sequence
split over several programs); steps where every sequence is a fresh prompt with nothing
cached (`PagedBatch.fresh_prefill`) run Chapter 4's FlashAttention-2 varlen kernel
(`minillm.kernels.ch04_flash_attention`) on the new tokens' own K/V, which need no block table;
any other step (chunks after a cached prefix, decodes mixed with prefills) runs Chapter 5's
paged prefill kernel (`minillm.kernels.ch05_paged_attention`). Everywhere else, and whenever
those modules cannot be imported, a plain torch version that gathers each sequence's K/V
through its block table and calls SDPA. The torch version is the readable definition; the
kernels must agree with it.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from minillm.model.config import ModelConfig
from minillm.paged import BlockManager, blocks_for, copy_blocks, padded_block_tables

__all__ = ["PagedBatch", "PagedKVCache", "paged_attention", "paged_attention_torch", "write_kv"]

#: Whether SDPA has native GQA (`enable_gqa`, torch >= 2.5); before that the torch attention
#: paths (here and in `minillm.model.torch_model`) repeat the KV heads.
SDPA_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
BACKENDS = ("auto", "torch", "triton")


class _Kernels:
    """The Triton kernels the paged model runs: Chapter 4's FlashAttention-2 (varlen), Chapter
    5's cache write and prefill, Chapter 7's flash-decoding."""

    def __init__(self):
        from minillm.kernels import ch04_flash_attention, ch05_paged_attention, ch07_flash_decoding
        self.write_paged_kv = ch05_paged_attention.write_paged_kv
        self.paged_prefill_attention = ch05_paged_attention.paged_prefill_attention
        self.flash_decode_attention = ch07_flash_decoding.flash_decode_attention
        self.flash_attention_varlen = ch04_flash_attention.flash_attention_varlen


def _triton_kernels() -> _Kernels | None:
    """The kernels, or ``None`` when they cannot be imported (no Triton): attention then falls
    back to torch."""
    try:
        return _Kernels()
    except ImportError:
        return None


class PagedKVCache:
    """The K and V pools of every layer, in one tensor.

    ``pool: [2, layers, num_blocks, block_size, kv_heads, head_dim]``; ``k[layer]`` and
    ``v[layer]`` are views of it, ``[num_blocks, block_size, kv_heads, head_dim]`` each, the
    layout the kernels read. One tensor (as nano-vllm allocates it) lets `copy_blocks` copy a
    block in every layer, for K and for V, with a single indexing operation.

    Args:
        config: the model's config (layers, KV heads, head_dim).
        num_blocks, block_size: the pool's shape; must match the `BlockManager`'s.
        device, dtype: where the pool lives; the model's own, normally.
        backend: ``"auto"`` (Triton kernels on CUDA in fp16/bf16 when importable, torch
            otherwise), ``"torch"``, or ``"triton"`` (force the kernels; on a CPU they run in
            Triton's interpreter, which is how the tests check them without a GPU).
        softmax_phi: FlashDecoding++'s unified max for the decode kernel (Chapter 7; natural-log
            units of the scaled score, see `minillm.experiments.ch07_softmax_stats.choose_phi`), or
            ``None`` for the exact online softmax. Either gives the same outputs (the kernel
            falls back to the exact path where φ does not fit); only the speed may differ.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device=None, dtype=None,
                 backend: str = "auto", softmax_phi: float | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        shape = (2, config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        if getattr(config, "is_mla", False):  # Chapter 12: one plane of latent rows, no separate V
            shape = (1, config.num_hidden_layers, num_blocks, block_size, 1, config.latent_dim)
        self.pool = torch.zeros(shape, device=device, dtype=dtype)
        self.k = list(self.pool[0])  # per layer, [num_blocks, block_size, kv_heads, head_dim]
        self.v = list(self.pool[-1])  # MLA: the same latent rows
        self.kernels = self._pick_kernels(backend)
        self.softmax_phi = softmax_phi

    def _pick_kernels(self, backend: str):
        """The kernel module if attention should use it, else ``None`` (torch)."""
        if backend == "torch":
            return None
        kernels = _triton_kernels()
        if backend == "triton":
            if kernels is None:
                raise ImportError("backend='triton' needs minillm.kernels (and Triton)")
            return kernels
        on_gpu = self.pool.is_cuda and self.pool.dtype in _KERNEL_DTYPES
        return kernels if on_gpu else None

    @property
    def num_blocks(self) -> int:
        return self.pool.shape[2]

    @property
    def block_size(self) -> int:
        return self.pool.shape[3]

    @property
    def block_bytes(self) -> int:
        """Bytes one block id stands for: its rows in every layer, K and V."""
        return self.pool[:, :, 0].numel() * self.pool.element_size()

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: ``block[dst] = block[src]`` for each ``(src, dst)`` pair, in every layer,
        for K and V: one launch of Chapter 6's kernel when the kernels run on a GPU, else one
        batched index copy. Call it with `AppendResult.copies` *before* the step writes its
        new tokens (the copied block is the one they go into)."""
        if self.kernels is not None and self.pool.is_cuda:
            # Chapter 6's Triton kernel: every pair, layer, K and V in one launch.
            from minillm.kernels.ch06_copy_on_write import copy_blocks as copy_blocks_kernel
            copy_blocks_kernel(self.pool, copies)
            return
        # Viewed block-first, the whole pool is one "cache" for the reference `copy_blocks`.
        copy_blocks([self.pool.movedim(2, 0)], copies)


@dataclass(frozen=True)
class PagedBatch:
    """One forward step's new tokens, every sequence's back to back (``total`` rows).

    Attributes:
        input_ids: ``[total]`` int64, the tokens to run.
        positions: ``[total]`` int64, each token's position in its sequence (for RoPE).
        slot_mapping: ``[total]`` int64, where each token's K and V are written.
        cu_seqlens_q: ``[batch + 1]`` int32, sequence ``b``'s rows are ``cu[b] : cu[b + 1]``.
        seq_lens: ``[batch]`` int32, each sequence's length *including* its new tokens (whose
            K/V are written before attention reads them).
        block_tables: ``[batch, max_blocks]`` int32, padded with ``-1``.
        max_seqlen_q: the largest new-token count (1 for a pure decode step).
        max_seq_len: the largest of ``seq_lens``, as a Python int (sizes the decode kernel's
            splits without reading the lengths back from the device); ``None``: unknown.
            An upper bound is enough (a CUDA graph captures its step with ``max_model_len``).
        fresh_prefill: every sequence's new tokens are all of its tokens (nothing cached
            before them): attention then needs only the new tokens' own K/V.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    max_seq_len: int | None = None
    fresh_prefill: bool = False

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def last_token_rows(self) -> torch.Tensor:
        """``[batch]`` int64, the row of each sequence's last new token (whose logits predict
        its next token)."""
        return self.cu_seqlens_q[1:].long() - 1

    def to(self, device) -> PagedBatch:
        """This batch on ``device``, its host tensors moved in one copy per dtype (through
        pinned memory, without waiting: `_to_device`); tensors already there are kept."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:   # a tensor's device always has its index
            device = torch.device("cuda", torch.cuda.current_device())
        moved = {}
        for names in (("input_ids", "positions", "slot_mapping"), ("cu_seqlens_q", "seq_lens", "block_tables")):
            fields = {n: getattr(self, n) for n in names if getattr(self, n).device != device}
            if not fields:
                continue
            flat = torch.cat([t.reshape(-1) for t in fields.values()]).cpu().numpy()
            parts = _to_device(flat, device).split([t.numel() for t in fields.values()])
            moved.update({n: part.view(t.shape) for (n, t), part in zip(fields.items(), parts)})
        return dataclasses.replace(self, **moved) if moved else self

    @classmethod
    def from_manager(cls, manager: BlockManager, seq_ids: Sequence, num_new_tokens: int | Sequence[int] = 1, *,
                     device=None, max_blocks: int | None = None) -> PagedBatch:
        """The batch of the last ``num_new_tokens[i]`` tokens of each sequence ``seq_ids[i]``.

        The tokens must already be in the manager (``allocate`` for a prompt, ``append_slots``
        for decoded tokens): their slots are known, and the batch only reads them. For a
        prompt, the new tokens are those past the prefix cache's hit: ``len(prompt) - cached``.

        Args:
            manager: the block manager holding the sequences.
            seq_ids: the sequences of this step, in batch order.
            num_new_tokens: per sequence (or one count for all), at least 1.
            device: where the tensors go (the model's device).
            max_blocks: block-table width; defaults to the longest table.
        """
        seq_ids = list(seq_ids)
        counts = [num_new_tokens] * len(seq_ids) if isinstance(num_new_tokens, int) else list(num_new_tokens)
        if len(counts) != len(seq_ids):
            raise ValueError(f"{len(seq_ids)} sequences but {len(counts)} new-token counts")
        # Both of minillm's managers gather the step in one pass (`BlockManager.step_inputs`);
        # any other object with the manager's read-only views works too, one view at a time.
        gather = getattr(manager, "step_inputs", None)
        ids, positions, slots, lens, tables = (gather(seq_ids, counts) if gather is not None
                                               else _step_inputs(manager, seq_ids, counts))
        cu = list(itertools.accumulate(counts, initial=0))
        # Two host-to-device copies per step, not six: the int64 rows, then the int32 rest. Each
        # field starts 16 bytes into its buffer times a whole number: Triton compiles a kernel
        # per alignment of its pointers, and a field whose alignment followed the batch size
        # would make an engine without CUDA graphs compile new variants inside its steps.
        device = torch.device(device or "cpu")
        total, batch = len(ids), len(lens)
        t, b = _aligned(total, 2), _aligned(batch + 1, 4)      # 2 int64 or 4 int32 per 16 bytes
        wide = np.zeros(3 * t, dtype=np.int64)
        wide[:total], wide[t:t + total], wide[2 * t:2 * t + total] = ids, positions, slots
        table = padded_block_tables(tables, max_blocks)                               # numpy int32
        narrow = np.zeros(2 * b + table.size, dtype=np.int32)
        narrow[:batch + 1], narrow[b:b + batch], narrow[2 * b:] = cu, lens, table.ravel()
        wide, narrow = _to_device(wide, device), _to_device(narrow, device)
        return cls(
            input_ids=wide[:total],
            positions=wide[t:t + total],
            slot_mapping=wide[2 * t:2 * t + total],
            cu_seqlens_q=narrow[:batch + 1],
            seq_lens=narrow[b:b + batch],
            block_tables=narrow[2 * b:].view(table.shape),
            max_seqlen_q=max(counts, default=0),
            max_seq_len=max(lens, default=0),
            fresh_prefill=bool(lens) and lens == counts,
        )


def _step_inputs(manager, seq_ids: list, counts: list[int]
                 ) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
    """`BlockManager.step_inputs` through the manager's read-only views (``num_tokens``,
    ``token_ids``, ``slot_mapping``, ``block_table``), for a manager without it."""
    ids, positions, slots, lens, tables = [], [], [], [], []
    for seq_id, n in zip(seq_ids, counts):
        length = manager.num_tokens(seq_id)
        if not 1 <= n <= length:
            raise ValueError(f"sequence {seq_id!r} has {length} tokens; cannot run its last {n}")
        start = length - n
        ids.extend(manager.token_ids(seq_id)[start:])
        positions.extend(range(start, length))
        slots.extend(manager.slot_mapping(seq_id, start))
        tables.append(manager.block_table(seq_id))
        lens.append(length)
    return ids, positions, slots, lens, tables


def _aligned(n: int, per_16_bytes: int) -> int:
    """``n`` rounded up to a whole number of 16-byte units of ``per_16_bytes`` elements."""
    return -(-n // per_16_bytes) * per_16_bytes


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A fresh host array as a tensor on ``device``. To CUDA through pinned memory and without
    waiting: a copy from pageable memory blocks the host until the GPU has finished everything
    queued before it (the pinned buffer is not reused before the copy is done: torch's pinned
    allocator records the copy)."""
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host.to(device)
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)


def write_kv(cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' ``k, v: [total, kv_heads, head_dim]`` of ``layer`` into their slots
    ``slot_mapping: [total]`` (``-1``: write nothing)."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    if cache.kernels is not None:
        cache.kernels.write_paged_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # (block, offset) indexing writes in place whatever the strides (a slot cache of Chapter 11
    # in virtual memory need not be one flat run of rows).
    bs = k_cache.shape[1]
    blocks, offsets = slots // bs, slots % bs
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, batch: PagedBatch,
                    scale: float | None = None, k: torch.Tensor | None = None,
                    v: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """Each new query attends over its own sequence's pages, causally: ``q [total, q_heads,
    head_dim] -> [total, q_heads, head_dim]``.

    Query ``i`` of sequence ``b`` sits at position ``seq_lens[b] - q_len_b + i`` (bottom-right
    alignment: the new tokens come last) and sees keys ``0 ..`` that position. The new tokens'
    K/V must already be written (`write_kv`).

    ``k, v [total, kv_heads, head_dim]``: the new tokens' K/V as `write_kv` got them
    (optional). A `PagedBatch.fresh_prefill` step on the kernels runs FlashAttention-2 varlen
    on them (when not given, they are read back from their slots: one gather each).

    ``pdl``: a decode step's kernel is launched as a programmatic dependent launch (Chapter
    10's fused step on Hopper, `minillm.kernels.ch10_fused_decode.pdl_enabled`).
    """
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    kernels = cache.kernels
    if kernels is None:
        return paged_attention_torch(q, k_cache, v_cache, batch, scale)
    if batch.max_seqlen_q == 1:  # one new token per sequence: flash-decoding
        return kernels.flash_decode_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale,
                                              max_seq_len=batch.max_seq_len, phi=cache.softmax_phi, pdl=pdl)[0]
    if batch.fresh_prefill:  # nothing cached before the new tokens: plain varlen attention over them
        if k is None or v is None:
            k = k_cache.view(-1, *k_cache.shape[2:])[batch.slot_mapping]
            v = v_cache.view(-1, *v_cache.shape[2:])[batch.slot_mapping]
        cu = batch.cu_seqlens_q
        return kernels.flash_attention_varlen(q, k.to(q.dtype), v.to(q.dtype), cu, cu, batch.max_seqlen_q,
                                              batch.max_seqlen_q, causal=True, scale=scale)
    return kernels.paged_prefill_attention(q, batch.cu_seqlens_q, k_cache, v_cache, batch.block_tables,
                                           batch.seq_lens, batch.max_seqlen_q, causal=True, scale=scale)[0]


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                          scale: float | None = None) -> torch.Tensor:
    """`paged_attention` in plain torch, one sequence at a time: gather its K/V through its
    block table, then SDPA with a bottom-right causal mask. ``q [total, q_heads, head_dim]``,
    ``k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]``."""
    out = torch.empty_like(q)
    cu, lens = batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist()
    for b, (start, end, seq_len) in enumerate(zip(cu, cu[1:], lens)):
        k = gather_sequence(k_cache, batch.block_tables[b], seq_len)                      # [S, Hkv, D]
        v = gather_sequence(v_cache, batch.block_tables[b], seq_len)
        out[start:end] = _causal_attention(q[start:end], k, v, scale)
    return out


def gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` rows of one sequence, read through its ``block_table [max_blocks]``:
    ``cache [num_blocks, block_size, ...] -> [seq_len, ...]``."""
    bs = cache.shape[1]
    blocks = block_table[:blocks_for(seq_len, bs)].long()
    if bool((blocks < 0).any()):  # -1 would silently read the pool's last block
        raise ValueError(f"the block table has padding (-1) within the sequence's {seq_len} tokens")
    # Exactly the sequence's rows, not its whole last block: past them, a block of Chapter 11's
    # virtual cache (one slot) may not be mapped, and reading it would fault.
    positions = torch.arange(seq_len, device=cache.device)
    return cache[blocks[positions // bs], positions % bs]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``q [T, H, D]`` (the last ``T`` of the ``S`` positions) over ``k, v [S, Hkv, D]`` -> ``[T, H, D]``."""
    T, S = q.shape[0], k.shape[0]
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)                    # heads first
    mask = None
    if T > 1:  # query i sits at position S - T + i and sees keys up to it
        mask = torch.arange(S, device=q.device)[None, :] <= torch.arange(S - T, S, device=q.device)[:, None]
    group = q.shape[0] // k.shape[0]
    gqa = {}
    if group > 1 and SDPA_GQA:
        gqa = {"enable_gqa": True}
    elif group > 1:
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **gqa)    # [H, T, D]
    return out.transpose(0, 1)
