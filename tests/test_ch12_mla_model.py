"""Chapter 12: DeepSeek-V2/V3 checkpoints (multi-head latent attention, dense MLPs) against
transformers.

Tiny random models built with transformers' own ``DeepseekV2ForCausalLM`` /
``DeepseekV3ForCausalLM`` (every layer dense: ``first_k_dense_replace = num_hidden_layers``),
saved with ``save_pretrained`` and loaded by minillm:

- fp32 logits within 1e-4 (relative to the largest logit) of transformers', with and without
  query compression, interleaved and rotate-half RoPE, with attention biases;
- greedy generation identical for 40 tokens: minillm's contiguous cache, and the engine
  (``LLM(path)``) over the paged latent cache on the CPU;
- the paged model on the Triton kernels (the interpreter on a CPU): fresh prefill
  (decompression + FlashAttention-2), chunks after a cached prefix and decode steps (absorbed,
  `minillm.kernels.ch12_mla`) give the contiguous model's logits;
- the absorbed form equals the decompressed one inside the module;
- a mixture-of-experts config is refused with a `CheckpointError`.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from minillm.kernels.base import interpreting  # noqa: E402
from minillm.model import CheckpointError, load_model  # noqa: E402
from minillm.model.config import ModelConfig  # noqa: E402
from minillm.model.paged import PagedBatch  # noqa: E402
from minillm.model.torch_model import generate  # noqa: E402
from minillm.paged import BlockManager  # noqa: E402
from minillm.testing import TINY_MLA_SIZES as SIZES  # noqa: E402
from minillm.testing import tiny_mla_model as hf_model  # noqa: E402  (random DeepSeek model, sharpened weights)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = SIZES["vocab_size"]
VARIANTS = {
    "v2-lite-like": ("v2", dict(q_lora_rank=None)),
    "v2-q-lora-bias": ("v2", dict(q_lora_rank=16, attention_bias=True)),
    "v3": ("v3", dict(q_lora_rank=24)),
    "v3-rotate-half": ("v3", dict(q_lora_rank=None, rope_interleave=False, v_head_dim=14)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    version, overrides = VARIANTS[request.param]
    model = hf_model(version, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def test_logits_match_transformers(checkpoint):
    hf, path = checkpoint
    model, config = load_model(path)
    assert config.is_mla and type(model.model.layers[0].self_attn).__name__ == "MLAAttention"
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(ids).logits, model(ids)
    err = (got - expected).abs().max() / expected.abs().max()
    assert err < 1e-4, f"relative error {err:.2e}"


def test_greedy_matches_transformers(checkpoint):
    hf, path = checkpoint
    model, _ = load_model(path)
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)[0, 7:].tolist()
    assert generate(model, prompt, 40)[0, 7:].tolist() == expected
    assert len(set(expected)) >= 3, "a degenerate model: the comparison would say little"


def test_engine_greedy_matches_transformers(checkpoint):
    """``LLM(path)`` on the CPU (torch paged path: the latent pool, decompression per step)."""
    from minillm.engine import LLM, SamplingParams

    hf, path = checkpoint
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 11, 3)]
    llm = LLM(path, device="cpu", num_blocks=64, block_size=4, cuda_graphs="off")
    assert llm.engine.cache.pool.shape[0] == 1 and llm.engine.cache.pool.shape[-1] == 28  # one latent plane
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected


@pytest.mark.skipif(not interpreting(), reason="runs the Triton kernels on CPU tensors, in the interpreter")
@pytest.mark.parametrize("variant", ["v2-lite-like", "v3"])
def test_paged_kernels_match_contiguous(variant, tmp_path):
    """The kernel path of the paged model: a fresh prefill of two prompts (FlashAttention-2 on
    the decompressed rows), then a step mixing a chunk after a cached prefix with a decode
    (absorbed, per-token), then a decode step (the split decode kernel); every step's logits
    equal the contiguous model's for the same tokens."""
    version, overrides = VARIANTS[variant]
    hf_model(version, **overrides).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    cache = model.new_paged_cache(num_blocks=24, block_size=4, backend="triton")
    manager = BlockManager(24, 4)
    gen = torch.Generator().manual_seed(3)
    seqs = {"a": torch.randint(0, VOCAB, (9,), generator=gen).tolist(),
            "b": torch.randint(0, VOCAB, (6,), generator=gen).tolist()}

    def expected(tokens, last):
        with torch.no_grad():
            return model(torch.tensor([tokens]))[0, -last:]

    # Step 1: "a" prefills its first 5 tokens, "b" all 6 (fresh: nothing cached before them).
    manager.allocate("a", seqs["a"][:5])
    manager.allocate("b", seqs["b"])
    batch = PagedBatch.from_manager(manager, ["a", "b"], [5, 6])
    assert batch.fresh_prefill
    with torch.no_grad():
        logits = model.forward_paged(batch, cache)
    torch.testing.assert_close(logits[:5], expected(seqs["a"][:5], 5), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[5:], expected(seqs["b"], 6), rtol=1e-4, atol=1e-4)
    # Step 2: "a" runs its next 4 tokens (a chunk after its cached prefix), "b" decodes one.
    seqs["b"].append(7)
    manager.append_slots(["a", "b"], [seqs["a"][5:], [7]])
    batch = PagedBatch.from_manager(manager, ["a", "b"], [4, 1])
    with torch.no_grad():
        logits = model.forward_paged(batch, cache)
    torch.testing.assert_close(logits[:4], expected(seqs["a"], 4), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[4:], expected(seqs["b"], 1), rtol=1e-4, atol=1e-4)
    # Step 3: both decode.
    seqs["a"].append(11)
    seqs["b"].append(12)
    manager.append_slots(["a", "b"], [11, 12])
    batch = PagedBatch.from_manager(manager, ["a", "b"], 1)
    with torch.no_grad():
        logits = model.forward_paged(batch, cache, last_only=True)
    torch.testing.assert_close(logits[0], expected(seqs["a"], 1)[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], expected(seqs["b"], 1)[0], rtol=1e-4, atol=1e-4)


