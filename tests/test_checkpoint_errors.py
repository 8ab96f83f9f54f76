"""Broken checkpoint folders get errors a user can act on: `CheckpointError` naming the file
and the problem, and from the ``minillm`` command one line ``minillm <command>: <message>`` on
stderr with exit status 2 (no traceback). The torch and the NumPy loader validate a
checkpoint with the same function, so they reject the same folders with the same message. A
folder without ``tokenizer.json`` still runs through `LLM` when prompts are token ids."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from minillm import BUNDLED_MODEL
from minillm.cli import main
from minillm.engine import LLM, SamplingParams
from minillm.model import CheckpointError, LlamaForCausalLM, ModelConfig, load_model, load_reference_params
from minillm.model.loader import expected_shapes, load_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPT_IDS = [12, 345, 6, 78, 901]


@pytest.fixture
def ckpt(tmp_path):
    """A copy of the bundled model, to break."""
    path = tmp_path / "ckpt"
    shutil.copytree(BUNDLED_MODEL, path)
    return path


def cli_error(capsys, *argv) -> str:
    """Run ``minillm argv...`` in-process; it must exit 2 with one ``minillm <cmd>:`` line."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"minillm {argv[0]}: ") and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


# == tokenizer.json ==============================================================================

def test_missing_tokenizer(ckpt, capsys):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json: no such file") as e:
        load_tokenizer(ckpt)
    assert str(ckpt / "tokenizer.json") in str(e.value)
    err = cli_error(capsys, "generate", "ROMEO:", "--model", str(ckpt), "--device", "cpu")
    assert str(ckpt / "tokenizer.json") in err and "token ids" in err
    pytest.importorskip("fastapi")   # `serve` needs the server's dependencies
    assert str(ckpt / "tokenizer.json") in cli_error(capsys, "serve", "--model", str(ckpt), "--device", "cpu")


