"""Chapter 13 exercises: the bookkeeping of tensor parallelism. Grade your work with
``make grade CH=13``.

Replace each ``raise NotImplementedError(...)`` with your implementation, in plain Python
(and torch for Exercise 13.3). The tests compare your functions with the book's
`minillm.distributed.tp`: Exercise 13.1 with `head_shard`, Exercise 13.2 with `shard_shapes`,
Exercise 13.3 with `VocabParallelEmbedding` (and the sum over the ranks with the full
embedding).
"""
from __future__ import annotations

import torch

__all__ = ["heads_of_rank", "layer_shard_shapes", "vocab_parallel_embedding"]


# == Exercise 13.1: which heads a rank holds ======================================================

def heads_of_rank(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> tuple[range, range]:
    """The query heads and the KV heads rank ``rank`` of ``world_size`` holds.

    The ``num_heads`` query heads are split evenly and contiguously: rank ``r`` holds
    ``H / N`` of them, starting at ``r · H / N``. Query head ``h`` reads KV head ``h // g``,
    with ``g = H / Hkv`` query heads per KV head; a rank holds exactly the KV heads its query
    heads read. With at least as many KV heads as ranks they are split too; with fewer, a KV
    head is *replicated* on every rank whose query heads read it.

    Args:
        num_heads, num_kv_heads: ``H`` and ``Hkv`` (``H`` a multiple of ``Hkv``).
        world_size, rank: ``N`` ranks, and which one.

    Returns:
        ``(query_heads, kv_heads)``: two ``range`` objects of global head indices.

    Raises:
        ValueError: ``H`` is not a multiple of ``N``, or neither of ``Hkv`` and ``N`` divides
            the other.
    """
    raise NotImplementedError("Exercise 13.1 (heads_of_rank): not started. Read its docstring; hints: python -m minillm.grade 13 --hint 13.1")


# == Exercise 13.2: the shapes of one rank's layer ================================================

def layer_shard_shapes(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                       world_size: int, rank: int) -> dict[str, tuple[int, int]]:
    """The weight shapes of rank ``rank``'s shard of one decoder layer, in PyTorch's
    ``[out_features, in_features]`` layout.

    Column-parallel (q/k/v, gate/up): the rank keeps the output rows of its heads (Exercise
    13.1) or of its slice of the MLP's ``intermediate`` units. Row-parallel (o, down): it keeps
    the matching input columns. The MLP units are split as evenly as possible: the first
    ``intermediate % N`` ranks get one unit more than the others.

    Returns:
        ``{"q_proj": ..., "k_proj": ..., "v_proj": ..., "o_proj": ..., "gate_proj": ...,
        "up_proj": ..., "down_proj": ...}``, each a ``(out, in)`` tuple.
    """
    raise NotImplementedError("Exercise 13.2 (layer_shard_shapes): not started. Read its docstring; hints: python -m minillm.grade 13 --hint 13.2")


# == Exercise 13.3: one rank's part of the embedding ==============================================

def vocab_parallel_embedding(ids: torch.Tensor, weight_shard: torch.Tensor, start: int) -> torch.Tensor:
    """One rank's contribution to the embedding of ``ids``.

    The rank holds vocabulary rows ``[start, start + rows)`` as ``weight_shard [rows, hidden]``.
    A token in that range embeds to its row; any other token embeds to zeros here (another
    rank holds it). Summed over the ranks (the all-reduce), every token gets exactly its row.

    Args:
        ids: token ids of any shape ``[...]`` (int64, global ids).
        weight_shard: ``[rows, hidden]``.
        start: the global id of the shard's first row.

    Returns:
        ``[..., hidden]`` in ``weight_shard``'s dtype.
    """
    raise NotImplementedError("Exercise 13.3 (vocab_parallel_embedding): not started. Read its docstring; hints: python -m minillm.grade 13 --hint 13.3")
