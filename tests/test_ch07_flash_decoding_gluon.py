"""Chapter 7's Gluon decode kernel (`flash_decode_attention_gluon`) against the float64 reference.

- GPU (sm_90, `make gpu`): Chapter 5's shuffled, NaN-poisoned pools (`minillm.testing.PagedPool`)
  with blocks of 16, 32, 64, 128 and 256 tokens; MHA, GQA 4, 8 and 16; head dims 64 and 128;
  lengths 0, 1, 127, 128, 129 and a few thousand in one batch; the units (one split, several,
  more splits than tiles, the planned count; one program per SM, or a few taking many units)
  and the balanced line (one program per SM, a few programs whose chunks hold many units, a
  batch of more than 128 sequences, which the kernel's scan of the lengths takes in several
  steps, one program for the whole line); table entries that are not
  blocks (read as zeros), lengths past the table (clamped); every case on both pool layouts
  (NHD, and HND: the same values with each block's heads before its tokens), and on NHD with
  the pipelined consumer (scores of tile j beside P·V of tile j-1). Out and lse against
  `minillm.reference.ch07_flash_decoding` with the bf16 tolerance; the arrival counters back
  at zero after every call, and a second call equal to the first; the polling merge (its slots
  marked empty again after every call), the claimed and the stolen tiles (every
  ``claim_first``, the claim words back at zero; a second call within the tolerance, since the
  tiles may go to other programs; runs that two programs must have emptied before their owners
  came), all three also replayed in a CUDA graph.
- CPU: `plan_splits` on hand-computed cases; the argument checks; the balanced work line
  (`minillm.reference.ch07_flash_decoding.work_line_pieces`) covers every key once and cuts no
  unit into more pieces than `balanced_slots`; the scope checks; and (with a Triton whose
  Gluon API the module knows) the kernel compiled for sm_90 with a stand-in driver: one TMA
  copy per block and 64 columns, asynchronous wgmma, register reallocation, the merge's
  atomics only where a unit can have several pieces (and the claims' with ``schedule="claim"``
  and ``"steal"``), no spills, shared memory within an SM's.
"""
import numpy as np
import pytest
import torch

from minillm.kernels.base import triton
from minillm.kernels.ch04_flash_attention_gluon import GLUON_VERSIONS
from minillm.kernels.ch07_flash_decoding import cached_empty_workspace, cached_workspace
from minillm.kernels.ch07_flash_decoding_gluon import (
    BLOCK_N, EMPTY_SLOT_BITS, KV_LAYOUTS, TIMELINE_EVENTS, as_token_major, balanced_slots, claim_counters,
    flash_decode_attention_gluon, gluon_decode_applies, new_timeline, plan_splits, steal_words, to_head_major,
)
from minillm.paged import PAD
from minillm.reference import attention
from minillm.reference import ch07_flash_decoding as ref
from minillm.reference.ch05_paged_attention import paged_decode_attention
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


def slots_not_empty(batch, q_heads, num_splits, head_dim, device) -> int:
    """How many slots of the polling merge's workspace do not hold the empty marker."""
    o_part, lse_part = cached_empty_workspace(batch, q_heads, num_splits, head_dim, device, EMPTY_SLOT_BITS)
    return sum(int((t.view(torch.int32) != EMPTY_SLOT_BITS).sum()) for t in (o_part, lse_part))


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


