"""Chapter 10's cost formulas (`minillm.costs`): the weight bytes of a decode step, the floor
model of its time, and the kernel count."""
import pytest

from minillm.costs import decode_floor_s, decode_kernels_per_step, kv_cache_bytes, llama_weight_bytes
from minillm.experiments.ch09_engine_benchmark import PRESETS, count_parameters


@pytest.mark.parametrize("preset", ["llama-280m", "llama-3.2-1b", "llama-tiny"])
def test_weight_bytes_are_the_parameter_count_less_the_embedding(preset):
    p, vocab = PRESETS[preset], 4096
    tied = p.get("tie_word_embeddings", False)
    got = llama_weight_bytes(p["hidden_size"], p["intermediate_size"], p["num_hidden_layers"],
                             p["num_attention_heads"], p["num_key_value_heads"], p["head_dim"], vocab, 2, tied)
    params = count_parameters(p, vocab, tied)
    embedding_rows = 0 if tied else vocab * p["hidden_size"]   # untied: the embedding is not read whole
    assert got == 2 * (params - embedding_rows)


def test_280m_reads_about_half_a_gigabyte_per_step():
    p = PRESETS["llama-280m"]
    got = llama_weight_bytes(1024, 2816, 24, 16, 4, 64, 4096)
    assert 0.5e9 < got < 0.6e9 and got == llama_weight_bytes(p["hidden_size"], 2816, 24, 16, 4, 64, 4096)


def test_floor_adds_bytes_time_and_kernel_time():
    f = decode_floor_s(3e9, 1e9, 4e12, kernels=900, per_kernel_s=2e-6)
    assert f["bytes_s"] == pytest.approx(1e-3)
    assert f["kernels_s"] == pytest.approx(1.8e-3)
    assert f["total_s"] == pytest.approx(2.8e-3)
    assert decode_floor_s(4e12, 0, 4e12) == {"bytes_s": 1.0, "kernels_s": 0.0, "total_s": 1.0}


def test_kernel_count_and_kv_bytes():
    assert decode_kernels_per_step(24, 37, 10) == 898
    assert kv_cache_bytes(64 * 300, 4, 64, 2, 24) == 2 * 24 * 64 * 300 * 4 * 64 * 2
