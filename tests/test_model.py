"""The Llama-family model against Hugging Face transformers, the oracle.

Tiny random Llama and Qwen2 checkpoints are built locally with transformers' config
classes and saved to a temp folder (never downloaded). minillm loads them and must match
transformers' logits (fp32, CPU) and greedy generations; the NumPy reference must match
the torch model. (Decoding with the KV cache against recomputation: tests/test_ch02_kv_cache_reference.py.)
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from minillm.model import (  # noqa: E402
    LlamaForCausalLM, ModelConfig, generate, load_model, load_reference_params, load_tokenizer, render_chat,
)
from minillm.model import reference  # noqa: E402

VOCAB = 256
# id: (family, extra config kwargs, save kwargs). Covers tied/untied embeddings, head_dim
# equal to and differing from hidden/heads, GQA/MQA/MHA, biases, a non-default rope_theta,
# single-file and sharded (index.json) checkpoints.
CASES = {
    "llama-tied-hd16": ("llama", dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=True), {}),
    "llama-untied-hd24-sharded": ("llama", dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=24,
                                                tie_word_embeddings=False), dict(max_shard_size="40KB")),
    "llama-bias-mha": ("llama", dict(num_hidden_layers=2, num_key_value_heads=4, head_dim=16,
                                     attention_bias=True, mlp_bias=True, tie_word_embeddings=False), {}),
    "qwen2-tied-hd16-sharded": ("qwen2", dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                                              tie_word_embeddings=True, rope_theta=1e6),
                                dict(max_shard_size="40KB")),
    "qwen2-untied-hd24-mqa": ("qwen2", dict(num_hidden_layers=2, num_key_value_heads=1, head_dim=24,
                                            tie_word_embeddings=False), {}),
}


def hf_model(family: str, seed: int = 0, **kw):
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    # initializer_range 0.3 (not 0.02): sharper logits, so the greedy top-2 margins are large.
    config = cfg_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None, **kw)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    """``(hf_model, folder)`` for one case, saved with ``save_pretrained``."""
    family, kw, save_kw = CASES[request.param]
    model = hf_model(family, **kw)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, **save_kw)
    if "max_shard_size" in save_kw:
        assert (path / "model.safetensors.index.json").exists()
    return model, path


def prompts(n: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_logits_match_transformers(checkpoint):
    hf, path = checkpoint
    model, config = load_model(path)
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert model.lm_head.weight.dtype == torch.float32
    ids = prompts(length=20)
    with torch.no_grad():
        assert rel_err(model(ids), hf(ids).logits) <= 1e-4


def test_greedy_generation_matches_transformers(checkpoint):
    hf, path = checkpoint
    model, _ = load_model(path)
    ids, new = prompts(), 40
    expected = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    got = generate(model, ids, max_new_tokens=new, greedy=True)
    # The match only means something if no step was a near tie: every top-2 margin must
    # dwarf the two models' logit difference on the same tokens (and float32 rounding).
    with torch.no_grad():
        steps = slice(ids.shape[1] - 1, -1)                                   # the steps that chose tokens
        logits = hf(expected).logits[:, steps]
        diff = (model(expected)[:, steps] - logits).abs().max().item()
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).min().item()
    assert margin >= max(10 * diff, 1e-5 * logits.abs().max().item()), f"near tie: margin {margin:.2e}, diff {diff:.2e}"
    assert got.shape == expected.shape == (2, ids.shape[1] + new)
    assert torch.equal(got, expected)


def test_reference_matches_torch(checkpoint):
    hf, path = checkpoint
    params, config = load_reference_params(path)
    model64, _ = load_model(path, dtype=torch.float64)
    ids = prompts(n=1, length=16)
    ref = reference.forward(params, config, ids[0].numpy())                 # [seq, vocab] float64
    with torch.no_grad():
        assert rel_err(model64(ids)[0], ref) <= 1e-10
        assert rel_err(hf(ids).logits[0], ref) <= 1e-4


def test_generate_eos_sampling_and_gqa_fallback(monkeypatch):
    from minillm.model import torch_model

    config = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = prompts(n=1, length=5)
    greedy = generate(model, ids, max_new_tokens=6)
    # stops right after the first eos; sampling is reproducible given a generator
    assert torch.equal(generate(model, ids, 6, eos_token_id=int(greedy[0, 5])), greedy[:, :6])
    sample = [generate(model, ids, 6, greedy=False, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(*sample) and sample[0].shape == (1, 11)
    # torch < 2.5 has no SDPA enable_gqa: the fallback repeats KV heads and must agree
    monkeypatch.setattr(torch_model, "SDPA_GQA", False)
    assert torch.equal(generate(model, ids, max_new_tokens=6), greedy)


def test_checkpoint_dtype(tmp_path):
    """bf16 weights load as bf16 by default (config `dtype`) and upcast exactly on request."""
    hf = hf_model("llama", num_hidden_layers=2, num_key_value_heads=2).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert config.dtype == "bfloat16" and model.lm_head.weight.dtype == torch.bfloat16
    model32, _ = load_model(tmp_path, dtype="float32")
    w = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(model32.state_dict()[w], model.state_dict()[w].float())
    ids = prompts()
    with torch.no_grad():
        assert rel_err(model(ids).float(), hf(ids).logits.float()) <= 2e-2


def test_loader_rejects_incomplete_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = hf_model("llama", num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(tmp_path)


# --- config.json edge cases ------------------------------------------------------------

BASE = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, hidden_act="silu")


def test_config_parsing():
    c = ModelConfig.from_dict({**BASE, "rope_theta": 5e5, "torch_dtype": "float16", "eos_token_id": [1, 2]})
    assert (c.rope_theta, c.dtype, c.head_dim, c.eos_token_ids, c.gqa_group) == (5e5, "float16", 16, [1, 2], 2)
    c = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                               "dtype": "bfloat16", "head_dim": 24, "tie_word_embeddings": True})
    assert (c.rope_theta, c.dtype, c.head_dim, c.tie_word_embeddings) == (1e6, "bfloat16", 24, True)
    c = ModelConfig.from_dict({**BASE, "rope_scaling": None, "num_key_value_heads": None})
    assert (c.rope_theta, c.num_key_value_heads, c.qkv_bias) == (10000.0, 4, False)
    c = ModelConfig.from_dict({**BASE, "model_type": "qwen2", "use_sliding_window": False})
    assert (c.qkv_bias, c.o_bias) == (True, False)


@pytest.mark.parametrize("override, field", [
    ({"model_type": "mistral"}, "model_type"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_type"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_config_rejects_unsupported(override, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict({**BASE, **override})


def test_config_from_transformers_v5_json(checkpoint):
    hf, path = checkpoint
    raw = json.loads((path / "config.json").read_text())
    c = ModelConfig.from_json(path)
    assert c.rope_theta == raw["rope_parameters"]["rope_theta"] == hf.config.rope_parameters["rope_theta"]
    assert c.head_dim == hf.config.head_dim and c.dtype == "float32"


# --- tokenizer ---------------------------------------------------------------------------

def test_tokenizer_and_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "<|user|>", "<|assistant|>", "hello", "world"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tokenizer, chat_template = load_tokenizer(tmp_path)
    assert chat_template == template
    assert tokenizer.encode("hello world").ids == [4, 5]
    pytest.importorskip("jinja2")
    text = render_chat(chat_template, [{"role": "user", "content": "hello"}])
    assert text == "<|user|> hello <|assistant|>"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert load_tokenizer(tmp_path)[1] is None