def test_work_line_covers_every_key_once():
    """The balanced schedule on random batches: every unit's pieces are numbered 0..n-1, their
    key ranges tile ``[0, len)`` (length clamped to the capacity), no unit has more pieces than
    `balanced_slots` (the workspace the launcher allocates), and no program gets more than
    ``⌈line / P⌉`` boxes."""
    rng = np.random.default_rng(0)
    for _ in range(1500):
        batch, kv, programs = int(rng.integers(1, 12)), int(rng.choice([1, 2, 8, 32])), int(rng.integers(1, 200))
        box, capacity = int(rng.choice([16, 64])), int(rng.integers(0, 5000))
        lens = rng.integers(0, 2 * capacity + 1, batch)
        pieces = ref.work_line_pieces(lens, kv, programs, box, capacity)
        line = kv * sum(max(-(-min(int(n), capacity) // box), 1) for n in lens)
        units: dict[tuple, list] = {}
        for program in pieces:
            boxes = sum(max(-(-(hi - lo) // box), 0) for *_, lo, hi, _, _ in program)
            assert boxes <= -(-line // programs)
            for b, h, lo, hi, part, n_parts in program:
                units.setdefault((b, h), []).append((part, n_parts, lo, hi))
        assert len(units) == batch * kv
        slots = balanced_slots(programs, kv, -(-capacity // box))
        for (b, _h), got in units.items():
            assert sorted(p for p, *_ in got) == list(range(got[0][1])) and got[0][1] <= slots
            end = 0
            for lo, hi in sorted((lo, hi) for _, _, lo, hi in got if hi > lo):
                assert lo == end
                end = hi
            assert end == min(int(lens[b]), capacity)


def test_work_line_hand_checked():
    """Batch 1, 8 KV heads, 32k keys in boxes of 16 on 132 programs: 16384 boxes, chunks of
    125 (2000 keys); the first unit (boxes 0-2047) meets chunks 0-16, program 16 finishes it
    and starts the second; the last unit (boxes 14336-16383) meets chunks 114-131, and the
    last chunk holds its final 9 boxes."""
    pieces = ref.work_line_pieces([32768], 8, 132, 16)
    assert pieces[0] == [(0, 0, 0, 2000, 0, 17)]
    assert pieces[16] == [(0, 0, 32000, 32768, 16, 17), (0, 1, 0, 1232, 0, 17)]
    assert pieces[131] == [(0, 7, 32624, 32768, 17, 18)]


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


@pytest.mark.parametrize("kw, match", [(dict(schedule="waves"), "schedule"),
                                       (dict(schedule="line", num_splits=4), "num_splits"),
                                       (dict(num_splits=0), "num_splits"),
                                       (dict(kv_layout="nhd"), "kv_layout"),
                                       (dict(merge="atomics"), "merge"),
                                       (dict(schedule="line", merge="launch"), "merge"),
                                       (dict(schedule="line", merge="poll"), "merge"),
                                       (dict(merge="poll", num_splits=4, programs=15), "a program per piece"),
                                       (dict(schedule="claim", merge="launch"), "merge='last' only"),
                                       (dict(schedule="claim", merge="poll"), "merge='last' only"),
                                       (dict(schedule="claim", claim_first=-1), "claim_first"),
                                       (dict(schedule="claim", claim_first=1.5), "claim_first"),
                                       (dict(schedule="steal", merge="launch"), "merge='last' only"),
                                       (dict(schedule="steal", merge="poll"), "merge='last' only"),
                                       (dict(schedule="steal", num_splits=129), "at most 128 splits")])
def test_refuses_bad_schedules(kw, match):
    q = torch.zeros(2, 8, 64, dtype=DTYPE)
    pool = torch.zeros(4, 16, 2, 64, dtype=DTYPE)
    with pytest.raises(ValueError, match=match):
        flash_decode_attention_gluon(q, pool, pool, torch.zeros(2, 1, dtype=torch.int32),
                                     torch.zeros(2, dtype=torch.int32), compile_only=True, **kw)


def test_head_major_pools():
    """An HND pool is read through its token-major view (the shapes the checks see), must be
    contiguous as stored, and is refused where its shape does not fit the scope."""
    q = torch.zeros(2, 8, 64, dtype=DTYPE)
    hnd = torch.zeros(4, 2, 16, 64, dtype=DTYPE)   # [num_blocks, kv_heads, block_size, head_dim]
    assert as_token_major(hnd, "HND").shape == (4, 16, 2, 64) and as_token_major(hnd, "NHD") is hnd
    nhd = torch.randn(4, 16, 2, 64)
    assert torch.equal(as_token_major(to_head_major(nhd), "HND"), nhd)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    assert not gluon_decode_applies(q, hnd, hnd, "HND")  # (no GPU here; the sm_90 compile is tested below)
    with pytest.raises(ValueError, match="contiguous"):
        strided = as_token_major(torch.zeros(4, 16, 2, 64, dtype=DTYPE), "HND")  # an NHD pool's HND-shaped view
        flash_decode_attention_gluon(q, strided, strided, tables, lens, kv_layout="HND", compile_only=True)
    with pytest.raises(ValueError, match="block_size"):  # 8-token blocks, seen through the HND axes
        odd = torch.zeros(4, 2, 8, 64, dtype=DTYPE)
        flash_decode_attention_gluon(q, odd, odd, tables, lens, kv_layout="HND", compile_only=True)


def test_does_not_apply_off_the_gpu():
    q = torch.zeros(1, 8, 128, dtype=DTYPE)
    pool = torch.zeros(4, 16, 2, 128, dtype=DTYPE)
    assert not gluon_decode_applies(q, pool, pool)
    with pytest.raises(ValueError, match="sm_90"):
        flash_decode_attention_gluon(q, pool, pool, torch.zeros(1, 4, dtype=torch.int32),
                                     torch.ones(1, dtype=torch.int32))


COMPILE_SCRIPT = SM90_COMPILE_PRELUDE + r"""
import itertools

from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon, new_timeline

facts = {}
for head_dim, block_size, splits, variant in itertools.product((64, 128), (16, 256), (1, 4, "line"),
                                                               ("NHD", "HND", "pipelined")):
    layout = "HND" if variant == "HND" else "NHD"     # the pipelined consumer on the NHD pool
    q = torch.zeros(2, 8, head_dim, dtype=torch.bfloat16)
    shape = (64, block_size, 2, head_dim) if layout == "NHD" else (64, 2, block_size, head_dim)
    pool = torch.zeros(shape, dtype=torch.bfloat16)
    compiled = flash_decode_attention_gluon(q, pool, pool, torch.zeros(2, 8, dtype=torch.int32),
                                            torch.zeros(2, dtype=torch.int32),
                                            schedule="line" if splits == "line" else "units",
                                            num_splits=None if splits == "line" else splits,
                                            kv_layout=layout, pipeline=variant == "pipelined", compile_only=True)
    ptx = compiled.asm["ptx"]
    facts[f"{head_dim} {block_size} {splits} {variant}"] = {
        "partial_waits": sum(ptx.count(f"wgmma.wait_group.sync.aligned {n};") for n in (1, 2)),
        "tma": ptx.count("cp.async.bulk.tensor"), "wgmma": ptx.count("wgmma.mma_async"),
        "setmaxnreg": "setmaxnreg" in ptx, "atomics": "atom.global" in ptx,
        "local": "ld.local" in ptx or "st.local" in ptx, "stack": stack_bytes(compiled.asm["cubin"]),
        "shared": compiled.metadata.shared}
for merge in ("launch", "launch_pdl", "poll"):  # the splits merged by a second launch, or polling
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    pool = torch.zeros((64, 16, 2, 128), dtype=torch.bfloat16)
    compiled = flash_decode_attention_gluon(q, pool, pool, torch.zeros(2, 8, dtype=torch.int32),
                                            torch.zeros(2, dtype=torch.int32), num_splits=4, merge=merge,
                                            compile_only=True)
    ptx = compiled.asm["ptx"]
    facts[f"merge {merge}"] = {
        "atomics": "atom.global" in ptx, "trigger": "griddepcontrol.launch_dependents" in ptx,
        "volatile": "ld.volatile.global" in ptx,
        "local": "ld.local" in ptx or "st.local" in ptx, "stack": stack_bytes(compiled.asm["cubin"])}
# a unit's tiles claimed as its programs go, or stolen from the back of its runs
for schedule, head_dim, splits in itertools.product(("claim", "steal"), (64, 128), (1, 4)):
    q = torch.zeros(2, 8, head_dim, dtype=torch.bfloat16)
    pool = torch.zeros((64, 16, 2, head_dim), dtype=torch.bfloat16)
    compiled = flash_decode_attention_gluon(q, pool, pool, torch.zeros(2, 8, dtype=torch.int32),
                                            torch.zeros(2, dtype=torch.int32), num_splits=splits, schedule=schedule,
                                            compile_only=True)
    ptx = compiled.asm["ptx"]
    facts[f"{schedule} {head_dim} {splits}"] = {
        "atomics": ptx.count("atom.global"), "tma": ptx.count("cp.async.bulk.tensor"),
        "volatile": ptx.count("ld.volatile.global"),
        "local": "ld.local" in ptx or "st.local" in ptx, "stack": stack_bytes(compiled.asm["cubin"]),
        "shared": compiled.metadata.shared}
    if splits > 1:
        compiled = flash_decode_attention_gluon(q, pool, pool, torch.zeros(2, 8, dtype=torch.int32),
                                                torch.zeros(2, dtype=torch.int32), num_splits=splits,
                                                compile_only=True)
        facts[f"units {head_dim} {splits}"] = {"atomics": compiled.asm["ptx"].count("atom.global")}
for pdl, merge in ((False, "last"), (True, "last"), (True, "launch")):  # a programmatic dependent launch
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    pool = torch.zeros((64, 16, 2, 128), dtype=torch.bfloat16)
    compiled = flash_decode_attention_gluon(q, pool, pool, torch.zeros(2, 8, dtype=torch.int32),
                                            torch.zeros(2, dtype=torch.int32), num_splits=4, merge=merge, pdl=pdl,
                                            compile_only=True)
    ptx = compiled.asm["ptx"]
    facts[f"pdl {pdl} {merge}"] = {"wait": ptx.count("griddepcontrol.wait"),
                                   "trigger": ptx.count("griddepcontrol.launch_dependents"),
                                   "local": "ld.local" in ptx or "st.local" in ptx,
                                   "stack": stack_bytes(compiled.asm["cubin"])}
for timeline in (False, True):  # the clocks read only where a timeline is asked for
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    pool = torch.zeros((64, 16, 2, 128), dtype=torch.bfloat16)
    compiled = flash_decode_attention_gluon(q, pool, pool, torch.zeros(2, 8, dtype=torch.int32),
                                            torch.zeros(2, dtype=torch.int32), num_splits=4, compile_only=True,
                                            timeline=new_timeline(1024, "cpu") if timeline else None)
    ptx = compiled.asm["ptx"]
    facts[f"timeline {timeline}"] = {"globaltimer": ptx.count("%globaltimer"), "clock64": ptx.count("%clock64"),
                                     "local": "ld.local" in ptx or "st.local" in ptx,
                                     "stack": stack_bytes(compiled.asm["cubin"])}
json.dump(facts, sys.stdout)
"""


@pytest.fixture(scope="module")
def sm90_compiled():
    return compile_for_sm90(COMPILE_SCRIPT)


@sm90_compile_mark(GLUON_VERSIONS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("splits", [1, 4, "line"])
@pytest.mark.parametrize("variant", [*KV_LAYOUTS, "pipelined"])
def test_compiles_for_sm90(sm90_compiled, head_dim, block_size, splits, variant):
    """Per K or V tile the loader issues one copy per block (or one per tile when a block
    holds whole tiles) and per 64 columns; the scores and P·V are asynchronous wgmma; the
    loader warp gives its registers to the consumer; the merge's counter (a global atomic)
    only where a unit can have several pieces (the balanced schedule, or splits); nothing
    spilled, except that Triton 3.9's ptxas keeps up to 32 bytes of the balanced schedule's
    per-piece scalars on the stack (stored and reloaded outside the key loop: checked by hand
    in the SASS); Triton 3.6's, the version the GPU runs, keeps none. The two pool layouts
    differ only in the copies' coordinates. The pipelined consumer (NHD) waits for the scores
    with P·V's matmuls still in flight (a ``wgmma`` wait that leaves groups outstanding); the
    other consumer always waits for all."""
    facts = sm90_compiled[f"{head_dim} {block_size} {splits} {variant}"]
    assert (facts["partial_waits"] > 0) == (variant == "pipelined")
    copies_per_tile = (BLOCK_N // min(block_size, BLOCK_N)) * (head_dim // 64)
    assert facts["tma"] == 2 * copies_per_tile  # K and V, unrolled
    assert facts["wgmma"] > 0 and facts["setmaxnreg"]
    assert facts["atomics"] == (splits == "line" or splits > 1)
    triton_3_6 = triton.__version__.startswith("3.6.")
    assert not facts["local"] and facts["stack"] <= (32 if splits == "line" and not triton_3_6 else 0)
    assert facts["shared"] <= 227 * 1024


@sm90_compile_mark(GLUON_VERSIONS)
@pytest.mark.parametrize("merge", ["launch", "launch_pdl"])
def test_separate_merge_compiles_without_the_counter(sm90_compiled, merge):
    """With the merge in a second launch the kernel has no arrival counter (no global atomic);
    before a programmatic dependent merge it lets the merge launch be scheduled early."""
    facts = sm90_compiled[f"merge {merge}"]
    assert not facts["atomics"] and not facts["volatile"]
    assert facts["trigger"] == (merge == "launch_pdl")
    assert not facts["local"] and facts["stack"] == 0


@sm90_compile_mark(GLUON_VERSIONS)
def test_polling_merge_compiles_without_atomics(sm90_compiled):
    """The polling merge counts nothing: no global atomic, no early launch of a second kernel;
    its reads of the other programs' partials are volatile, which the compiler may not hoist
    out of the wait (a plain load was hoisted, and the wait never saw another program's
    store)."""
    facts = sm90_compiled["merge poll"]
    assert not facts["atomics"] and not facts["trigger"] and facts["volatile"]
    assert not facts["local"] and facts["stack"] == 0


@sm90_compile_mark(GLUON_VERSIONS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("splits", [1, 4])
def test_claimed_tiles_compile(sm90_compiled, head_dim, splits):
    """With ``schedule="claim"`` and several splits the kernel has the units' atomics (the
    arrival, its reset) and more: the loader's claims (own tiles, then an atomic per tile) and
    the claim counter's reset after the merge; the copies are the units' (one per block and 64
    columns, K and V); nothing spilled. With one split there is nothing to share: no atomic."""
    facts = sm90_compiled[f"claim {head_dim} {splits}"]
    if splits > 1:
        assert facts["atomics"] > sm90_compiled[f"units {head_dim} {splits}"]["atomics"] > 0
    else:
        assert facts["atomics"] == 0
    # K and V copies of the claimed loop (one per block and 64 columns each) and of the unused fixed one
    assert facts["tma"] >= 2 * (BLOCK_N // 16) * (head_dim // 64)
    assert not facts["local"] and facts["stack"] == 0 and facts["shared"] <= 227 * 1024


@sm90_compile_mark(GLUON_VERSIONS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("splits", [1, 4])
def test_stolen_tiles_compile(sm90_compiled, head_dim, splits):
    """With ``schedule="steal"`` and several splits: the units' atomics and the loader's (its own
    run's claims, the thefts), the thieves' volatile look at every run's word, two loops of
    copies (the own run's and the thefts'), nothing spilled with the loader's registers
    (`LOADER_REGS`); with one split the units' kernel, no atomic and no look."""
    facts = sm90_compiled[f"steal {head_dim} {splits}"]
    if splits > 1:
        assert facts["atomics"] > sm90_compiled[f"units {head_dim} {splits}"]["atomics"] > 0
        assert facts["volatile"] > 0
        assert facts["tma"] >= 2 * 2 * (BLOCK_N // 16) * (head_dim // 64)
    else:
        assert facts["atomics"] == facts["volatile"] == 0
    assert not facts["local"] and facts["stack"] == 0 and facts["shared"] <= 227 * 1024


@sm90_compile_mark(GLUON_VERSIONS)
@pytest.mark.parametrize("pdl, merge", [(False, "last"), (True, "last"), (True, "launch")])
def test_programmatic_dependent_launch_compiles(sm90_compiled, pdl, merge):
    """With ``pdl`` the kernel waits once for the kernel before it and lets the next launch be
    scheduled once (``griddepcontrol``); without it, it does neither."""
    facts = sm90_compiled[f"pdl {pdl} {merge}"]
    assert facts["wait"] == facts["trigger"] == int(pdl)
    assert not facts["local"] and facts["stack"] == 0


@sm90_compile_mark(GLUON_VERSIONS)
def test_timeline_reads_the_clocks_only_when_asked(sm90_compiled):
    """The timeline's stamps (five events, each the global timer and the SM's cycle counter,
    one of them in the loader warp) are compiled in only with a timeline; without one the
    kernel reads no clock."""
    assert sm90_compiled["timeline False"]["globaltimer"] == sm90_compiled["timeline False"]["clock64"] == 0
    with_stamps = sm90_compiled["timeline True"]
    assert with_stamps["globaltimer"] >= len(TIMELINE_EVENTS) and with_stamps["clock64"] >= len(TIMELINE_EVENTS)
    assert not with_stamps["local"] and with_stamps["stack"] == 0


def test_refuses_a_bad_timeline():
    q = torch.zeros(2, 8, 128, dtype=DTYPE)
    pool = torch.zeros(64, 16, 2, 128, dtype=DTYPE)
    tables, lens = torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    for bad in (torch.zeros(1024, 2, 5), torch.zeros(1024, 5, 2, dtype=torch.int64),
                torch.zeros(2, 1024, 5, dtype=torch.int64).transpose(0, 1)):
        with pytest.raises(ValueError, match="timeline"):
            flash_decode_attention_gluon(q, pool, pool, tables, lens, num_splits=4, timeline=bad, compile_only=True)


# ----------------------------------------------------------------------------------------
# GPU: against the reference
# ----------------------------------------------------------------------------------------
# (q_heads, kv_heads, head_dim, block_size, seq_lens, num_splits, programs); num_splits "line":
# the balanced schedule; None: the units with the planned count
CASES = [
    (32, 8, 128, 16, [4097, 1, 129, 0, 128, 127], None, None),    # GQA 4:1, the planned splits
    (32, 8, 128, 16, [4097, 1, 129, 0, 128, 127], "line", None),  # the same on the line, one program per SM
    (32, 8, 128, 16, [2000, 300], "line", 3),                      # 3 programs: chunks of many units
    (8, 2, 64, 16, [37 * i % 300 for i in range(150)], "line", None),  # 150 sequences: the scan in two steps
    (32, 8, 128, 16, [32768], "line", None),                       # one long sequence: 17-18 pieces per unit
    (32, 8, 128, 16, [2000, 300], 7, 3),                           # 3 programs take 28 units in turn
    (8, 8, 128, 32, [1000, 5, 333], 3, None),                      # MHA, blocks of 32
    (16, 2, 64, 64, [777, 2048], 2, None),                         # GQA 8:1, head dim 64, blocks of 64
    (16, 2, 64, 64, [777, 2048], "line", 7),                       # the same on the line, 7 programs
    (64, 4, 64, 128, [5000, 1], 40, None),                         # GQA 16:1, more splits than tiles
    (64, 4, 64, 128, [5000, 1], "line", None),                     # the same on the line
    (8, 2, 128, 256, [3000, 256, 255], 1, 2),                      # one split: the output directly; 2 programs
    (8, 2, 128, 256, [3000, 256, 255], "line", 1),                 # one program: the whole line, no merge
    (32, 32, 64, 16, [640, 640], 5, None),                         # MHA, head dim 64, equal lengths
]


def _case_id(c):
    return f"h{c[0]}-kv{c[1]}-d{c[2]}-bs{c[3]}-B{len(c[4])}-S{c[5]}-P{c[6]}"


def pools_in(pool: PagedPool, kv_layout: str):
    """The test pool's K and V in ``kv_layout``: as built (NHD), or copied head-major (HND),
    the unused slots' NaNs included."""
    if kv_layout == "NHD":
        return pool.k, pool.v
    return to_head_major(pool.k), to_head_major(pool.v)


@hopper_only
@pytest.mark.parametrize("kv_layout,pipeline", [("NHD", False), ("HND", False), ("NHD", True)],
                         ids=["NHD", "HND", "pipelined"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,seq_lens,num_splits,programs",
                         [pytest.param(*c, id=_case_id(c)) for c in CASES])
def test_against_reference(q_heads, kv_heads, head_dim, block_size, seq_lens, num_splits, programs, kv_layout,
                           pipeline, gen, seed):
    device = torch.device("cuda")
    pool = PagedPool(seq_lens, block_size, kv_heads, head_dim, DTYPE, device, gen)
    q = random_tensor((len(seq_lens), q_heads, head_dim), DTYPE, device, gen)
    want_out, want_lse = reference(q, pool)
    kw = dict(schedule="line") if num_splits == "line" else dict(num_splits=num_splits)
    k_pool, v_pool = pools_in(pool, kv_layout)
    kw.update(kv_layout=kv_layout, pipeline=pipeline)
    out, lse = flash_decode_attention_gluon(q, k_pool, v_pool, pool.tables, pool.lens(device), programs=programs, **kw)
    assert_close(out, want_out, DTYPE, "out", seed)
    assert_close(lse, want_lse, DTYPE, "lse", seed)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    capacity = pool.tables.shape[1] * block_size
    if num_splits == "line":
        boxes = -(-capacity // min(block_size, BLOCK_N))
        slots = balanced_slots(min(programs or sms, len(seq_lens) * kv_heads * boxes), kv_heads, boxes)
    else:
        slots = num_splits or plan_splits(len(seq_lens), kv_heads, capacity, programs or sms)
    if slots > 1:
        assert not counters_of(len(seq_lens), q_heads, slots, head_dim, device).any(), "counters not reset"
    again, again_lse = flash_decode_attention_gluon(q, k_pool, v_pool, pool.tables, pool.lens(device),
                                                    programs=programs, **kw)
    assert torch.equal(again, out) and torch.equal(again_lse, lse)


@hopper_only
@pytest.mark.parametrize("merge", ["launch", "launch_pdl"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,seq_lens,num_splits,programs",
                         [pytest.param(*c, id=_case_id(c)) for c in CASES if c[5] != "line"])
def test_separate_merge_against_reference(q_heads, kv_heads, head_dim, block_size, seq_lens, num_splits, programs,
                                          merge, gen, seed):
    """The units with their splits merged by a second launch (plain or programmatic dependent):
    the reference's output, and twice in a row the same bits."""
    device = torch.device("cuda")
    pool = PagedPool(seq_lens, block_size, kv_heads, head_dim, DTYPE, device, gen)
    q = random_tensor((len(seq_lens), q_heads, head_dim), DTYPE, device, gen)
    want_out, want_lse = reference(q, pool)
    call = lambda: flash_decode_attention_gluon(q, pool.k, pool.v, pool.tables, pool.lens(device),  # noqa: E731
                                                num_splits=num_splits, programs=programs, merge=merge)
    out, lse = call()
    assert_close(out, want_out, DTYPE, "out", seed)
    assert_close(lse, want_lse, DTYPE, "lse", seed)
    again, again_lse = call()
    assert torch.equal(again, out) and torch.equal(again_lse, lse)


def _pieces_fit(case) -> bool:
    """Whether every piece of a units case has a program of its own (what ``merge="poll"`` needs)."""
    _q_heads, kv_heads, _d, _block_size, seq_lens, num_splits, programs = case
    if num_splits is None:  # planned: never more pieces than programs
        return True
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    return len(seq_lens) * kv_heads * num_splits <= (programs or sms)


#: Units cases for the polling merge: the grid's cases where every piece has a program, and
#: two of its own: 16 splits of one long sequence (128 pieces, the benchmark's batch-1 shape),
#: and 40 splits of a group of 4 (the merge in three steps of at most 16 splits).
POLL_CASES = [c for c in CASES if c[5] != "line" and _pieces_fit(c)] + [
    (32, 8, 128, 16, [32768], 16, None),
    (8, 2, 128, 16, [5000], 40, None),
]


@hopper_only
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,seq_lens,num_splits,programs",
                         [pytest.param(*c, id=_case_id(c)) for c in POLL_CASES])
def test_polling_merge_against_reference(q_heads, kv_heads, head_dim, block_size, seq_lens, num_splits, programs,
                                         gen, seed):
    """The units merged by the program of each unit's last split as soon as the other partials
    are in its workspace: the reference's output; every slot marked empty again after the call
    (what the next call waits on); and a second call the same bits."""
    device = torch.device("cuda")
    pool = PagedPool(seq_lens, block_size, kv_heads, head_dim, DTYPE, device, gen)
    q = random_tensor((len(seq_lens), q_heads, head_dim), DTYPE, device, gen)
    want_out, want_lse = reference(q, pool)
    call = lambda: flash_decode_attention_gluon(q, pool.k, pool.v, pool.tables, pool.lens(device),  # noqa: E731
                                                num_splits=num_splits, programs=programs, merge="poll")
    out, lse = call()
    assert_close(out, want_out, DTYPE, "out", seed)
    assert_close(lse, want_lse, DTYPE, "lse", seed)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = num_splits or plan_splits(len(seq_lens), kv_heads, pool.tables.shape[1] * block_size, programs or sms)
    if splits > 1:
        assert slots_not_empty(len(seq_lens), q_heads, splits, head_dim, device) == 0, "slots not marked empty"
    again, again_lse = call()
    assert torch.equal(again, out) and torch.equal(again_lse, lse)


#: Units cases for the claimed tiles: the grid's, and 16 splits of one long sequence (the
#: benchmark's batch-1 shape); with ``claim_first`` 0 (every tile claimed), the default, and 5.
CLAIM_CASES = [c for c in CASES if c[5] != "line"] + [(32, 8, 128, 16, [32768], 16, None)]


def claim_words_left(schedule, batch, q_heads, kv_heads, num_splits, device) -> int:
    """Nonzero words among the claim counters (``"claim"``) or the runs' words (``"steal"``)."""
    if schedule == "claim":
        return int(claim_counters(batch, q_heads, device).count_nonzero())
    return int(steal_words(batch, kv_heads, num_splits, device).count_nonzero())


@hopper_only
@pytest.mark.parametrize("schedule", ["claim", "steal"])
@pytest.mark.parametrize("claim_first", [0, 2, 5])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,seq_lens,num_splits,programs",
                         [pytest.param(*c, id=_case_id(c)) for c in CLAIM_CASES])
def test_claimed_tiles_against_reference(q_heads, kv_heads, head_dim, block_size, seq_lens, num_splits, programs,
                                         claim_first, schedule, gen, seed):
    """A unit's programs take its tiles from the unit's counter as they go (``schedule="claim"``),
    or each its own run and then from the back of the others' (``"steal"``), also where programs
    hold several units and come late to some, which then leave empty partials: the reference's
    output; the arrival and the claim words back at zero after the call; a second call within
    the same tolerance (the tiles may go to other programs, and their sums round in another
    order)."""
    device = torch.device("cuda")
    pool = PagedPool(seq_lens, block_size, kv_heads, head_dim, DTYPE, device, gen)
    q = random_tensor((len(seq_lens), q_heads, head_dim), DTYPE, device, gen)
    want_out, want_lse = reference(q, pool)
    call = lambda: flash_decode_attention_gluon(q, pool.k, pool.v, pool.tables, pool.lens(device),  # noqa: E731
                                                num_splits=num_splits, programs=programs, schedule=schedule,
                                                claim_first=claim_first)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = num_splits or plan_splits(len(seq_lens), kv_heads, pool.tables.shape[1] * block_size, programs or sms)
    for attempt in ("first", "second"):
        out, lse = call()
        assert_close(out, want_out, DTYPE, f"out ({attempt} call)", seed)
        assert_close(lse, want_lse, DTYPE, f"lse ({attempt} call)", seed)
        assert claim_words_left(schedule, len(seq_lens), q_heads, kv_heads, splits, device) == 0, "claims not reset"
        if splits > 1:
            assert not counters_of(len(seq_lens), q_heads, splits, head_dim, device).any(), "counters not reset"


@hopper_only
@pytest.mark.parametrize("schedule", ["units", "steal"])
def test_late_runs_are_stolen(schedule, gen, seed):
    """Two programs, 4 splits per unit: program 0 takes splits 0 and 2 of each unit, program 1
    splits 1 and 3, each only after the one before. With stealing (and ``claim_first=0``) the two
    programs empty runs 2 and 3 from the back before their owners get there, so those splits'
    partials hold no keys (lse -inf in the workspace), and the output is still the reference's;
    with fixed runs (the control) every split's partial has its own keys."""
    device = torch.device("cuda")
    seq_lens = [3000, 2500]
    pool = PagedPool(seq_lens, 16, 2, 128, DTYPE, device, gen)
    q = random_tensor((2, 8, 128), DTYPE, device, gen)
    out, lse = flash_decode_attention_gluon(q, pool.k, pool.v, pool.tables, pool.lens(device), num_splits=4,
                                            programs=2, schedule=schedule, claim_first=0)
    want_out, want_lse = reference(q, pool)
    assert_close(out, want_out, DTYPE, "out", seed)
    assert_close(lse, want_lse, DTYPE, "lse", seed)
    late = cached_workspace(2, 8, 4, 128, device)[1][:, :, 2:]
    if schedule == "steal":
        assert torch.isneginf(late).all(), "a late program's run was not stolen"
        assert claim_words_left("steal", 2, 8, 2, 4, device) == 0
    else:
        assert torch.isfinite(late).all()


@hopper_only
@pytest.mark.parametrize("variant", ["poll", "claim", "steal"])
def test_replayed_in_a_cuda_graph(variant, gen, seed):
    """Captured in a CUDA graph (as the engine runs its decode steps) and replayed with new
    queries and new lengths, replay after replay: the polling merge gives the same bits as
    eager calls with the counter, each replay finding the slots empty as the last one left them;
    the claimed (and the stolen) tiles give the reference's output, each replay finding the claim
    counters (the runs' words) at zero as the last merge left them. (The lengths only shrink: the
    pool's unused slots hold NaNs.)"""
    device = torch.device("cuda")
    seq_lens = [3000, 17, 2048]
    pool = PagedPool(seq_lens, 16, 8, 128, DTYPE, device, gen)
    q = random_tensor((3, 32, 128), DTYPE, device, gen)
    lens = pool.lens(device)
    kw = dict(merge="poll") if variant == "poll" else dict(schedule=variant)
    call = lambda: flash_decode_attention_gluon(q, pool.k, pool.v, pool.tables, lens, num_splits=4,  # noqa: E731
                                                **kw)
    call()  # the workspace and the counters are made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call()
    for step in range(3):
        q.copy_(random_tensor((3, 32, 128), DTYPE, device, gen))
        new_lens = [3000 - 7 * step, 17 - step, 2048 - 64 * step]
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32, device=device))
        graph.replay()
        if variant == "poll":
            want_out, want_lse = flash_decode_attention_gluon(q, pool.k, pool.v, pool.tables, lens, num_splits=4,
                                                              merge="last")
            assert torch.equal(out, want_out) and torch.equal(lse, want_lse), f"replay {step}"
        else:
            pool.seq_lens = new_lens  # (the reference reads the same blocks, fewer keys)
            want_out, want_lse = reference(q, pool)
            assert_close(out, want_out, DTYPE, f"out (replay {step})", seed)
            assert_close(lse, want_lse, DTYPE, f"lse (replay {step})", seed)
    if variant == "poll":
        assert slots_not_empty(3, 32, 4, 128, device) == 0
    else:
        assert claim_words_left(variant, 3, 32, 8, 4, device) == 0


@hopper_only
@pytest.mark.parametrize("merge", ["last", "launch"])
def test_programmatic_dependent_launch_waits_for_the_last_call(merge, gen, seed):
    """Three calls in a CUDA graph, each taking the last one's output as its queries, launched as
    programmatic dependent launches: the same bits as the same chain launched plainly, so no
    program read its queries before the call before it had written them (its merge included)."""
    device = torch.device("cuda")
    seq_lens = [3000, 17, 2048]
    pool = PagedPool(seq_lens, 16, 8, 128, DTYPE, device, gen)
    lens = pool.lens(device)
    q0 = random_tensor((3, 32, 128), DTYPE, device, gen)

    def chain(pdl, outs):
        q = q0
        for out, lse in outs:
            flash_decode_attention_gluon(q, pool.k, pool.v, pool.tables, lens, num_splits=4, merge=merge, pdl=pdl,
                                         out=out, lse=lse)
            q = out

    plain = [(torch.empty_like(q0), torch.empty(3, 32, device=device)) for _ in range(3)]
    chain(False, plain)
    linked = [(torch.empty_like(q0), torch.empty(3, 32, device=device)) for _ in range(3)]
    chain(True, linked)  # compiled and its workspace made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(True, linked)
    for out, lse in linked:
        out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for (want, want_lse), (out, lse) in zip(plain, linked):
        assert torch.equal(out, want) and torch.equal(lse, want_lse)


@hopper_only
@pytest.mark.parametrize("seq_lens,num_splits,programs", [([4097, 1, 129, 0, 128, 127], None, None),
                                                          ([2000, 300], 7, 3), ([3000], 16, None)])
def test_timeline_is_in_order_and_changes_nothing(seq_lens, num_splits, programs, gen, seed):
    """With a timeline the output is the same bits; every program records its start, and one
    with keys to read its events in order on its SM's clocks (the first copies are issued
    before the first tile arrives, which is before the keys are done, before the end)."""
    device = torch.device("cuda")
    pool = PagedPool(seq_lens, 16, 8, 128, DTYPE, device, gen)
    q = random_tensor((len(seq_lens), 32, 128), DTYPE, device, gen)
    call = lambda **kw: flash_decode_attention_gluon(q, pool.k, pool.v, pool.tables, pool.lens(device),  # noqa: E731
                                                     num_splits=num_splits, programs=programs, **kw)
    want_out, want_lse = call()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    timeline = new_timeline(sms, device)
    out, lse = call(timeline=timeline)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    capacity = pool.tables.shape[1] * 16
    splits = num_splits or plan_splits(len(seq_lens), 8, capacity, programs or sms)
    grid = min(programs or sms, len(seq_lens) * 8 * splits)
    stamps = timeline.cpu()
    assert (stamps[:grid, :, 0] > 0).all() and not stamps[grid:].any()
    busy = stamps[:grid, 1, 2] > 0  # programs that read keys
    assert busy.any()
    for clock in (0, 1):
        t = stamps[:grid][busy][:, clock]
        assert (t[:, 0] <= t[:, 2]).all() and (t[:, 1] <= t[:, 2]).all()
        assert (t[:, 2] <= t[:, 3]).all() and (t[:, 3] <= t[:, 4]).all()


@hopper_only
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_invalid_blocks_read_zeros_and_lengths_are_clamped(kv_layout, gen, seed):
    """A table entry inside a length that is not a block (-1, or past the pool) reads as zero
    keys and values (in HND, past the pool means past every head's rows too); a length past
    the table is clamped to the table's capacity."""
    device = torch.device("cuda")
    block_size, q_heads, kv_heads, head_dim = 16, 8, 2, 128
    pool = PagedPool([300, 208], block_size, kv_heads, head_dim, DTYPE, device, gen)  # (208: whole blocks)
    tables = pool.tables.clone()
    tables[0, 3] = PAD
    tables[1, 0] = pool.k.shape[0] + 5
    lens = torch.tensor([300, 10**6], dtype=torch.int32, device=device)
    q = random_tensor((2, q_heads, head_dim), DTYPE, device, gen)
    out, lse = flash_decode_attention_gluon(q, *pools_in(pool, kv_layout), tables, lens, num_splits=3,
                                            kv_layout=kv_layout)
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


# ----------------------------------------------------------------------------------------
# CPU: the benchmark's bookkeeping, with a stand-in for the kernels
# ----------------------------------------------------------------------------------------
def _stand_in_decode(q, k_cache, v_cache, tables, lens, *, out, lse, kv_layout="NHD", **_kw):
    """The NumPy reference (`minillm.reference.ch05_paged_attention.paged_decode_attention`) in
    the kernels' place, for the benchmark's dry run: ``kv_layout`` as the Gluon launcher's."""
    o, l = paged_decode_attention(to_numpy(q), to_numpy(as_token_major(k_cache, kv_layout)),
                                  to_numpy(as_token_major(v_cache, kv_layout)), tables.cpu().numpy(), lens.cpu().numpy())
    out.copy_(torch.from_numpy(o))
    lse.copy_(torch.from_numpy(l))
    return out, lse


@pytest.mark.parametrize("together", [True, False])
def test_benchmark_dry_run(monkeypatch, together):
    """`bench.ch07_gluon.sweep` end to end on CPU with the kernels and CUDA graphs stood in:
    every point adds the head-major pool's rows (against the row-major kernel and cuDNN, its
    bandwidth, its output equal to the row-major one's), whether the two pools fit together
    (timed in turn) or not (converted one tensor at a time, then timed alone, and said so)."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench import ch07_gluon as bench
    from bench.common import Results

    monkeypatch.setattr(bench, "flash_decode_attention_gluon", _stand_in_decode)
    monkeypatch.setattr(bench, "flash_decode_attention", _stand_in_decode)
    monkeypatch.setattr(bench, "graph_time_ms", lambda fn, repeats, timer: timer(fn))
    if not together:
        monkeypatch.setattr(bench, "free_device_bytes", lambda device: 0.0)
    results = Results("dry run", {"copy_TBps": 1.0}, env={})
    points = [(1, 8, 64), (2, 8, 48)]
    bench.sweep(results, torch.device("cpu"), points=points, timer=lambda fn: (fn(), 1.0)[1])
    hnd = [r for r in results.rows if r["params"]["kernel"] == "gluon_hnd"]
    by = {(r["params"]["batch"], r["metric"], r["peer"]): r for r in hnd}
    for batch, _kv, _ctx in points:
        assert by[(batch, "time_ms", "gluon")]["ratio"] == 1.0
        assert (batch, "time_ms", "sdpa_cudnn") in by and (batch, "bandwidth_TBps", "sdpa_cudnn") in by
        assert by[(batch, "rel_err", "gluon")]["ours"] == 0.0
        assert ((batch, "graph_time_ms", "gluon") in by) == together
        assert (by[(batch, "time_ms", "gluon")].get("note") is None) == together
    assert "HND/cuDNN" in bench.summary(results)
