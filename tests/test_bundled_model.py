"""The model shipped in the repository (``minillm/checkpoints/shakespeare``).

It is a real Hugging Face-format Llama: transformers must load it and agree with minillm on
logits and greedy generations, the NumPy reference must agree with the torch model, and it
must have learned its domain (its loss on Shakespeare far below chance and below the same
tokens shuffled; its samples look like a play).
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from minillm.cli import BUNDLED_MODEL
from minillm.corpus import SAMPLE
from minillm.model import generate, load_model, load_reference_params, load_tokenizer, reference

PROMPTS = ["ROMEO:\nBut soft, what light", "KING HENRY V:\nOnce more unto the breach"]


@pytest.fixture(scope="module")
def bundled():
    model, config = load_model(BUNDLED_MODEL, dtype=torch.float32)
    tok, _ = load_tokenizer(BUNDLED_MODEL)
    return model, config, tok


def test_fits_the_repository_budget():
    size = sum(p.stat().st_size for p in BUNDLED_MODEL.iterdir())
    assert size <= 20e6, f"the bundled model folder is {size / 1e6:.1f} MB"
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] < config["num_attention_heads"]


def test_logits_and_greedy_generation_match_transformers(bundled):
    transformers = pytest.importorskip("transformers")
    model, _, tok = bundled
    hf = transformers.AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids])
        with torch.no_grad():
            ours, theirs = model(ids), hf(ids).logits
        assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max(), prompt
        new = 40
        want = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        got = generate(model, ids, max_new_tokens=new, greedy=True)
        assert torch.equal(got, want), f"{prompt!r}: {tok.decode(got[0].tolist())!r} vs {tok.decode(want[0].tolist())!r}"


def test_numpy_reference_matches_torch(bundled):
    params, config = load_reference_params(BUNDLED_MODEL)
    model64, _ = load_model(BUNDLED_MODEL, dtype=torch.float64)
    ids = bundled[2].encode(PROMPTS[0]).ids
    want = reference.forward(params, config, np.array(ids))
    with torch.no_grad():
        got = model64(torch.tensor([ids]))[0].numpy()
    assert np.abs(got - want).max() <= 1e-9 * np.abs(want).max()


def test_it_has_learned_shakespeare(bundled):
    model, config, tok = bundled
    ids = torch.tensor([tok.encode(SAMPLE.read_text()[:6000]).ids[:512]])
    shuffled = ids[:, torch.randperm(ids.shape[1], generator=torch.Generator().manual_seed(0))]

    def loss(x):
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(x)[0, :-1], x[0, 1:]).item()

    chance = np.log(config.vocab_size)
    assert loss(ids) < 4.0 < chance, f"loss {loss(ids):.2f} nats/token (chance {chance:.2f})"
    assert loss(ids) < loss(shuffled) - 2.0, "word order must matter to the model"


def test_samples_look_like_a_play(bundled):
    model, config, tok = bundled
    ids = torch.tensor([tok.encode("JULIET:\n").ids])
    out = generate(model, ids, max_new_tokens=200, greedy=False, temperature=0.8,
                   generator=torch.Generator().manual_seed(0))
    text = tok.decode(out[0].tolist())
    speakers = re.findall(r"^[A-Z][A-Za-z' ]+:$", text, flags=re.M)
    assert len(speakers) >= 2, text                     # speaker lines, as in the corpus
    words = re.findall(r"[a-z']+", text.lower())
    known = set(re.findall(r"[a-z']+", SAMPLE.read_text().lower()))
    assert len(words) >= 100 and np.mean([w in known for w in words]) >= 0.7, text
