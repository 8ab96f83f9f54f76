"""Chapter 11 exercises: the page-table arithmetic of a KV cache in virtual memory. Grade your
work with ``make grade CH=11``.

Replace each ``raise NotImplementedError(...)`` with your implementation (plain Python or
NumPy). Tests compare your functions with `minillm.reference.ch11_virtual_memory` and
`minillm.vmm.pagetable` on fresh random inputs.

Notation (the notebook's): a *virtual tensor* (the K, or the V, of one layer) is cut into
slots, one per request; ``bytes_per_token`` is one token's bytes in one tensor
(``kv_heads · head_dim · dtype_bytes``); physical memory comes in pages of ``page_bytes``.
"""
from __future__ import annotations

import numpy as np


def pages_needed(tokens: int, bytes_per_token: int, page_bytes: int) -> int:
    """Exercise 11.1 — how many pages one virtual tensor must have mapped to hold ``tokens``
    tokens of ``bytes_per_token`` bytes each, with pages of ``page_bytes``.

    The tokens are back to back from the start of the request's slot, so they occupy bytes
    ``0 … tokens · bytes_per_token − 1``; a token may straddle two pages. Return a Python int
    (0 for 0 tokens).
    """
    raise NotImplementedError("Exercise 11.1 (pages_needed): not started. Read its docstring; hints: python -m minillm.grade 11 --hint 11.1")


def translate(offsets: np.ndarray, page_table: np.ndarray, page_bytes: int) -> np.ndarray:
    """Exercise 11.2 — what the MMU does on every load: virtual byte offsets to physical
    byte addresses.

    ``offsets``: int64 ``[n]`` byte offsets from the start of a virtual tensor;
    ``page_table``: int64 ``[num_virtual_pages]``, the physical page mapped behind each
    virtual page, ``-1`` where none is. Return int64 ``[n]``: the physical page of each
    offset's virtual page, times ``page_bytes``, plus the offset within the page. If any
    offset falls in an unmapped page, raise ``ValueError`` (on a GPU: an illegal-address fault).
    """
    raise NotImplementedError("Exercise 11.2 (translate): not started. Read its docstring; hints: python -m minillm.grade 11 --hint 11.2")


def pick_slot(idle_pages: dict[int, int], need: int) -> int:
    """Exercise 11.3 — deferred reclamation: which idle slot a new request gets.

    ``idle_pages`` maps each idle slot to the pages it still has mapped (left there by the
    request that finished in it); the new request needs ``need`` pages at once. Choose the
    slot that saves the most mapping calls without holding pages in excess: among the slots
    with at least ``need`` pages, the one with the fewest; if none has enough, the one with
    the most. Ties go to the lowest slot number. ``idle_pages`` is not empty.
    """
    raise NotImplementedError("Exercise 11.3 (pick_slot): not started. Read its docstring; hints: python -m minillm.grade 11 --hint 11.3")
