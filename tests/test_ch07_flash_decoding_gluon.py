"""Chapter 7's Gluon decode kernel (`flash_decode_attention_gluon`) against the float64 reference.

- GPU (sm_90, `make gpu`): Chapter 5's shuffled, NaN-poisoned pools (`minillm.testing.PagedPool`)
  with blocks of 16, 32, 64, 128 and 256 tokens; MHA, GQA 4, 8 and 16; head dims 64 and 128;
  lengths 0, 1, 127, 128, 129 and a few thousand in one batch; one split, several, more
  splits than tiles and the planned count; one program per SM, or three programs each taking
  many units; table entries that are not blocks (read as zeros), lengths past the table
  (clamped). Out and lse against `minillm.reference.ch07_flash_decoding` with the bf16
  tolerance; the arrival counters back at zero after every call, and a second call equal to
  the first.
- CPU: `plan_splits` on hand-computed cases, the scope checks, and (with a Triton whose
  Gluon API the module knows) the kernel compiled for sm_90 with a stand-in driver: one TMA
  copy per block and 64 columns, asynchronous wgmma, register reallocation, the merge's
  atomics only with splits, no spills, shared memory within an SM's.
"""
import numpy as np
import pytest
import torch

from minillm.kernels.ch04_flash_attention_gluon import GLUON_VERSIONS
from minillm.kernels.ch07_flash_decoding import cached_workspace
from minillm.kernels.ch07_flash_decoding_gluon import (
    BLOCK_N, flash_decode_attention_gluon, gluon_decode_applies, plan_splits,
)
from minillm.paged import PAD
from minillm.reference import attention
from minillm.reference import ch07_flash_decoding as ref
from minillm.testing import (
    SM90_COMPILE_PRELUDE, PagedPool, assert_close, compile_for_sm90, random_tensor, sm90_compile_mark, to_numpy,
)

DTYPE = torch.bfloat16


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


hopper_only = pytest.mark.skipif(not _hopper(), reason="Gluon's sm_90 kernel needs an H100/H200")


def reference(q, pool: PagedPool):
    """Exact attention of each sequence's query over its keys: ``(out, lse)``, float64."""
    k, v, tables = pool.numpy()
    o, l, _ = ref.flash_decode_partials(to_numpy(q), k, v, tables, pool.seq_lens, 1, 16)
    return ref.merge_partials(o, l)


def counters_of(batch, q_heads, num_splits, head_dim, device):
    return cached_workspace(batch, q_heads, num_splits, head_dim, device)[2]


