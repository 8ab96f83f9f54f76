"""Chapter 13 solutions. Try the exercises in ``exercises/ch13.py`` first."""
from __future__ import annotations

import torch

__all__ = ["heads_of_rank", "layer_shard_shapes", "vocab_parallel_embedding"]


def heads_of_rank(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> tuple[range, range]:
    """Exercise 13.1: an even split of the query heads; the KV heads they read."""
    if num_heads % world_size:
        raise ValueError(f"{num_heads} query heads do not split over {world_size} ranks")
    if num_kv_heads % world_size and world_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads can be neither split over nor replicated on {world_size} ranks")
    per, group = num_heads // world_size, num_heads // num_kv_heads
    q_start, q_end = rank * per, (rank + 1) * per
    return range(q_start, q_end), range(q_start // group, -(-q_end // group))   # ceil: the last head's KV head


def layer_shard_shapes(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                       world_size: int, rank: int) -> dict[str, tuple[int, int]]:
    """Exercise 13.2: output rows for the column-parallel layers, input columns for the
    row-parallel ones."""
    q, kv = heads_of_rank(num_heads, num_kv_heads, world_size, rank)
    base, extra = divmod(intermediate, world_size)
    units = base + (rank < extra)
    q_width, kv_width = len(q) * head_dim, len(kv) * head_dim
    return {"q_proj": (q_width, hidden), "k_proj": (kv_width, hidden), "v_proj": (kv_width, hidden),
            "o_proj": (hidden, q_width), "gate_proj": (units, hidden), "up_proj": (units, hidden),
            "down_proj": (hidden, units)}


def vocab_parallel_embedding(ids: torch.Tensor, weight_shard: torch.Tensor, start: int) -> torch.Tensor:
    """Exercise 13.3: look up the ids this rank holds, zeros for the rest."""
    local = ids - start
    inside = (local >= 0) & (local < weight_shard.shape[0])
    rows = weight_shard[torch.where(inside, local, torch.zeros_like(local))]      # any valid row for the others
    return rows * inside.unsqueeze(-1).to(weight_shard.dtype)
