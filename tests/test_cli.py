"""`minillm generate` end to end on a tiny local checkpoint: its text must be transformers'
greedy continuation of the same prompt."""
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")


def test_generate_matches_transformers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, initializer_range=0.3,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)

    prompt = "w5 w17 w42 w99"
    ids = torch.tensor([tok.encode(prompt).ids])
    hf.generation_config.eos_token_id = None
    want = hf.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()

    proc = subprocess.run([sys.executable, "-m", "minillm.cli", "generate", prompt, "--model", str(tmp_path),
                           "--max-new-tokens", "12", "--temperature", "0", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == tok.decode(ids[0].tolist() + want)
    assert "12 tokens" in proc.stderr


def test_generate_with_a_missing_model_fails_clearly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "minillm.cli", "generate", "hi", "--model", str(tmp_path / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--model" in proc.stderr and "nope" in proc.stderr


def test_generate_uses_the_bundled_model_by_default(monkeypatch):
    monkeypatch.delenv("MINILLM_MODEL", raising=False)
    proc = subprocess.run([sys.executable, "-m", "minillm.cli", "generate", "HAMLET:", "--max-new-tokens", "24",
                           "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("HAMLET:") and len(proc.stdout) > len("HAMLET:") + 40
    assert "24 tokens" in proc.stderr
