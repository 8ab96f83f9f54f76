"""Chapter 13: Megatron-style tensor parallelism (Shoeybi et al., 2019) for the Llama-family model.

``N`` ranks each hold a slice of every weight matrix and run the whole forward pass on their
slice, meeting at two all-reduces per layer:

- **column-parallel** q/k/v and gate/up projections: each rank keeps the *output* rows of its
  heads (its slice of the MLP's intermediate units); its activations are its heads' alone, so
  attention and the SwiGLU product need no communication;
- **row-parallel** o and down projections: each rank keeps the *input* columns that match,
  computes a partial sum of the full output, and an **all-reduce** adds the ``N`` partial sums
  (a bias is added once, by rank 0);
- **vocabulary-parallel** embedding and logits: rank ``r`` holds rows ``[r·V/N, (r+1)·V/N)`` of
  the embedding (and of the LM head, which may be the same tensor): a token outside a rank's
  rows embeds to 0 there, and an all-reduce assembles the embedding; each rank computes the
  logits of its rows, and an all-gather assembles the vocabulary for sampling. The vocabulary
  is padded up to a multiple of ``N`` (padding rows are zero, their logits dropped).
- The norms are replicated.

**Heads** (`head_shard`): the query heads are split evenly (``H % N == 0``). With at least as
many KV heads as ranks (``Hkv % N == 0``), each rank holds ``Hkv / N`` KV heads, the ones its
query heads read. With fewer KV heads than ranks (``N % Hkv == 0``), each KV head is
*replicated* on the ``N / Hkv`` ranks whose query heads read it: every rank holds
``ceil(Hkv / N) = 1`` KV head. Either way a rank's query heads read only its own KV heads, and
each rank's KV pool holds only those, so the per-rank pool is ``Hkv_rank / Hkv`` of the full
pool's bytes per block (`kv_block_bytes` on the shard).

Each rank's model is the book's `minillm.model.LlamaForCausalLM` built with the shard's
config (`shard_config`: its heads, its MLP slice, its vocabulary rows), whose o/down
projections, embedding and LM head are swapped for the parallel layers below. The weights
come from the full checkpoint, sliced at load (`shard_state_dict`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minillm.model.config import ModelConfig
from minillm.model.torch_model import LlamaForCausalLM, Linear

__all__ = ["HeadShard", "ParallelLMHead", "RowParallelLinear", "VocabParallelEmbedding", "build_tp_model",
           "check_tensor_parallel", "head_shard", "kv_head_owners", "load_tp_model", "rank_layer", "shard_config",
           "shard_shapes", "shard_state_dict", "split_range", "vocab_shard"]


# == who holds what ===============================================================================

@dataclass(frozen=True)
class HeadShard:
    """The heads of one rank: query heads ``[q_start, q_end)``, KV heads ``[kv_start, kv_end)``
    (global indices)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_q(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv(self) -> int:
        return self.kv_end - self.kv_start


def check_tensor_parallel(num_heads: int, num_kv_heads: int, world_size: int) -> None:
    """Raise ``ValueError`` unless ``world_size`` ranks can split these heads: ``H % N == 0``, and
    ``Hkv % N == 0`` (KV heads split) or ``N % Hkv == 0`` (KV heads replicated)."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if num_heads % world_size:
        raise ValueError(f"{num_heads} query heads cannot be split over {world_size} ranks "
                         "(tensor_parallel_size must divide num_attention_heads)")
    if num_kv_heads % world_size and world_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be split over {world_size} ranks, nor replicated on "
                         "them: one must divide the other")


def head_shard(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """Rank ``rank``'s query heads (an even, contiguous split) and the KV heads they read: query
    head ``h`` reads KV head ``h // (H / Hkv)``, so the KV heads are ``[q_start // g,
    ceil(q_end / g))`` with ``g = H / Hkv``."""
    check_tensor_parallel(num_heads, num_kv_heads, world_size)
    per, group = num_heads // world_size, num_heads // num_kv_heads
    q_start, q_end = rank * per, (rank + 1) * per
    return HeadShard(q_start, q_end, q_start // group, -(-q_end // group))


def kv_head_owners(num_heads: int, num_kv_heads: int, world_size: int) -> dict[int, list[int]]:
    """``{kv head: [ranks holding it]}``: one rank each when the KV heads are split, several when
    they are replicated."""
    owners: dict[int, list[int]] = {h: [] for h in range(num_kv_heads)}
    for rank in range(world_size):
        s = head_shard(num_heads, num_kv_heads, world_size, rank)
        for h in range(s.kv_start, s.kv_end):
            owners[h].append(rank)
    return owners


def split_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """An even split of ``range(n)``: rank ``rank``'s ``[start, end)`` (the first ``n % N`` ranks
    get one more)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def vocab_shard(vocab_size: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """``(start, end, rows)``: rank ``rank`` holds vocabulary rows ``[start, end)`` in a tensor of
    ``rows = ceil(V / N)`` rows (the last rank's may end in zero padding)."""
    rows = -(-vocab_size // world_size)
    start = min(rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


def shard_config(config: ModelConfig, world_size: int, rank: int) -> ModelConfig:
    """The config of rank ``rank``'s model: its query and KV heads, its MLP slice, its
    vocabulary rows (``hidden_size`` and everything else unchanged)."""
    heads = head_shard(config.num_attention_heads, config.num_key_value_heads, world_size, rank)
    i0, i1 = split_range(config.intermediate_size, world_size, rank)
    return dataclasses.replace(config, num_attention_heads=heads.num_q, num_key_value_heads=heads.num_kv,
                               intermediate_size=i1 - i0,
                               vocab_size=vocab_shard(config.vocab_size, world_size, rank)[2],
                               eos_token_ids=list(config.eos_token_ids))


def shard_shapes(config: ModelConfig, world_size: int, rank: int) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` of rank ``rank``'s shard (the names of the full checkpoint)."""
    from minillm.model.loader import expected_shapes

    return expected_shapes(shard_config(config, world_size, rank))


def shard_state_dict(state: dict[str, torch.Tensor], config: ModelConfig, world_size: int,
                     rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slices of a full state dict (see the module docstring). Each slice is a
    copy, so the full tensors can be freed afterwards."""
    heads = head_shard(config.num_attention_heads, config.num_key_value_heads, world_size, rank)
    d = config.head_dim
    q = slice(heads.q_start * d, heads.q_end * d)
    kv = slice(heads.kv_start * d, heads.kv_end * d)
    mlp = slice(*split_range(config.intermediate_size, world_size, rank))
    v0, v1, rows = vocab_shard(config.vocab_size, world_size, rank)
    out = {}
    for name, t in state.items():
        kind = name.rsplit(".", 1)[-1]                    # "weight" or "bias"
        if ".q_proj." in name:
            t = t[q]
        elif ".k_proj." in name or ".v_proj." in name:
            t = t[kv]
        elif ".gate_proj." in name or ".up_proj." in name:
            t = t[mlp]
        elif ".o_proj." in name or ".down_proj." in name:   # row-parallel: input columns; bias once
            cols = q if ".o_proj." in name else mlp
            t = t[:, cols] if kind == "weight" else (t if rank == 0 else torch.zeros_like(t))
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = t.new_zeros(rows, t.shape[1])
            padded[:v1 - v0] = t[v0:v1]
            t = padded
        out[name] = t.clone()                             # a copy: the slice must not pin the full tensor
    return out


# == the parallel layers ==========================================================================

def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


class RowParallelLinear(Linear):
    """A linear layer whose *input* features are split across the ranks: each computes
    ``x_r @ W_rᵀ`` (a partial sum of the full output) and an all-reduce adds them up. The
    bias (rank 0's; the others hold zeros) is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group=None):
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(super().forward(x))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Add the ranks' partial sums (in place): what `forward` does after its matmul, for a
        caller that computed ``x_r @ W_rᵀ`` with a kernel of its own (Chapter 10's GEMVs)."""
        return _all_reduce(partial, self.group)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, end)`` of the embedding (``weight [rows, hidden]``, zero-padded): a token
    outside them embeds to 0 here, and the all-reduce adds the one rank's row that holds it."""

    def __init__(self, rows: int, hidden: int, start: int, end: int, group=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start, self.end, self.group = start, end, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.end - self.start)
        x = F.embedding(torch.where(inside, local, 0), self.weight)
        x = x * inside.unsqueeze(-1).to(x.dtype)
        return _all_reduce(x, self.group)


class ParallelLMHead(Linear):
    """The logits of rows ``[start, end)`` of the vocabulary on each rank, all-gathered into the
    full vocabulary: ``[..., hidden] -> [..., vocab_size]`` on every rank."""

    def __init__(self, hidden: int, rows: int, vocab_size: int, group=None):
        super().__init__(hidden, rows, bias=False)
        self.vocab_size, self.group = vocab_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather(super().forward(x))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[..., rows]`` logits of this rank's vocabulary rows -> ``[..., vocab_size]`` (every
        rank's rows, the padding dropped): what `forward` does after its matmul, for a caller
        that computed the local logits with a kernel of its own (Chapter 10's fused norm + head)."""
        if not hasattr(self, "_world"):                                 # asked once: the group never changes
            self._world = dist.get_world_size(self.group) if self.group is not None else 1
            self._nccl = self._world > 1 and dist.get_backend(self.group) == "nccl"
        world = self._world
        if world == 1:
            return local[..., :self.vocab_size]
        lead, rows = local.shape[:-1], local.shape[-1]
        flat = local.reshape(-1, rows).contiguous()                    # [M, rows]
        if self._nccl:                                                 # one buffer: capturable in a CUDA graph
            out = flat.new_empty(world * flat.shape[0], rows)
            dist.all_gather_into_tensor(out, flat, group=self.group)
            full = out.view(world, -1, rows).permute(1, 0, 2).reshape(-1, world * rows)
        else:
            parts = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(parts, flat, group=self.group)
            full = torch.cat(parts, dim=-1)
        return full[:, :self.vocab_size].reshape(*lead, self.vocab_size)


# == one rank's model =============================================================================

def build_tp_model(config: ModelConfig, state: dict[str, torch.Tensor], world_size: int, rank: int,
                   device="cpu", dtype: torch.dtype = torch.float32, group=None) -> LlamaForCausalLM:
    """Rank ``rank``'s model: `LlamaForCausalLM` of `shard_config` with the parallel layers, its
    weights sliced from the full ``state`` (HF names; ``lm_head.weight`` absent when tied).
    ``group``: the process group of the collectives (``None`` only for a world of one).

    Its ``config`` is the shard's; ``full_config`` is the checkpoint's. ``forward`` and
    ``forward_paged`` return the logits of the whole vocabulary on every rank."""
    if group is None and world_size > 1:
        raise ValueError("a world of more than one rank needs its process group")
    if getattr(config, "is_mla", False):
        raise ValueError("tensor parallelism here splits Llama/Qwen2 attention heads; an MLA model is not supported")
    sc = shard_config(config, world_size, rank)
    v0, v1, rows = vocab_shard(config.vocab_size, world_size, rank)
    h = config.hidden_size
    with torch.device("meta"):  # no memory, no init: the shard fills it in
        model = LlamaForCausalLM(sc)
        for layer in model.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(sc.num_attention_heads * sc.head_dim, h, sc.o_bias, group)
            layer.mlp.down_proj = RowParallelLinear(sc.intermediate_size, h, sc.mlp_bias, group)
        model.model.embed_tokens = VocabParallelEmbedding(rows, h, v0, v1, group)
        model.lm_head = ParallelLMHead(h, rows, config.vocab_size, group)
    shard = {k: v.to(device=device, dtype=dtype) for k, v in shard_state_dict(state, config, world_size, rank).items()}
    missing, unexpected = model.load_state_dict(shard, strict=False, assign=True)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise ValueError(f"shard of rank {rank}: missing {sorted(set(missing) - allowed)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}")
    model.tie_weights()
    model.full_config = config
    model.tp_rank, model.tp_world_size = rank, world_size
    return model.eval()


def rank_layer(config: ModelConfig, state: dict[str, torch.Tensor], world_size: int, rank: int,
               layer: int = 0) -> tuple[nn.Module, nn.Module]:
    """Rank ``rank``'s attention and MLP of decoder layer ``layer``, as the book's plain
    `minillm.model.torch_model.Attention` and ``MLP`` of the shard's config, without
    collectives: their outputs are the rank's *partial sums*, which the all-reduce would add
    (the chapter and the tests add them by hand, in one process)."""
    from minillm.model.torch_model import MLP, Attention

    sc = shard_config(config, world_size, rank)
    shard = shard_state_dict({k: v for k, v in state.items() if k.startswith(f"model.layers.{layer}.")}, config,
                             world_size, rank)
    attn, mlp = Attention(sc), MLP(sc)
    for module, prefix in ((attn, "self_attn."), (mlp, "mlp.")):
        full = f"model.layers.{layer}.{prefix}"
        module.load_state_dict({k[len(full):]: v for k, v in shard.items() if k.startswith(full)})
    return attn.eval(), mlp.eval()


def load_tp_model(path: str | Path, world_size: int, rank: int, device="cpu", dtype=None,
                  group=None) -> LlamaForCausalLM:
    """Read the checkpoint folder ``path`` (every rank reads the full files; safetensors maps
    them) and build rank ``rank``'s model (`build_tp_model`). ``dtype``: as `load_model`'s."""
    from minillm.model.loader import DTYPES, check_state_dict, load_state_dict

    config = ModelConfig.from_json(Path(path) / "config.json")
    check_tensor_parallel(config.num_attention_heads, config.num_key_value_heads, world_size)
    dtype = dtype or config.dtype or torch.float32
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    state = load_state_dict(path, config)
    check_state_dict(path, config, {k: tuple(v.shape) for k, v in state.items()})
    return build_tp_model(config, state, world_size, rank, device=device, dtype=dtype, group=group)
