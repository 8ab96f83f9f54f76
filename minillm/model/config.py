"""The model configuration, parsed from a Hugging Face ``config.json``.

Only what a Llama-family decoder needs is kept. Anything we do not implement (another
architecture, scaled RoPE, another activation, sliding-window attention) raises a
``ValueError`` naming the offending field: a loud error beats a silently wrong answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "deepseek_v2", "deepseek_v3")
#: DeepSeek-V2/V3: multi-head latent attention (Chapter 12, `minillm.model.mla`), dense MLPs only.
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
#: Keys of config.json without which the model has no shape.
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

__all__ = ["CheckpointError", "ModelConfig", "REQUIRED_KEYS", "SUPPORTED_MODEL_TYPES"]


class CheckpointError(ValueError):
    """A checkpoint folder minillm cannot use; the message names the file and the problem
    (``minillm`` commands print it and exit 2, without a traceback)."""


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int                     # may differ from hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False  # True: no lm_head.weight, the embedding is reused
    qkv_bias: bool = False             # q/k/v projections have a bias (always for Qwen2)
    o_bias: bool = False               # the output projection has a bias (Llama attention_bias)
    mlp_bias: bool = False
    dtype: str | None = None           # the weights' dtype as saved, e.g. "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Multi-head latent attention (DeepSeek-V2/V3, Chapter 12); kv_lora_rank None: not MLA.
    # For MLA, head_dim is a head's query/key width qk_nope_head_dim + qk_rope_head_dim.
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None     # None: no query compression (DeepSeek-V2-Lite)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False      # RoPE on interleaved pairs (DeepSeek's checkpoints)

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (`minillm.model.mla`)."""
        return self.kv_lora_rank is not None

    @property
    def latent_dim(self) -> int:
        """MLA: width of one token's cache row, ``kv_lora_rank + qk_rope_head_dim``."""
        return (self.kv_lora_rank or 0) + self.qk_rope_head_dim

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates: ``head_dim``, or MLA's ``qk_rope_head_dim``."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head: 1 is MHA, ``num_attention_heads`` is MQA."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        """Read ``config.json`` (or the folder holding it).

        Raises:
            CheckpointError: no such file, not JSON, a required key missing, or a feature minillm
                does not implement; the message starts with the file's path.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: no such file; a checkpoint folder holds config.json, its weights as "
                                  "*.safetensors and tokenizer.json")
        try:
            d = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise CheckpointError(f"{path}: expected a JSON object, got {type(d).__name__}")
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Parse and validate an HF config dict (transformers v4 or v5 layout)."""
        missing = [k for k in REQUIRED_KEYS if d.get(k) is None]
        if missing:
            raise ValueError(f"missing required key{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                             "(a Llama-family config.json gives the model's sizes)")
        model_type = d.get("model_type")
        if model_type is None:
            raise ValueError(f"no model_type; minillm supports {SUPPORTED_MODEL_TYPES}")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type={model_type!r}; minillm supports {SUPPORTED_MODEL_TYPES}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act={act!r}; only 'silu' (SwiGLU) is implemented")

        # RoPE: v4 keeps `rope_theta` top-level and scaling in `rope_scaling`; v5 puts both
        # in `rope_parameters` = {"rope_type": ..., "rope_theta": ...}.
        rope_theta = d.get("rope_theta", 10000.0)
        for key in ("rope_scaling", "rope_parameters"):
            rp = d.get(key)
            if not rp:
                continue
            if not isinstance(rp, dict):
                raise ValueError(f"unsupported {key}={rp!r}; expected a dict")
            rope_type = rp.get("rope_type", rp.get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"unsupported rope_type={rope_type!r} (in {key}); only 'default' RoPE is implemented")
            rope_theta = rp.get("rope_theta", rope_theta)
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"unsupported partial_rotary_factor={d['partial_rotary_factor']}")

        if model_type == "qwen2":
            if d.get("use_sliding_window", False):
                raise ValueError("unsupported use_sliding_window=True (Qwen2 sliding-window attention)")
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
        layer_types = d.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"unsupported layer_types={layer_types!r}; only 'full_attention' is implemented")

        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        if model_type in MLA_MODEL_TYPES:  # MLA has no KV heads; DeepSeek's num_key_value_heads means nothing
            kv_heads = heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        eos = d.get("eos_token_id")
        mla = _mla_fields(d, model_type) if model_type in MLA_MODEL_TYPES else {}
        if mla:
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            # MLA: a head's query/key width (HF's config.json says head_dim = qk_rope_head_dim)
            head_dim=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"] if mla else d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            dtype=d.get("dtype") or d.get("torch_dtype"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            **mla,
        )


def _mla_fields(d: dict, model_type: str) -> dict:
    """The MLA fields of a DeepSeek-V2/V3 ``config.json``. Raises `CheckpointError` when a
    layer is mixture-of-experts (minillm implements MLA with dense MLPs only)."""
    layers = d["num_hidden_layers"]
    if d.get("n_routed_experts"):
        first, freq = d.get("first_k_dense_replace") or 0, d.get("moe_layer_freq") or 1
        moe = [i for i in range(layers) if i >= first and i % freq == 0]
        if moe:
            raise CheckpointError(
                f"mixture-of-experts layers ({len(moe)} of {layers}: n_routed_experts={d['n_routed_experts']}, "
                f"first_k_dense_replace={first}) are not implemented; minillm runs DeepSeek's multi-head latent "
                f"attention with dense MLPs only (first_k_dense_replace >= num_hidden_layers)")
    missing = [k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if d.get(k) is None]
    if missing:
        raise ValueError(f"{model_type}: missing required key{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    if d["qk_rope_head_dim"] % 2:
        raise ValueError(f"qk_rope_head_dim={d['qk_rope_head_dim']} must be even (RoPE rotates pairs)")
    return dict(kv_lora_rank=d["kv_lora_rank"], q_lora_rank=d.get("q_lora_rank"),
                qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"],
                v_head_dim=d["v_head_dim"],
                # DeepSeek-V2 always rotates interleaved pairs; V3's config says (default True).
                rope_interleave=True if model_type == "deepseek_v2" else bool(d.get("rope_interleave", True)))
