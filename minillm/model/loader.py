"""Load a Hugging Face checkpoint from a local folder.

A folder holds ``config.json`` and the weights as ``*.safetensors``: one
``model.safetensors``, or shards listed in ``model.safetensors.index.json``
(``{"weight_map": {tensor name: shard file}}``). The tokenizer is ``tokenizer.json``
(the ``tokenizers`` library's format); the chat template, when there is one, sits in
``tokenizer_config.json`` (key ``chat_template``) or, since transformers v5, in
``chat_template.jinja``.

Whatever is wrong with a folder raises `CheckpointError` naming the file and the problem: a
missing or unreadable ``tokenizer.json``, a truncated shard, PyTorch ``.bin`` weights only, a
``config.json`` without a required key, tensors that do not match the config (`check_state_dict`,
the one check both the torch and the NumPy loader run).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from minillm.model.config import CheckpointError, ModelConfig
from minillm.model.torch_model import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint folder, in shard order."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (expected JSON with a \"weight_map\"): "
                                  f"{type(e).__name__}: {e}") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shard{'s' if len(missing) > 1 else ''} {', '.join(missing)}, "
                                  f"not in {path} (an interrupted download?)")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin") if p.name != "training_args.bin")
        if bins:
            raise CheckpointError(
                f"{path}: only PyTorch .bin weights ({', '.join(bins[:3])}{', ...' if len(bins) > 3 else ''}); "
                "minillm reads safetensors. Convert once with transformers: "
                "AutoModelForCausalLM.from_pretrained(PATH).save_pretrained(PATH) writes model.safetensors")
        raise CheckpointError(f"{path}: no weights (no *.safetensors file)")
    return files


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(file), device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError (an Exception)
        size = file.stat().st_size if file.exists() else 0
        raise CheckpointError(f"{file}: cannot read this safetensors file ({size:,} bytes): {e}. It is truncated "
                              "or corrupt: download or copy it again") from None


def load_state_dict(path: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint (CPU, dtype as stored), minus those we do not use:
    precomputed RoPE tables of old checkpoints, and ``lm_head.weight`` when it is tied."""
    state = {}
    for f in safetensors_files(path):
        state.update(_read_safetensors(f))
    for name in [n for n in state if n.endswith("rotary_emb.inv_freq")]:
        del state[name]
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` must hold, with its shape (Hugging Face names;
    no ``lm_head.weight`` when the embeddings are tied). The torch model's state dict has the
    same names and shapes; tests/test_checkpoint_errors.py checks it."""
    c = config
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    linears = {"self_attn.q_proj": (q, h, c.qkv_bias), "self_attn.k_proj": (kv, h, c.qkv_bias),
               "self_attn.v_proj": (kv, h, c.qkv_bias), "self_attn.o_proj": (h, q, c.o_bias),
               "mlp.gate_proj": (c.intermediate_size, h, c.mlp_bias), "mlp.up_proj": (c.intermediate_size, h, c.mlp_bias),
               "mlp.down_proj": (h, c.intermediate_size, c.mlp_bias)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, (out, inp, bias) in linears.items():
            shapes[p + name + ".weight"] = (out, inp)
            if bias:
                shapes[p + name + ".bias"] = (out,)
    if c.is_mla:  # Chapter 12: MLA's projections and norms instead of q/k/v/o_proj
        from minillm.model.mla import mla_attention_shapes
        attention = mla_attention_shapes(c)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}.self_attn."
            shapes = {n: s for n, s in shapes.items() if not n.startswith(p)} | {p + n: s for n, s in attention.items()}
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def _names(names, limit: int = 4) -> str:
    names = sorted(names, key=lambda n: (len(n.split(".")), n))
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_state_dict(path: str | Path, config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise `CheckpointError` unless the checkpoint's tensors (``shapes``: name -> shape, as
    `load_state_dict` returns them) are exactly those of ``config`` (`expected_shapes`): a
    missing tensor would be left random, an unexpected one means the config describes another
    model. The torch loader and the NumPy loader both call this, so both reject the same
    checkpoints with the same message."""
    expected = expected_shapes(config)
    missing, unexpected = expected.keys() - shapes.keys(), shapes.keys() - expected.keys()
    wrong = {n: (tuple(shapes[n]), expected[n]) for n in expected.keys() & shapes.keys()
             if tuple(shapes[n]) != expected[n]}
    if not (missing or unexpected or wrong):
        return
    problems = []
    if missing:
        problems.append(f"missing {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected {_names(unexpected)}")
    if wrong:
        problems.append("wrong shape " + ", ".join(f"{n} {got} (config.json: {want})"
                                                  for n, (got, want) in sorted(wrong.items())[:3]))
    hint = ""
    if any(n.endswith(".bias") for n in missing) and config.model_type == "qwen2":
        hint = " (Qwen2 always has q/k/v projection biases)"
    elif any(n.endswith(".bias") for n in missing | unexpected):
        hint = " (config.json's attention_bias / mlp_bias say which biases exist)"
    elif "lm_head.weight" in missing:
        hint = " (config.json says tie_word_embeddings=false)"
    raise CheckpointError(f"{path}: the weights do not match config.json{hint}: {'; '.join(problems)}")


def load_model(path: str | Path, device="cpu", dtype: torch.dtype | str | None = None):
    """``(model, config)``: the torch model in eval mode on ``device``.

    ``dtype`` defaults to the checkpoint's own (``dtype``/``torch_dtype`` in config.json,
    else float32). Every tensor the model needs must be in the files and nothing else may
    be: a mismatch raises instead of leaving a randomly initialised weight behind.
    """
    config = ModelConfig.from_json(Path(path) / "config.json")
    dtype = dtype or config.dtype or torch.float32
    if isinstance(dtype, str) and dtype not in DTYPES:
        raise CheckpointError(f"{Path(path) / 'config.json'}: unsupported dtype {dtype!r}; one of {sorted(DTYPES)}")
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    state = load_state_dict(path, config)
    check_state_dict(path, config, {k: tuple(v.shape) for k, v in state.items()})
    with torch.device("meta"):  # no memory, no random init: the checkpoint fills it in
        model = LlamaForCausalLM(config)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model.eval(), config


def load_reference_params(path: str | Path) -> tuple[dict[str, np.ndarray], ModelConfig]:
    """``(params, config)``: every tensor as a float64 NumPy array, for ``reference.forward``."""
    config = ModelConfig.from_json(Path(path) / "config.json")
    state = load_state_dict(path, config)
    check_state_dict(path, config, {k: tuple(v.shape) for k, v in state.items()})
    return {k: v.to(torch.float64).numpy() for k, v in state.items()}, config


def load_tokenizer(path: str | Path):
    """``(tokenizer, chat_template)``: a ``tokenizers.Tokenizer`` from ``tokenizer.json`` and
    the Jinja chat template string (``None`` when the checkpoint has none)."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"{file}: no such file. minillm reads the `tokenizers` library's tokenizer.json; "
                              "transformers writes one: AutoTokenizer.from_pretrained(PATH).save_pretrained(PATH). "
                              "Without it, give prompts as token ids (minillm.engine.LLM(PATH).generate([[1, 2, 3]]))")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception
        raise CheckpointError(f"{file}: not a valid tokenizer.json ({e})") from None
    template = None
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    elif (path / "tokenizer_config.json").exists():
        try:
            template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
        except (ValueError, AttributeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path / 'tokenizer_config.json'}: not a JSON object ({e})") from None
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
    return tokenizer, template


class NoTokenizer:
    """Stands in for the tokenizer of a checkpoint folder without ``tokenizer.json``: prompts
    must be token ids, completions are token ids (their text is empty), and text raises
    `CheckpointError` (what `minillm.engine.LLM` uses for such a folder)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def message(self) -> str:
        return (f"{self.path / 'tokenizer.json'}: no such file, so prompts must be token ids and completions have "
                "no text; text prompts and stop strings need a tokenizer.json (transformers writes one: "
                "AutoTokenizer.from_pretrained(PATH).save_pretrained(PATH))")

    def encode(self, text, *args, **kwargs):
        raise CheckpointError(self.message)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


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
