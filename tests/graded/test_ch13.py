"""Graded tests for Chapter 13 (tensor parallelism). Run: `make grade CH=13`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run (the seed is in every
failure message; pin it with ``MINILLM_SEED``). The oracles are the book's
`minillm.distributed.tp`: `head_shard` for 13.1, `shard_shapes` for 13.2,
`VocabParallelEmbedding` and the full embedding for 13.3.
"""
import dataclasses

import numpy as np
import pytest
import torch

from minillm.distributed.tp import VocabParallelEmbedding, head_shard, shard_shapes, vocab_shard
from minillm.model import ModelConfig

heads_ex = pytest.mark.exercise(id="13.1", title="Which query and KV heads a rank holds", points=2)
shapes_ex = pytest.mark.exercise(id="13.2", title="The shard shapes of one decoder layer", points=2)
embed_ex = pytest.mark.exercise(id="13.3", title="A rank's part of the vocabulary-parallel embedding", points=2)


def random_split(rng) -> tuple[int, int, int]:
    """``(H, Hkv, N)`` that tensor parallelism can split: KV heads split or replicated."""
    world = int(rng.choice([1, 2, 4, 8]))
    if rng.random() < 0.5:    # at least as many KV heads as ranks
        kv = world * int(rng.integers(1, 4))
    else:                     # fewer: replicated
        kv = int(rng.choice([d for d in (1, 2, 4, 8) if world % d == 0]))
    heads = kv * int(rng.integers(1, 5))
    while heads % world:
        heads += kv
    return heads, kv, world


# --- 13.1 ------------------------------------------------------------------------------------------

@heads_ex
def test_heads_match_the_book(impl, seed):
    rng = np.random.default_rng(seed)
    for case in range(200):
        heads, kv, world = random_split(rng)
        for rank in range(world):
            want = head_shard(heads, kv, world, rank)
            q, k = impl.heads_of_rank(heads, kv, world, rank)
            msg = f"(H={heads}, Hkv={kv}, N={world}, rank {rank}; seed {seed}, case {case})"
            assert isinstance(q, range) and isinstance(k, range), f"return two ranges {msg}"
            assert (q.start, q.stop) == (want.q_start, want.q_end), f"query heads {q}, want " \
                f"range({want.q_start}, {want.q_end}) {msg}"
            assert (k.start, k.stop) == (want.kv_start, want.kv_end), f"KV heads {k}, want " \
                f"range({want.kv_start}, {want.kv_end}) {msg}"


@heads_ex
def test_fewer_kv_heads_than_ranks_are_replicated(impl):
    # Llama-3-70B-like: 8 KV heads over 16 ranks: each KV head on two ranks
    owners = {}
    for rank in range(16):
        q, k = impl.heads_of_rank(64, 8, 16, rank)
        assert len(q) == 4 and len(k) == 1, f"rank {rank}: {q}, {k}"
        owners.setdefault(k.start, []).append(rank)
    assert owners == {h: [2 * h, 2 * h + 1] for h in range(8)}
    assert impl.heads_of_rank(4, 1, 2, 1) == (range(2, 4), range(0, 1))     # MQA: the one KV head everywhere


@heads_ex
@pytest.mark.parametrize("heads,kv,world", [(6, 6, 4), (12, 4, 8), (4, 2, 3), (32, 8, 3)])
def test_impossible_splits_raise(impl, heads, kv, world):
    with pytest.raises(ValueError):
        impl.heads_of_rank(heads, kv, world, 0)


# --- 13.2 ------------------------------------------------------------------------------------------

NAMES = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
         "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
         "down_proj": "mlp.down_proj"}


@shapes_ex
def test_shapes_match_the_book(impl, seed):
    rng = np.random.default_rng(seed)
    for case in range(100):
        heads, kv, world = random_split(rng)
        head_dim, hidden = int(rng.choice([16, 32, 64, 128])), int(rng.integers(1, 9)) * 64
        intermediate = int(rng.integers(world, 4096))
        config = ModelConfig(model_type="llama", vocab_size=1000, hidden_size=hidden, intermediate_size=intermediate,
                             num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim)
        for rank in range(world):
            want = shard_shapes(config, world, rank)
            got = impl.layer_shard_shapes(hidden, heads, kv, head_dim, intermediate, world, rank)
            msg = (f"(hidden={hidden}, H={heads}, Hkv={kv}, head_dim={head_dim}, intermediate={intermediate}, "
                   f"N={world}, rank {rank}; seed {seed}, case {case})")
            assert set(got) == set(NAMES), f"keys {sorted(got)} {msg}"
            for name, full in NAMES.items():
                assert tuple(got[name]) == want[f"model.layers.0.{full}.weight"], f"{name}: {got[name]} {msg}"


@shapes_ex
def test_llama_3_2_1b_over_two_ranks(impl):
    got = impl.layer_shard_shapes(2048, 32, 8, 64, 8192, 2, 1)
    assert got == {"q_proj": (1024, 2048), "k_proj": (256, 2048), "v_proj": (256, 2048), "o_proj": (2048, 1024),
                   "gate_proj": (4096, 2048), "up_proj": (4096, 2048), "down_proj": (2048, 4096)}


# --- 13.3 ------------------------------------------------------------------------------------------

@embed_ex
def test_embedding_parts_add_up(impl, seed):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    for case in range(20):
        vocab, hidden, world = int(rng.integers(2, 300)), int(rng.integers(1, 48)), int(rng.integers(1, 6))
        full = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
        ids = torch.randint(0, vocab, tuple(int(s) for s in rng.integers(1, 6, int(rng.integers(1, 3)))), generator=gen)
        total = torch.zeros(*ids.shape, hidden, dtype=torch.float64)
        for rank in range(world):
            start, end, rows = vocab_shard(vocab, world, rank)
            shard = torch.zeros(rows, hidden, dtype=torch.float64)
            shard[:end - start] = full[start:end]
            part = impl.vocab_parallel_embedding(ids, shard, start)
            layer = VocabParallelEmbedding(rows, hidden, start, end)
            with torch.no_grad():
                layer.weight.copy_(shard.float())
            msg = f"(vocab {vocab}, {world} ranks, rank {rank}, ids shape {tuple(ids.shape)}; seed {seed}, case {case})"
            assert part.shape == (*ids.shape, hidden) and part.dtype == torch.float64, f"shape/dtype {msg}"
            torch.testing.assert_close(part.float(), layer(ids), msg=lambda m: f"{m} {msg}")
            total += part
        torch.testing.assert_close(total, full[ids], msg=lambda m: f"the ranks' parts do not add up: {m}")


@embed_ex
def test_a_token_of_another_rank_is_zero(impl):
    shard = torch.arange(12.0).view(4, 3) + 1                   # rows 8..11 of the vocabulary
    out = impl.vocab_parallel_embedding(torch.tensor([[7, 8, 11, 12]]), shard, 8)
    torch.testing.assert_close(out, torch.stack([torch.zeros(3), shard[0], shard[3], torch.zeros(3)])[None])
