"""Load a Hugging Face checkpoint from a local folder.

A folder holds ``config.json`` and the weights as ``*.safetensors``: one
``model.safetensors``, or shards listed in ``model.safetensors.index.json``
(``{"weight_map": {tensor name: shard file}}``). The tokenizer is ``tokenizer.json``
(the ``tokenizers`` library's format); the chat template, when there is one, sits in
``tokenizer_config.json`` (key ``chat_template``) or, since transformers v5, in
``chat_template.jinja``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from minillm.model.config import ModelConfig
from minillm.model.torch_model import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint folder, in shard order."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def load_state_dict(path: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint (CPU, dtype as stored), minus those we do not use:
    precomputed RoPE tables of old checkpoints, and ``lm_head.weight`` when it is tied."""
    from safetensors.torch import load_file

    state = {}
    for f in safetensors_files(path):
        state.update(load_file(str(f), device="cpu"))
    for name in [n for n in state if n.endswith("rotary_emb.inv_freq")]:
        del state[name]
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def load_model(path: str | Path, device="cpu", dtype: torch.dtype | str | None = None):
    """``(model, config)``: the torch model in eval mode on ``device``.

    ``dtype`` defaults to the checkpoint's own (``dtype``/``torch_dtype`` in config.json,
    else float32). Every tensor the model needs must be in the files and nothing else may
    be: a mismatch raises instead of leaving a randomly initialised weight behind.
    """
    config = ModelConfig.from_json(Path(path) / "config.json")
    dtype = dtype or config.dtype or torch.float32
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    state = load_state_dict(path, config)
    with torch.device("meta"):  # no memory, no random init: the checkpoint fills it in
        model = LlamaForCausalLM(config)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the config: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model.eval(), config


def load_reference_params(path: str | Path) -> tuple[dict[str, np.ndarray], ModelConfig]:
    """``(params, config)``: every tensor as a float64 NumPy array, for ``reference.forward``."""
    config = ModelConfig.from_json(Path(path) / "config.json")
    state = load_state_dict(path, config)
    return {k: v.to(torch.float64).numpy() for k, v in state.items()}, config


def load_tokenizer(path: str | Path):
    """``(tokenizer, chat_template)``: a ``tokenizers.Tokenizer`` from ``tokenizer.json`` and
    the Jinja chat template string (``None`` when the checkpoint has none)."""
    from tokenizers import Tokenizer

    path = Path(path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    template = None
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    elif (path / "tokenizer_config.json").exists():
        template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
    return tokenizer, template


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    """Render a chat template with Jinja2 (optional dependency), as HF's
    ``apply_chat_template(tokenize=False)`` does for plain templates."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover
        raise ImportError("rendering a chat template needs jinja2 (pip install jinja2)") from e

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **kwargs)
