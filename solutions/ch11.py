"""Chapter 11 solutions: the page-table arithmetic of a KV cache in virtual memory."""
from __future__ import annotations

import numpy as np


def pages_needed(tokens: int, bytes_per_token: int, page_bytes: int) -> int:
    """Exercise 11.1: ``ceil(tokens · bytes_per_token / page_bytes)`` in integers."""
    return -(-tokens * bytes_per_token // page_bytes)


def translate(offsets: np.ndarray, page_table: np.ndarray, page_bytes: int) -> np.ndarray:
    """Exercise 11.2: split each offset into (virtual page, offset in the page), look the page up."""
    offsets = np.asarray(offsets, dtype=np.int64)
    vpage, within = offsets // page_bytes, offsets % page_bytes
    phys = np.asarray(page_table, dtype=np.int64)[vpage]
    if (phys < 0).any():
        raise ValueError("access to an unmapped virtual page")
    return phys * page_bytes + within


def pick_slot(idle_pages: dict[int, int], need: int) -> int:
    """Exercise 11.3: the fewest pages that are enough, else the most; ties to the lowest slot."""
    enough = [s for s, n in idle_pages.items() if n >= need]
    if enough:
        return min(enough, key=lambda s: (idle_pages[s], s))
    return max(idle_pages, key=lambda s: (idle_pages[s], -s))
