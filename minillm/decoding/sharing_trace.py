"""The blocks a decoding method held at each step, with and without sharing (Chapter 6).

`minillm.decoding.beam_search` and the parallel sampler return one; the measurements over
whole workloads are in `minillm.experiments.ch06_sharing`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SharingTrace"]


@dataclass(frozen=True)
class SharingTrace:
    """Blocks held at each step, with and without sharing.

    Attributes:
        shared: ``[steps]`` blocks the block manager holds (``num_used_blocks``).
        unshared: ``[steps]`` blocks the same sequences would hold without sharing.
        copies: copy-on-write block copies made along the way.
    """

    shared: np.ndarray
    unshared: np.ndarray
    copies: int

    @property
    def saving(self) -> float:
        """``1 - sum(shared) / sum(unshared)``: the fraction of block-steps saved."""
        return float(1 - self.shared.sum() / self.unshared.sum())

    @property
    def peak_saving(self) -> float:
        """``1 - max(shared) / max(unshared)``: the saving at the peak, what sizes the pool."""
        return float(1 - self.shared.max() / self.unshared.max())

    @staticmethod
    def concat(traces: Sequence[SharingTrace]) -> SharingTrace:
        """Many requests served one after another, as one trace."""
        return SharingTrace(np.concatenate([t.shared for t in traces]), np.concatenate([t.unshared for t in traces]),
                            sum(t.copies for t in traces))