def test_absorbed_equals_naive_in_module(tmp_path):
    hf_model("v3", q_lora_rank=24).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, dtype=torch.float64)
    attn = model.model.layers[1].self_attn
    x = torch.randn(13, SIZES["hidden_size"], dtype=torch.float64)
    from minillm.model.torch_model import rope_cos_sin
    cos, sin = rope_cos_sin(torch.arange(13), 8, 10000.0, torch.float64)
    q_nope, q_rope = attn.queries(x, cos[:, None], sin[:, None])
    rows = attn.latents(x, cos, sin)
    naive = attn.attend_naive(q_nope[-4:], q_rope[-4:], rows)
    absorbed = attn.latent_values(attn.attend_absorbed(attn.absorb_query(q_nope[-4:], q_rope[-4:]), rows))
    torch.testing.assert_close(absorbed, naive, rtol=1e-10, atol=1e-10)


def test_moe_config_is_refused(tmp_path):
    config = transformers.DeepseekV2Config(**{**SIZES, "first_k_dense_replace": 1, "n_routed_experts": 4})
    config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"config.json: mixture-of-experts layers \(1 of 2"):
        ModelConfig.from_json(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["first_k_dense_replace"] = 2  # every layer dense: accepted
    assert ModelConfig.from_dict(d).is_mla
    with pytest.raises(CheckpointError, match="dense MLPs only"):
        ModelConfig.from_dict({**d, "first_k_dense_replace": 0})


def test_engine_sizes_the_latent_pool(checkpoint):
    """The engine's pool budget counts latent rows (one plane, ``latent_dim`` wide), not K and V."""
    from minillm.costs import mla_kv_block_bytes
    from minillm.engine import LLM

    _, path = checkpoint
    llm = LLM(path, device="cpu", block_size=4, kv_cache_memory_mb=1, cuda_graphs="off")
    config = llm.engine.model_config
    assert llm.engine.block_bytes == mla_kv_block_bytes(2, config.latent_dim, 4, 4) == llm.engine.cache.block_bytes
    assert llm.engine.cache.num_blocks == 2**20 // llm.engine.block_bytes


def test_engine_on_the_kernels_matches_transformers(tmp_path, device):
    """``LLM(path)`` on the Triton kernels (the interpreter on a CPU; on a GPU with CUDA graphs
    of decode and mixed steps), float32, a token budget of 8 so that the longer prompts are
    prefilled in chunks after their cached first chunk: greedy equals transformers'."""
    from minillm.engine import LLM, SamplingParams

    version, overrides = VARIANTS["v3"]
    hf = hf_model(version, **overrides)
    hf.save_pretrained(tmp_path)
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19, 3)]
    llm = LLM(tmp_path, device=str(device), dtype="float32", num_blocks=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=8, max_n=1, attention_backend="triton",
              cuda_graphs="all" if device.type == "cuda" else "off")
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected
