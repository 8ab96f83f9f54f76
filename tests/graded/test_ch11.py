"""Graded tests for Chapter 11 (a KV cache in virtual memory). Run: `make grade CH=11`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run (the seed is in every
failure message; pin it with ``MINILLM_SEED``).
"""
import numpy as np
import pytest

from minillm.reference import ch11_virtual_memory as ref
from minillm.vmm.pagetable import Geometry, PageTable

pages_ex = pytest.mark.exercise(id="11.1", title="Pages a request needs", points=2)
translate_ex = pytest.mark.exercise(id="11.2", title="Virtual to physical addresses", points=2)
pick_ex = pytest.mark.exercise(id="11.3", title="Deferred reclamation: picking a slot", points=2)


@pages_ex
def test_pages_needed_edges(impl):
    assert impl.pages_needed(0, 2048, 2 << 20) == 0
    assert impl.pages_needed(1, 2048, 2 << 20) == 1
    assert impl.pages_needed(1024, 2048, 2 << 20) == 1
    assert impl.pages_needed(1025, 2048, 2 << 20) == 2
    assert impl.pages_needed(3, 100, 128) == 3  # 300 bytes: tokens straddle pages
    assert isinstance(impl.pages_needed(5, 7, 16), int)


@pages_ex
def test_pages_needed_random(impl, seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        tokens, bpt, page = int(rng.integers(0, 100_000)), int(rng.integers(1, 9000)), int(rng.integers(1, 1 << 22))
        assert impl.pages_needed(tokens, bpt, page) == int(ref.pages_needed(tokens, bpt, page)), \
            f"seed={seed}: tokens={tokens}, bytes_per_token={bpt}, page_bytes={page}"


@translate_ex
def test_translate_random(impl, seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        page = int(rng.choice([64, 4096, 2 << 20]))
        n_pages = int(rng.integers(1, 30))
        table = rng.permutation(100)[:n_pages].astype(np.int64)
        offsets = rng.integers(0, n_pages * page, size=int(rng.integers(1, 50))).astype(np.int64)
        got = impl.translate(offsets, table, page)
        np.testing.assert_array_equal(got, ref.translate(offsets, table, page), err_msg=f"seed={seed}")


@translate_ex
def test_translate_unmapped_faults(impl):
    table = np.array([3, -1, 0], dtype=np.int64)
    assert impl.translate(np.array([0, 200], dtype=np.int64), table, 100).tolist() == [300, 0]
    with pytest.raises(ValueError):
        impl.translate(np.array([0, 150], dtype=np.int64), table, 100)


@pick_ex
def test_pick_slot_examples(impl):
    assert impl.pick_slot({0: 5, 1: 3, 2: 8}, 3) == 1   # the fewest that are enough
    assert impl.pick_slot({0: 5, 1: 3, 2: 8}, 6) == 2
    assert impl.pick_slot({0: 1, 1: 2, 2: 2}, 9) == 1   # none is enough: the most, lowest on ties
    assert impl.pick_slot({4: 0, 2: 0}, 0) == 2


@pick_ex
def test_pick_slot_matches_the_page_table(impl, seed):
    """The choice `minillm.vmm.pagetable.PageTable.admit` makes under deferred reclamation."""
    rng = np.random.default_rng(seed)
    for trial in range(30):
        slots = int(rng.integers(1, 8))
        g = Geometry(1, slots, 1, 1, 64)
        table = PageTable(g, slots * 64, "deferred")
        for s in range(slots):  # leave each slot with a random number of retained pages
            table.admit(("old", s))
        for s in range(slots):
            table.grow(("old", s), int(rng.integers(0, 20)))
        for s in range(slots):
            table.release(("old", s))
        idle = {s: table.mapped_pages[s] for s in range(slots)}
        need = int(rng.integers(0, 25))
        expected = table.admit("new", need)
        assert impl.pick_slot(dict(idle), need) == expected, f"seed={seed}, trial {trial}: {idle}, need {need}"
