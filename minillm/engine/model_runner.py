"""Chapter 9: runs one step's flat batch through the model and returns the logits that
predict each sequence's next token."""
from __future__ import annotations

import torch

from minillm.model.paged import PagedBatch, PagedKVCache

__all__ = ["ModelRunner"]


class ModelRunner:
    """The model and its paged KV cache: ``forward(batch) -> logits [batch_size, vocab]``."""

    def __init__(self, model, cache: PagedKVCache):
        self.model, self.cache = model, cache

    @torch.inference_mode()
    def forward(self, batch: PagedBatch) -> torch.Tensor:
        return self.model.forward_paged(batch, self.cache, last_only=True)
