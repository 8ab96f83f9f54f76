"""NumPy reference implementations: slow, float64, written to be read.

Every Triton kernel in `minillm.kernels` is tested against one of these.
"""
from minillm.reference.ch01_naive_attention import attention, attention_mask, attention_scores, kv_head_for, softmax
from minillm.reference.ch02_kv_cache import KVCache, RingKVCache
# Chapter 3. Its `online_softmax` function is not re-exported here, so that the name
# `minillm.reference.ch03_online_softmax` stays the module.
from minillm.reference.ch03_online_softmax import (
    fa1_block_sizes, merge_partials, merge_stats, online_softmax_update, softmax_stats, tile_step,
    tiled_attention,
)
# Chapter 4.
from minillm.reference.ch04_flash_attention import (
    backward_delta, classify_blocks, fa2_backward, fa2_backward_tile, fa2_finalize, fa2_forward, fa2_tile_step,
)
# Chapter 5.
from minillm.reference.ch05_paged_attention import (
    gather_paged_kv, paged_decode_attention, paged_kv_addresses, paged_prefill_attention,
)

__all__ = [
    "KVCache", "RingKVCache", "attention", "attention_mask", "attention_scores", "fa1_block_sizes",
    "kv_head_for", "merge_partials", "merge_stats", "online_softmax_update", "softmax", "softmax_stats", "tile_step",
    "tiled_attention",
]
__all__ += [
    "backward_delta", "classify_blocks", "fa2_backward", "fa2_backward_tile", "fa2_finalize", "fa2_forward",
    "fa2_tile_step",
]
__all__ += ["gather_paged_kv", "paged_decode_attention", "paged_kv_addresses", "paged_prefill_attention"]