# ----------------------------------------------------------------------------------------
# CPU: planning and scope
# ----------------------------------------------------------------------------------------
def test_plan_splits_hand_checked():
    """As many splits as keep every program at one unit, then the fewest with units as long
    (hand-checked cases in tiles of 128 keys)."""
    # 8 units over 132 programs, 256 tiles: at most 16 splits (128 units), 16 tiles each.
    assert plan_splits(1, 8, 32768, 132, 128) == 16
    # 32 units: at most 4 splits (128 units), 8 tiles each.
    assert plan_splits(1, 32, 4096, 132, 128) == 4
    # 256 units already cover 132 programs: no split.
    assert plan_splits(32, 8, 4096, 132, 128) == 1
    assert plan_splits(32, 8, 131072, 132, 128) == 1
    # One unit, 32 tiles, 132 programs: 32 splits of one tile each.
    assert plan_splits(1, 1, 4096, 132, 128) == 32
    # 10 tiles, 7 programs: 7 splits would give units of 2 tiles, and so do 5: the fewer.
    assert plan_splits(1, 1, 1280, 7, 128) == 5
    # A sequence shorter than a tile cannot be split; empty ones neither.
    assert plan_splits(1, 8, 100, 132, 128) == 1
    assert plan_splits(3, 2, 0, 132, 128) == 1
    assert plan_splits(1, 4, 4096, 132, 128, max_splits=6) == 6
    # Brute force over random shapes (the module's tile): the rule as the docstring states it.
    rng = np.random.default_rng(0)
    for _ in range(2000):
        batch, kv, length = int(rng.integers(1, 40)), int(rng.choice([1, 2, 8, 32])), int(rng.integers(0, 200_000))
        programs, max_splits = int(rng.integers(1, 300)), int(rng.choice([128, int(rng.integers(1, 64))]))
        tiles = -(-length // BLOCK_N)
        allowed = [s for s in range(1, max(1, min(max_splits, tiles, programs // (batch * kv))) + 1)]
        per_unit = min(-(-tiles // s) for s in allowed)
        want = min(s for s in allowed if -(-tiles // s) == per_unit)
        assert plan_splits(batch, kv, length, programs, max_splits=max_splits) == want


@pytest.mark.parametrize("change, match", [
    (dict(dtype=torch.float16), "bf16"),
    (dict(head_dim=96), "head_dim"),
    (dict(block_size=8), "block_size"),
    (dict(block_size=48), "block_size"),
    (dict(q_heads=7), "group"),
    (dict(q_heads=130, kv_heads=2), "group"),
])
def test_refuses_inputs_out_of_scope(change, match):
    shape = dict(q_heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=DTYPE)
    shape.update(change)
    q = torch.zeros(2, shape["q_heads"], shape["head_dim"], dtype=shape["dtype"])
    pool = torch.zeros(4, shape["block_size"], shape["kv_heads"], shape["head_dim"], dtype=shape["dtype"])
    with pytest.raises(ValueError, match=match):
        flash_decode_attention_gluon(q, pool, pool, torch.zeros(2, 1, dtype=torch.int32),
                                     torch.zeros(2, dtype=torch.int32), compile_only=True)
    assert not gluon_decode_applies(q, pool, pool)


def test_does_not_apply_off_the_gpu():
    q = torch.zeros(1, 8, 128, dtype=DTYPE)
    pool = torch.zeros(4, 16, 2, 128, dtype=DTYPE)
    assert not gluon_decode_applies(q, pool, pool)
    with pytest.raises(ValueError, match="sm_90"):
        flash_decode_attention_gluon(q, pool, pool, torch.zeros(1, 4, dtype=torch.int32),
                                     torch.ones(1, dtype=torch.int32))


COMPILE_SCRIPT = SM90_COMPILE_PRELUDE + r"""
from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon

facts = {}
for head_dim in (64, 128):
    for block_size in (16, 256):
        for splits in (1, 4):
            q = torch.zeros(2, 8, head_dim, dtype=torch.bfloat16)
            pool = torch.zeros(64, block_size, 2, head_dim, dtype=torch.bfloat16)
            compiled = flash_decode_attention_gluon(q, pool, pool, torch.zeros(2, 8, dtype=torch.int32),
                                                    torch.zeros(2, dtype=torch.int32), num_splits=splits,
                                                    compile_only=True)
            ptx = compiled.asm["ptx"]
            facts[f"{head_dim} {block_size} {splits}"] = {
                "tma": ptx.count("cp.async.bulk.tensor"), "wgmma": ptx.count("wgmma.mma_async"),
                "setmaxnreg": "setmaxnreg" in ptx, "atomics": "atom.global" in ptx,
                "local": "ld.local" in ptx or "st.local" in ptx, "stack": stack_bytes(compiled.asm["cubin"]),
                "shared": compiled.metadata.shared}
json.dump(facts, sys.stdout)
"""


@pytest.fixture(scope="module")
def sm90_compiled():
    return compile_for_sm90(COMPILE_SCRIPT)


@sm90_compile_mark(GLUON_VERSIONS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("splits", [1, 4])
def test_compiles_for_sm90(sm90_compiled, head_dim, block_size, splits):
    """Per K or V tile the loader issues one copy per block (or one per tile when a block
    holds whole tiles) and per 64 columns; the scores and P·V are asynchronous wgmma; the
    loader warp gives its registers to the consumer; the merge's counter (a global atomic)
    only when there are splits to merge; nothing spilled."""
    facts = sm90_compiled[f"{head_dim} {block_size} {splits}"]
    copies_per_tile = (BLOCK_N // min(block_size, BLOCK_N)) * (head_dim // 64)
    assert facts["tma"] == 2 * copies_per_tile  # K and V, unrolled
    assert facts["wgmma"] > 0 and facts["setmaxnreg"]
    assert facts["atomics"] == (splits > 1)
    assert not facts["local"] and facts["stack"] == 0
    assert facts["shared"] <= 227 * 1024


# ----------------------------------------------------------------------------------------
# GPU: against the reference
# ----------------------------------------------------------------------------------------
# (q_heads, kv_heads, head_dim, block_size, seq_lens, num_splits, programs)
CASES = [
    (32, 8, 128, 16, [4097, 1, 129, 0, 128, 127], None, None),  # GQA 4:1, the planned splits
    (32, 8, 128, 16, [2000, 300], 7, 3),                         # 3 programs take 28 units in turn
    (8, 8, 128, 32, [1000, 5, 333], 3, None),                    # MHA, blocks of 32
    (16, 2, 64, 64, [777, 2048], 2, None),                       # GQA 8:1, head dim 64, blocks of 64
    (64, 4, 64, 128, [5000, 1], 40, None),                       # GQA 16:1, more splits than tiles
    (8, 2, 128, 256, [3000, 256, 255], 1, 2),                    # one split: the output directly; 2 programs
    (32, 32, 64, 16, [640, 640], 5, None),                       # MHA, head dim 64, equal lengths
]


def _case_id(c):
    return f"h{c[0]}-kv{c[1]}-d{c[2]}-bs{c[3]}-S{c[5]}-P{c[6]}"


@hopper_only
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,seq_lens,num_splits,programs",
                         [pytest.param(*c, id=_case_id(c)) for c in CASES])
def test_against_reference(q_heads, kv_heads, head_dim, block_size, seq_lens, num_splits, programs, gen, seed):
    device = torch.device("cuda")
    pool = PagedPool(seq_lens, block_size, kv_heads, head_dim, DTYPE, device, gen)
    q = random_tensor((len(seq_lens), q_heads, head_dim), DTYPE, device, gen)
    want_out, want_lse = reference(q, pool)
    out, lse = flash_decode_attention_gluon(q, pool.k, pool.v, pool.tables, pool.lens(device), num_splits=num_splits,
                                            programs=programs)
    assert_close(out, want_out, DTYPE, "out", seed)
    assert_close(lse, want_lse, DTYPE, "lse", seed)
    splits = num_splits or plan_splits(len(seq_lens), kv_heads, pool.tables.shape[1] * block_size,
                                       torch.cuda.get_device_properties(0).multi_processor_count)
    if splits > 1:
        assert not counters_of(len(seq_lens), q_heads, splits, head_dim, device).any(), "counters not reset"
    again, again_lse = flash_decode_attention_gluon(q, pool.k, pool.v, pool.tables, pool.lens(device),
                                                    num_splits=num_splits, programs=programs)
    assert torch.equal(again, out) and torch.equal(again_lse, lse)


@hopper_only
def test_invalid_blocks_read_zeros_and_lengths_are_clamped(gen, seed):
    """A table entry inside a length that is not a block (-1, or past the pool) reads as zero
    keys and values; a length past the table is clamped to the table's capacity."""
    device = torch.device("cuda")
    block_size, q_heads, kv_heads, head_dim = 16, 8, 2, 128
    pool = PagedPool([300, 208], block_size, kv_heads, head_dim, DTYPE, device, gen)  # (208: whole blocks)
    tables = pool.tables.clone()
    tables[0, 3] = PAD
    tables[1, 0] = pool.k.shape[0] + 5
    lens = torch.tensor([300, 10**6], dtype=torch.int32, device=device)
    q = random_tensor((2, q_heads, head_dim), DTYPE, device, gen)
    out, lse = flash_decode_attention_gluon(q, pool.k, pool.v, tables, lens, num_splits=3)
    k, v, _ = pool.numpy()
    k_flat, v_flat = k.reshape(-1, kv_heads, head_dim), v.reshape(-1, kv_heads, head_dim)
    capacity = tables.shape[1] * block_size
    for b, n in enumerate((300, capacity)):
        rows = []
        for pos in range(n):
            blk = int(tables[b, pos // block_size])
            ok = 0 <= blk < pool.k.shape[0]
            rows.append((k_flat[blk * block_size + pos % block_size] if ok else 0 * k_flat[0],
                         v_flat[blk * block_size + pos % block_size] if ok else 0 * v_flat[0]))
        kb = np.nan_to_num(np.stack([r[0] for r in rows]), nan=0.0)
        vb = np.nan_to_num(np.stack([r[1] for r in rows]), nan=0.0)
        o, l = attention(to_numpy(q[b])[None, :, None], kb.transpose(1, 0, 2)[None], vb.transpose(1, 0, 2)[None])
        assert_close(out[b], o[0, :, 0], DTYPE, f"out (sequence {b})", seed)
        assert_close(lse[b], l[0, :, 0], DTYPE, f"lse (sequence {b})", seed)
