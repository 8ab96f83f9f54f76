"""NumPy reference implementations: slow, float64, written to be read.

Every Triton kernel in `minillm.kernels` is tested against one of these.
"""
from minillm.reference.attention import attention, attention_mask, attention_scores, kv_head_for, softmax
from minillm.reference.kv_cache import KVCache, RingKVCache

__all__ = ["KVCache", "RingKVCache", "attention", "attention_mask", "attention_scores", "kv_head_for", "softmax"]
