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


def test_subcommands_and_serve_flags(capsys):
    from minillm.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in ("serve", "generate", "bench", "train"))
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--host", "--port", "--api-key", "--device", "--dtype", "--num-blocks", "--kv-cache-mb",
                 "--gpu-memory-utilization", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                 "--no-prefix-caching"):
        assert flag in out, flag
    assert "127.0.0.1" in out


def test_serve_with_a_missing_model_fails_clearly(tmp_path, capsys):
    from minillm.cli import main

    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err


def test_generate_several_prompts_and_samples(capsys):
    from minillm.cli import main

    assert main(["generate", "ROMEO:", "JULIET:", "--n", "2", "--max-new-tokens", "8", "--device", "cpu",
                 "--temperature", "0", "--stop", "zzz"]) == 0
    captured = capsys.readouterr()
    blocks = captured.out.split("--- completion ")[1:]
    assert len(blocks) == 4 and all("(length) ---" in b for b in blocks)
    assert [b.split("---\n", 1)[1].split(":")[0] for b in blocks] == ["ROMEO", "ROMEO", "JULIET", "JULIET"]
    assert "32 tokens" in captured.err
