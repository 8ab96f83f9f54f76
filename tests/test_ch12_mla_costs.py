"""Chapter 12's cost formulas: KV-cache bytes per token for MHA, GQA, MQA and MLA on the
public configurations of Llama-2-7B, Llama-3-8B, DeepSeek-V2-Lite and DeepSeek-V3, and the
bytes and FLOPs of absorbed MLA decode."""
import pytest

from minillm import costs


def test_per_token_bytes_by_hand():
    # Llama-2-7B (MHA): 32 heads x (128 + 128) x 2 bytes per layer; 32 layers: 512 KiB a token.
    assert costs.mha_kv_bytes_per_token(32, 128) == 16384
    assert costs.LLAMA2_7B_CACHE.kv_bytes_per_token() == 512 * 1024
    # Llama-3-8B (GQA, 8 KV heads): a quarter of that.
    assert costs.gqa_kv_bytes_per_token(8, 128) == 4096
    assert costs.LLAMA3_8B_CACHE.kv_bytes_per_token() == 128 * 1024
    assert costs.mqa_kv_bytes_per_token(128) == 512
    # MLA: 512 + 64 elements per layer whatever the heads; V2-Lite's 27 and V3's 61 layers.
    assert costs.mla_kv_bytes_per_token(512, 64) == 1152
    assert costs.DEEPSEEK_V2_LITE_CACHE.kv_bytes_per_token() == 27 * 1152
    assert costs.DEEPSEEK_V3_CACHE.kv_bytes_per_token() == 61 * 1152
    # The same heads as MHA: V2-Lite 16 x (192 + 128) x 2; V3 128 x (192 + 128) x 2.
    assert costs.DEEPSEEK_V2_LITE_CACHE.mha_bytes_per_token_layer() == 10240
    assert costs.DEEPSEEK_V3_CACHE.mha_bytes_per_token_layer() == 81920
    # DeepSeek-V2's paper: MLA caches as much as GQA with 2.25 groups (d_h = 128).
    assert costs.mla_equivalent_gqa_groups(512, 64, 128) == 2.25


def test_table_rows():
    rows = {r["name"]: r for r in costs.mla_kv_table(dtype_bytes=2, context=32768)}
    assert [r["kind"] for r in rows.values()] == ["MHA", "GQA", "MLA", "MLA"]
    assert rows["Llama-2-7B"]["gib_per_sequence"] == 16.0
    assert rows["Llama-3-8B"]["vs_mha"] == 0.25
    assert rows["DeepSeek-V3"]["vs_mha"] == pytest.approx(1152 / 81920)
    assert rows["DeepSeek-V2-Lite"]["bytes_per_token"] < rows["Llama-3-8B"]["bytes_per_token"] / 4


def test_decode_bytes_and_flops():
    # One sequence of 4096 tokens, V2-Lite's 16 heads, bf16.
    b = costs.mla_decode_bytes([4096], 16, 512, 64, 2)
    assert b == 4096 * 576 * 2 + 16 * (576 + 512) * 2 + 16 * 4
    assert costs.mla_decode_flops([4096], 16, 512, 64) == 4096 * 16 * 2 * (512 + 576)
    naive = costs.mla_naive_decode_bytes([4096], 16, 192, 128, 2)
    assert naive > 8 * b  # the decompressed K/V are 320 x 16 / 576 = 8.9x the latent rows
    assert costs.mla_kv_block_bytes(27, 576, 16, 2) == 27 * 16 * 576 * 2
