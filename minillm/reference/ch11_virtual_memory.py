"""Chapter 11: the page-table arithmetic of a virtual-memory KV cache, in NumPy, written to be
read. `minillm.vmm.pagetable` does the same bookkeeping one request at a time; these
functions are its vectorised oracle, and what the exercises check against.

A virtual tensor (the keys, or the values, of one layer) is ``max_slots`` slots of
``slot_bytes = pages_per_slot · page_bytes`` each, back to back in virtual memory. Token ``t``
of the request in slot ``s`` is at virtual byte offset

    offset = s · slot_bytes + t · bytes_per_token,

in virtual page ``offset // page_bytes``, at ``offset % page_bytes`` inside it. The MMU
replaces the virtual page by the physical page the driver mapped there: that is the whole
translation, done in hardware on every load, with no block table read by the kernel.
"""
from __future__ import annotations

import numpy as np

# The byte and page counts are cost formulas, defined once in minillm.costs; this module names
# them as the page table uses them.
from minillm.costs import vmm_bytes_per_token_layer as bytes_per_token
from minillm.costs import vmm_mapped_waste_bytes as mapped_waste_bytes
from minillm.costs import vmm_pages_per_tensor as pages_needed
from minillm.costs import vmm_slot_bytes as slot_bytes

__all__ = ["bytes_per_token", "pages_needed", "slot_bytes", "token_offsets", "translate", "pages_to_map",
           "mapped_waste_bytes"]


def token_offsets(slots, tokens, slot_bytes_: int, bytes_per_token: int) -> np.ndarray:
    """Virtual byte offsets (from the tensor's base) of token ``tokens[i]`` of slot ``slots[i]``."""
    return np.asarray(slots, dtype=np.int64) * slot_bytes_ + np.asarray(tokens, dtype=np.int64) * bytes_per_token


def translate(offsets, page_table: np.ndarray, page_bytes: int) -> np.ndarray:
    """What the MMU does: virtual byte offsets to physical byte addresses.

    ``page_table``: int64 ``[num_virtual_pages]``, the physical page behind each virtual page
    of the tensor (``-1``: unmapped). An offset in an unmapped page raises ``ValueError`` (on
    the GPU: an illegal-address fault)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    vpage, within = offsets // page_bytes, offsets % page_bytes
    phys = np.asarray(page_table, dtype=np.int64)[vpage]
    if (phys < 0).any():
        raise ValueError(f"access to unmapped virtual page(s) {sorted(set(vpage[phys < 0].tolist()))}")
    return phys * page_bytes + within


def pages_to_map(old_tokens, new_tokens, bytes_per_token: int, page_bytes: int) -> np.ndarray:
    """New pages each request needs (per tensor) when it grows from ``old_tokens`` to
    ``new_tokens``: ``pages_needed(new) - pages_needed(old)``."""
    return (pages_needed(new_tokens, bytes_per_token, page_bytes)
            - pages_needed(old_tokens, bytes_per_token, page_bytes))