def test_llm_runs_without_a_tokenizer_on_token_ids(ckpt):
    (ckpt / "tokenizer.json").unlink()
    llm = LLM(ckpt, device="cpu", num_blocks=64)
    (out,) = llm.generate([PROMPT_IDS], GREEDY, use_tqdm=False)
    want = LLM(BUNDLED_MODEL, device="cpu", num_blocks=64).generate([PROMPT_IDS], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids and len(want.outputs[0].token_ids) == 6
    assert out.outputs[0].text == "" and out.prompt_token_ids == PROMPT_IDS
    # A text prompt, or a stop string, needs the tokenizer: a clear error, and nothing is queued.
    with pytest.raises(CheckpointError, match="tokenizer.json: no such file, so prompts must be token ids"):
        llm.generate([PROMPT_IDS, "ROMEO:"], GREEDY, use_tqdm=False)
    with pytest.raises(CheckpointError, match="stop strings"):
        llm.generate(PROMPT_IDS, SamplingParams(max_tokens=4, stop=["\n"]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(PROMPT_IDS, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("content", ["{not json", '{"version": "1.0"}', ""])
def test_invalid_tokenizer(ckpt, capsys, content):
    (ckpt / "tokenizer.json").write_text(content)
    with pytest.raises(CheckpointError, match="tokenizer.json: not a valid tokenizer.json"):
        load_tokenizer(ckpt)
    err = cli_error(capsys, "generate", "ROMEO:", "--model", str(ckpt), "--device", "cpu")
    assert f"{ckpt / 'tokenizer.json'}: not a valid tokenizer.json" in err


# == weights =====================================================================================

def test_truncated_shard(ckpt, capsys):
    shard = ckpt / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    for load in (load_model, load_reference_params):
        with pytest.raises(CheckpointError, match="cannot read this safetensors file") as e:
            load(ckpt)
        assert str(e.value).startswith(f"{shard}: ") and "truncated" in str(e.value)
    assert str(shard) in cli_error(capsys, "generate", "ROMEO:", "--model", str(ckpt), "--device", "cpu")


def test_truncated_shard_from_python_dash_m(ckpt):
    """The real command line: ``python -m minillm`` (= ``minillm``), one line, no traceback."""
    shard = ckpt / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(1000)
    proc = subprocess.run([sys.executable, "-m", "minillm", "generate", "ROMEO:", "--model", str(ckpt), "--device",
                           "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"minillm generate: {shard}: cannot read this safetensors file"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_index_listing_a_missing_shard(ckpt):
    weight_map = {"model.embed_tokens.weight": "model.safetensors", "model.norm.weight": "model-00002-of-00002.safetensors"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="lists shards? model-00002-of-00002.safetensors, not in"):
        load_model(ckpt)
    (ckpt / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not a safetensors index"):
        load_reference_params(ckpt)


def test_only_bin_weights(ckpt, capsys):
    from safetensors.torch import load_file

    torch.save(load_file(str(ckpt / "model.safetensors")), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    for load in (load_model, load_reference_params):
        with pytest.raises(CheckpointError, match=r"only PyTorch \.bin weights \(pytorch_model\.bin\)") as e:
            load(ckpt)
        assert str(e.value).startswith(f"{ckpt}: ") and "save_pretrained" in str(e.value)
    with pytest.raises(CheckpointError, match="only PyTorch .bin weights"):
        LLM(ckpt, device="cpu")
    assert "only PyTorch .bin weights" in cli_error(capsys, "generate", "x", "--model", str(ckpt), "--device", "cpu")
    (ckpt / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match=r"no weights \(no \*\.safetensors file\)"):
        load_model(ckpt)


# == config.json =================================================================================

@pytest.mark.parametrize("key", ["vocab_size", "num_hidden_layers"])
def test_config_missing_a_required_key(ckpt, capsys, key):
    config = json.loads((ckpt / "config.json").read_text())
    del config[key]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"config.json: missing required key {key}"):
        ModelConfig.from_json(ckpt)
    for load in (load_model, load_reference_params):
        with pytest.raises(CheckpointError, match=key):
            load(ckpt)
    err = cli_error(capsys, "generate", "ROMEO:", "--model", str(ckpt), "--device", "cpu")
    assert f"{ckpt / 'config.json'}: missing required key {key}" in err


def test_config_not_json_and_unsupported(ckpt, capsys):
    (ckpt / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        ModelConfig.from_json(ckpt)
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    pytest.importorskip("fastapi")   # `serve` needs the server's dependencies
    err = cli_error(capsys, "serve", "--model", str(ckpt), "--device", "cpu")
    assert f"{ckpt / 'config.json'}: unsupported model_type='mistral'" in err


# == the same validation in both loaders ===========================================================

def _tiny_qwen2(path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def _rewrite(path, edit):
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    save_file(edit(state), str(path / "model.safetensors"), metadata={"format": "pt"})


def test_stripped_qwen2_biases_rejected_alike(tmp_path):
    path = _tiny_qwen2(tmp_path / "qwen2")
    load_model(path), load_reference_params(path)  # intact: both load
    _rewrite(path, lambda s: {k: v for k, v in s.items() if not k.endswith(("q_proj.bias", "k_proj.bias",
                                                                             "v_proj.bias"))})
    with pytest.raises(CheckpointError) as torch_error:
        load_model(path)
    with pytest.raises(CheckpointError) as numpy_error:
        load_reference_params(path)
    message = str(torch_error.value)
    assert message == str(numpy_error.value)
    assert message.startswith(f"{path}: the weights do not match config.json (Qwen2 always has q/k/v")
    assert "missing model.layers.0.self_attn.k_proj.bias" in message and "and 2 more" in message


def test_wrong_shape_and_extra_tensor_rejected_alike(tmp_path):
    path = _tiny_qwen2(tmp_path / "qwen2")

    def edit(state):
        state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:48].contiguous()
        state["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)
        return state

    _rewrite(path, edit)
    messages = set()
    for load in (load_model, load_reference_params):
        with pytest.raises(CheckpointError) as e:
            load(path)
        messages.add(str(e.value))
    (message,) = messages
    assert "unexpected model.layers.0.self_attn.o_proj.bias" in message
    assert "wrong shape model.layers.1.mlp.up_proj.weight (48, 32) (config.json: (64, 32))" in message


@pytest.mark.parametrize("overrides", [
    dict(model_type="llama", tie_word_embeddings=True),
    dict(model_type="llama", qkv_bias=True, o_bias=True, mlp_bias=True),
    dict(model_type="qwen2", qkv_bias=True, num_key_value_heads=1, head_dim=16),
])
def test_expected_shapes_are_the_torch_models(overrides):
    config = ModelConfig(**{**dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8), **overrides})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        got.pop("lm_head.weight")
    assert got == expected_shapes(config)
