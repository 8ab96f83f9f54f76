"""Back-of-the-envelope cost model for decoder-only LLM inference.

Everything in the book that talks about *how much work* or *how much memory* a
step of inference needs goes through this module, so the numbers in the prose,
the plots and the tests all come from one place.

Conventions (used everywhere below)
-----------------------------------
- **FLOPs** count a multiply-add as 2 floating-point operations, so a GEMM
  ``[m, k] @ [k, n]`` costs ``2·m·k·n`` FLOPs.
- **Bytes** are the *ideal* DRAM (HBM) traffic of one fused kernel: every input
  is read once and every output written once; nothing is re-read. Real kernels
  move at least this much.
- **Arithmetic intensity** is FLOPs / bytes, in FLOP/byte.
- Rates: ``peak_flops`` in FLOP/s, ``bandwidth`` in bytes/s.
- ``dtype_bytes`` is the element size of weights, activations and KV cache
  (2 for fp16/bf16, 1 for fp8/int8, 4 for fp32).
- "Per layer" functions cover *one* transformer layer. Attention functions cover
  *one sequence*; a batch of ``B`` independent sequences costs ``B`` times as much,
  because each sequence attends only to its own keys and values.
- Attention FLOPs count the two GEMM-like products ``Q·Kᵀ`` and ``P·V``; the
  softmax, scaling, masking and norms are ``O(L·H)`` and left out.

The four ``*_CONFIG`` constants reproduce the public ``config.json`` of real
models; see `ModelShape` for the field names.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

__all__ = [
    "ModelShape", "OpCost", "StepCosts",
    "LLAMA2_7B", "LLAMA2_70B", "LLAMA3_8B", "QWEN25_7B", "MODELS", "mha_shape",
    "gemm_flops", "gemm_bytes", "layer_gemms",
    "linear_flops", "linear_bytes", "attention_pairs", "attention_flops", "attention_bytes",
    "linear_cost", "attention_cost", "prefill_costs", "decode_costs", "intensity",
    "attainable", "ridge_point", "roofline_time", "step_time",
    "attention_linear_flop_ratio", "mha_flop_ratio", "quoted_flop_ratio", "crossover_context",
    "kv_bytes_per_token", "decode_temp_bytes_per_seq", "memory_needed", "max_batch",
    "with_kv_heads", "kv_variants", "KV_TABLE_SHAPES", "kv_cache_table",
    "lm_head_cost", "per_token_costs", "per_token_time", "generation_step_costs", "generation_costs",
    # kernels, by chapter
    "total_bytes", "per_array_bytes",
    "attention_head_flops", "nominal_attention_flops", "naive_attention_traffic",          # 1
    "kv_cache_bytes", "decode_attention_bytes",                                            # 2
    "online_softmax_traffic", "fa1_traffic", "tiled_attention_traffic", "traffic_comparison",  # 3
    "fa2_traffic", "nonmatmul_flops", "warp_partition_traffic",                            # 4
    "paged_decode_attention_bytes",                                                        # 5
    "split_workspace_bytes", "flash_decode_attention_bytes",                               # 7
    "kv_block_bytes",                                                                      # 9
    "ring_allreduce_bytes", "tp_allreduce_bytes_per_token", "tp_logits_gather_bytes_per_token",  # 13
]


# --------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer, in the vocabulary of HF ``config.json``.

    Attributes:
        name: label used in tables and plots.
        layers: number of transformer blocks (``num_hidden_layers``).
        hidden: model width ``D`` (``hidden_size``).
        heads: query heads ``H`` (``num_attention_heads``).
        kv_heads: key/value heads ``H_kv`` (``num_key_value_heads``); ``== heads`` is
            MHA, ``1`` is MQA, anything in between is GQA.
        head_dim: per-head width ``d`` (usually ``hidden // heads``).
        intermediate: MLP width ``I`` (``intermediate_size``).
        vocab: vocabulary size ``V`` (``vocab_size``).
        gated_mlp: True for SwiGLU-style MLPs (gate, up, down: three ``D×I`` matrices,
            Llama/Qwen); False for the classic two-matrix MLP (GPT-2).
        qkv_bias: True if the Q, K, V projections carry a bias (Qwen2).
        tied_embeddings: True if the LM head reuses the token-embedding matrix.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True
    qkv_bias: bool = False
    tied_embeddings: bool = False

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA)."""
        return self.heads // self.kv_heads

    @property
    def q_width(self) -> int:
        """Width of all query heads together, ``H·d``."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of all key (or all value) heads together, ``H_kv·d``."""
        return self.kv_heads * self.head_dim

    def linear_params_per_layer(self) -> int:
        """Number of weights in one layer's GEMMs (Q, K, V, O and the MLP); no biases/norms."""
        return sum(k * n for _, k, n in layer_gemms(self))

    def params(self) -> int:
        """Total parameter count: embeddings, all layers (GEMM weights, biases, two RMSNorms),
        final norm and LM head (unless tied)."""
        per_layer = self.linear_params_per_layer() + 2 * self.hidden
        if self.qkv_bias:
            per_layer += self.q_width + 2 * self.kv_width
        embed = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return embed + self.layers * per_layer + self.hidden + head

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes to hold all parameters (``M`` in the memory budget)."""
        return self.params() * dtype_bytes

    @classmethod
    def from_config(cls, config, name: str | None = None) -> "ModelShape":
        """The shape of a `minillm.model.config.ModelConfig` (or a Hugging Face ``config.json``
        dict, parsed with ``ModelConfig.from_dict``), e.g. the bundled tiny checkpoint::

            ModelShape.from_config(ModelConfig.from_json("minillm/checkpoints/shakespeare"))

        ``name`` defaults to the config's ``model_type``. Biases other than Q/K/V
        (``o_bias``, ``mlp_bias``) are not counted by `params` (no Llama/Qwen checkpoint has them).
        """
        if isinstance(config, dict):
            from minillm.model.config import ModelConfig  # pure Python: no torch import

            config = ModelConfig.from_dict(config)
        return cls(
            name=name or str(getattr(config, "model_type", "model")),
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            gated_mlp=True,
            qkv_bias=bool(config.qkv_bias),
            tied_embeddings=bool(config.tie_word_embeddings),
        )


def mha_shape(hidden: int, heads: int = 32, layers: int = 1, vocab: int = 32000) -> ModelShape:
    """The textbook MHA layer: ``head_dim = hidden/heads``, a non-gated MLP of width ``4·hidden``.

    Its weight GEMMs hold exactly ``12·D²`` parameters per layer (``4·D²`` for Q, K, V, O and
    ``8·D²`` for the MLP), the shape behind the classic ``L/(12·D)`` rule.
    """
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not a multiple of heads={heads}")
    return ModelShape(f"MHA D={hidden}", layers, hidden, heads, heads, hidden // heads,
                      4 * hidden, vocab, gated_mlp=False)


# Values from each model's public Hugging Face config.json.
LLAMA2_7B = ModelShape("Llama-2-7B", layers=32, hidden=4096, heads=32, kv_heads=32,
                       head_dim=128, intermediate=11008, vocab=32000)
LLAMA2_70B = ModelShape("Llama-2-70B", layers=80, hidden=8192, heads=64, kv_heads=8,
                        head_dim=128, intermediate=28672, vocab=32000)
LLAMA3_8B = ModelShape("Llama-3-8B", layers=32, hidden=4096, heads=32, kv_heads=8,
                       head_dim=128, intermediate=14336, vocab=128256)
QWEN25_7B = ModelShape("Qwen2.5-7B", layers=28, hidden=3584, heads=28, kv_heads=4,
                       head_dim=128, intermediate=18944, vocab=152064, qkv_bias=True)
MODELS = {m.name: m for m in (LLAMA2_7B, LLAMA2_70B, LLAMA3_8B, QWEN25_7B)}


# --------------------------------------------------------------------------- GEMMs
def gemm_flops(m: int, n: int, k: int) -> int:
    """FLOPs of ``[m, k] @ [k, n]``: ``2·m·n·k``."""
    return 2 * m * n * k


def gemm_bytes(m: int, n: int, k: int, dtype_bytes: int = 2) -> int:
    """Ideal bytes moved by ``[m, k] @ [k, n]``: read both inputs once, write the output once."""
    return dtype_bytes * (m * k + k * n + m * n)


def layer_gemms(shape: ModelShape) -> list[tuple[str, int, int]]:
    """The weight matrices of one layer as ``(name, in_features k, out_features n)``."""
    D, I = shape.hidden, shape.intermediate
    gemms = [("q", D, shape.q_width), ("k", D, shape.kv_width), ("v", D, shape.kv_width),
             ("o", shape.q_width, D)]
    if shape.gated_mlp:
        gemms += [("gate", D, I), ("up", D, I), ("down", I, D)]
    else:
        gemms += [("up", D, I), ("down", I, D)]
    return gemms


def linear_flops(shape: ModelShape, tokens: int) -> int:
    """FLOPs of one layer's weight GEMMs applied to ``tokens`` rows (all sequences of a batch
    together: the rows of every request share the same weights). Equals
    ``2·tokens·linear_params_per_layer``."""
    return sum(gemm_flops(tokens, n, k) for _, k, n in layer_gemms(shape))


def linear_bytes(shape: ModelShape, tokens: int, dtype_bytes: int = 2) -> int:
    """Ideal bytes of one layer's weight GEMMs on ``tokens`` rows: the weights once, plus
    each GEMM's input and output activations."""
    return sum(gemm_bytes(tokens, n, k, dtype_bytes) for _, k, n in layer_gemms(shape))


# --------------------------------------------------------------------------- attention
def attention_pairs(q_len: int, kv_len: int, causal: bool = True) -> int:
    """Number of (query, key) pairs that are actually scored.

    Queries are bottom-right aligned (query ``i`` sits at position ``kv_len - q_len + i``, as in
    `minillm.reference.ch01_naive_attention`). Causal: query at position ``p`` sees keys ``0..p``, so
    prefill (``q_len == kv_len == L``) scores ``L·(L+1)/2`` pairs and decode (``q_len == 1``)
    scores ``kv_len``.
    """
    if q_len > kv_len:
        raise ValueError(f"q_len={q_len} > kv_len={kv_len}")
    if not causal:
        return q_len * kv_len
    return q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2


def attention_flops(shape: ModelShape, q_len: int, kv_len: int, causal: bool = True) -> int:
    """FLOPs of ``Q·Kᵀ`` and ``P·V`` for one sequence in one layer:
    ``2 (products) · 2 (mul+add) · H · d · pairs``. Depends on the *query* heads only;
    GQA saves memory, not attention FLOPs."""
    return shape.heads * attention_head_flops(q_len, kv_len, shape.head_dim, causal)


def attention_bytes(shape: ModelShape, q_len: int, kv_len: int, dtype_bytes: int = 2) -> int:
    """Ideal bytes of a fused (FlashAttention-style) kernel for one sequence in one layer:
    read Q (``q_len·H·d``) and the cached K and V (``2·kv_len·H_kv·d``), write O (``q_len·H·d``).
    The ``L×L`` score matrix never touches memory."""
    return dtype_bytes * (2 * q_len * shape.q_width + 2 * kv_len * shape.kv_width)


# --------------------------------------------------------------------------- intensities
@dataclass(frozen=True)
class OpCost:
    """Work and traffic of one operation: ``flops`` (FLOP) and ``bytes`` (bytes)."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOP/byte."""
        return self.flops / self.bytes

    def __add__(self, other: "OpCost") -> "OpCost":
        return OpCost(self.flops + other.flops, self.bytes + other.bytes)

    def __mul__(self, factor: float) -> "OpCost":
        return OpCost(self.flops * factor, self.bytes * factor)

    __rmul__ = __mul__


@dataclass(frozen=True)
class StepCosts:
    """The two kinds of work in one layer of one forward step, for the whole batch."""

    linear: OpCost
    attention: OpCost

    @property
    def total(self) -> OpCost:
        return self.linear + self.attention


def intensity(flops, bytes_):
    """Arithmetic intensity ``flops / bytes_`` in FLOP/byte (works on NumPy arrays)."""
    return np.asarray(flops, dtype=float) / np.asarray(bytes_, dtype=float)


def linear_cost(shape: ModelShape, tokens: int, dtype_bytes: int = 2) -> OpCost:
    """`OpCost` of one layer's weight GEMMs on ``tokens`` rows."""
    return OpCost(linear_flops(shape, tokens), linear_bytes(shape, tokens, dtype_bytes))


def attention_cost(shape: ModelShape, q_len: int, kv_len: int, batch: int = 1,
                   dtype_bytes: int = 2, causal: bool = True) -> OpCost:
    """`OpCost` of one layer's attention for ``batch`` independent sequences.
    Both FLOPs and bytes scale with ``batch``, so the intensity does not."""
    one = OpCost(attention_flops(shape, q_len, kv_len, causal),
                 attention_bytes(shape, q_len, kv_len, dtype_bytes))
    return one * batch


def prefill_costs(shape: ModelShape, prompt_len: int, batch: int = 1,
                  dtype_bytes: int = 2) -> StepCosts:
    """One layer of prefill: ``batch`` prompts of ``prompt_len`` tokens, causal attention.
    The weight GEMMs see ``batch·prompt_len`` rows (matrix-matrix)."""
    return StepCosts(linear_cost(shape, batch * prompt_len, dtype_bytes),
                     attention_cost(shape, prompt_len, prompt_len, batch, dtype_bytes))


def decode_costs(shape: ModelShape, context: int, batch: int = 1,
                 dtype_bytes: int = 2) -> StepCosts:
    """One layer of one decode step: ``batch`` sequences each add 1 token and attend to
    ``context`` cached tokens (the new one included). The weight GEMMs see ``batch`` rows;
    each sequence's attention is its own matrix-vector product over its own cache."""
    return StepCosts(linear_cost(shape, batch, dtype_bytes),
                     attention_cost(shape, 1, context, batch, dtype_bytes))


# --------------------------------------------------------------------------- roofline
def attainable(intensity, peak_flops: float, bandwidth: float):
    """Roofline: the best FLOP/s a kernel of the given intensity (FLOP/byte) can reach on a
    machine with ``peak_flops`` (FLOP/s) and memory ``bandwidth`` (bytes/s):
    ``min(peak_flops, intensity·bandwidth)``."""
    return np.minimum(peak_flops, np.asarray(intensity, dtype=float) * bandwidth)


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """Intensity (FLOP/byte) where the roofline bends: below it a kernel is memory-bound."""
    return peak_flops / bandwidth


def roofline_time(flops, bytes_, peak_flops: float, bandwidth: float):
    """Lower bound on run time in seconds: ``max(flops/peak_flops, bytes_/bandwidth)``."""
    return np.maximum(np.asarray(flops, dtype=float) / peak_flops,
                      np.asarray(bytes_, dtype=float) / bandwidth)


def step_time(shape: ModelShape, costs: StepCosts, peak_flops: float, bandwidth: float,
              lm_head_rows: int = 0, dtype_bytes: int = 2) -> float:
    """Roofline lower bound (seconds) for a whole forward step: ``shape.layers`` layers of
    ``costs`` (linear and attention timed separately, as separate kernels) plus the LM head
    on ``lm_head_rows`` rows (one per sequence that samples a token)."""
    t = shape.layers * (roofline_time(costs.linear.flops, costs.linear.bytes, peak_flops, bandwidth)
                        + roofline_time(costs.attention.flops, costs.attention.bytes, peak_flops, bandwidth))
    if lm_head_rows:
        V, D = shape.vocab, shape.hidden
        t += roofline_time(gemm_flops(lm_head_rows, V, D), gemm_bytes(lm_head_rows, V, D, dtype_bytes),
                           peak_flops, bandwidth)
    return float(t)


# --------------------------------------------------------------------------- attention vs linear
def attention_linear_flop_ratio(shape: ModelShape, context, phase: str = "prefill"):
    """Exact ratio ``attention FLOPs / weight-GEMM FLOPs`` in one layer.

    - ``phase="prefill"``: a causal prompt of ``context`` tokens (equivalently, averaged over all
      tokens of a sequence of that length). For the textbook MHA layer this is ``(L+1)/(12·D)``.
    - ``phase="decode"``: the one new token at position ``context`` (it sees ``context`` keys).
      Twice the prefill average: ``L/(6·D)`` for the textbook layer.

    ``context`` may be an int or an array of ints.
    """
    L = np.asarray(context, dtype=float)
    lin_per_token = 2.0 * shape.linear_params_per_layer()
    if phase == "prefill":
        attn_per_token = 4.0 * shape.q_width * (L + 1) / 2  # L(L+1)/2 pairs over L tokens
    elif phase == "decode":
        attn_per_token = 4.0 * shape.q_width * L
    else:
        raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
    return attn_per_token / lin_per_token


def mha_flop_ratio(context, hidden):
    """Closed form for the textbook MHA layer (12·D² GEMM weights), causal prefill:
    ``attention / linear = (L + 1) / (12·D) ≈ L / (12·D)``."""
    return (np.asarray(context, dtype=float) + 1) / (12.0 * hidden)


def quoted_flop_ratio(context, hidden):
    """The rule of thumb often quoted in write-ups on KV-cache optimisation, ``(L + D) / (12·D)``.

    It equals ``L/(12·D) + 1/12``: the causal attention FLOPs per token (``≈ 2·L·D``) *plus the
    output projection W_O* (``2·D²``, one twelfth of the layer's ``24·D²`` GEMM FLOPs), over all
    of the layer's GEMM FLOPs. So it counts W_O on both sides; the consistent ratio is
    `mha_flop_ratio`. The two differ by the constant ``1/12``.
    """
    h = float(hidden)
    return (np.asarray(context, dtype=float) + h) / (12.0 * h)


def crossover_context(shape: ModelShape, phase: str = "prefill") -> float:
    """Context length (tokens) at which attention FLOPs equal the weight-GEMM FLOPs
    (`attention_linear_flop_ratio` ``== 1``). ``12·D − 1`` for the textbook MHA layer."""
    lin_per_token = 2.0 * shape.linear_params_per_layer()
    if phase == "prefill":
        return 2 * lin_per_token / (4.0 * shape.q_width) - 1
    if phase == "decode":
        return lin_per_token / (4.0 * shape.q_width)
    raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")


# --------------------------------------------------------------------------- memory budget
def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2) -> int:
    """KV-cache bytes per cached token (``β``): ``2 (K and V) · layers · H_kv · d · dtype_bytes``."""
    return kv_cache_bytes(1, shape.kv_heads, shape.head_dim, dtype_bytes, layers=shape.layers)


def decode_temp_bytes_per_seq(shape: ModelShape, dtype_bytes: int = 2) -> int:
    """An estimate of ``α``: temporaries one sequence needs during a decode step, in bytes.

    Layers run one after another, so only one layer's activations are live at a time:
    residual stream and its normed copy and the attention output (``3·D``), the fresh
    Q, K, V (``(H + 2·H_kv)·d``), the MLP's gate, up and product (``3·I``), all in
    ``dtype_bytes``; plus fp32 logits and fp32 probabilities for sampling (``2·V·4``).
    Prefill needs far more (it scales with the prompt length); engines cap it with a
    per-step token budget and reserve that workspace once, up front.
    """
    act = 3 * shape.hidden + shape.q_width + 2 * shape.kv_width + 3 * shape.intermediate
    return act * dtype_bytes + 2 * shape.vocab * 4


def memory_needed(weight_bytes: float, alpha: float, beta: float, batch: int,
                  total_tokens: float) -> float:
    """Right-hand side of the serving budget ``Mem ≥ M + α·BS + β·TN`` (bytes).

    Args:
        weight_bytes: ``M``, bytes of the weights.
        alpha: ``α``, temporary bytes per sequence in the batch.
        beta: ``β``, KV-cache bytes per cached token (`kv_bytes_per_token`).
        batch: ``BS``, sequences in the batch.
        total_tokens: ``TN``, tokens whose K and V are cached, over the whole batch.
    """
    return weight_bytes + alpha * batch + beta * total_tokens


def max_batch(mem_bytes: float, weight_bytes: float, alpha: float, beta: float,
              context: float, unshared: float = 1.0) -> int:
    """Largest ``BS`` with ``M + α·BS + β·TN ≤ Mem`` when every sequence holds ``context``
    tokens, of which a fraction ``unshared`` (the source's ``γ``) is its own (the rest is a
    shared prefix cached once): ``TN = unshared·context·BS``. So
    ``BS = floor((Mem − M) / (α + β·unshared·context))``; 0 if the weights alone do not fit.
    """
    free = mem_bytes - weight_bytes
    if free <= 0:
        return 0
    per_seq = alpha + beta * unshared * context
    if per_seq <= 0:
        raise ValueError("per-sequence memory must be positive")
    return int(math.floor(free / per_seq))


# --------------------------------------------------------------------------- KV-cache table
def with_kv_heads(shape: ModelShape, kv_heads: int, name: str | None = None) -> ModelShape:
    """``shape`` with ``kv_heads`` key/value heads (everything else unchanged): ``heads`` gives
    its MHA variant, ``1`` its MQA variant. The K and V projections shrink or grow with it, so
    `ModelShape.params` changes too. ``name`` defaults to ``"<name> (MHA)"``, ``"(MQA)"`` or
    ``"(GQA-<kv_heads>)"``."""
    if name is None:
        kind = "MHA" if kv_heads == shape.heads else "MQA" if kv_heads == 1 else f"GQA-{kv_heads}"
        name = f"{shape.name} ({kind})"
    return replace(shape, name=name, kv_heads=kv_heads)


def kv_variants(shape: ModelShape) -> list[ModelShape]:
    """``[MHA variant, shape itself, MQA variant]`` of one model, to show what sharing K/V heads
    saves (the shape itself is left out when it already is MHA or MQA)."""
    out = [with_kv_heads(shape, shape.heads)] if shape.kv_heads != shape.heads else [shape]
    if 1 < shape.kv_heads < shape.heads:
        out.append(shape)
    out.append(with_kv_heads(shape, 1) if shape.kv_heads != 1 else shape)
    return out


#: The models of the KV-cache table: the four real configs, then Llama-3-8B's MHA and MQA
#: variants (same model, 32 and 1 KV heads instead of 8).
KV_TABLE_SHAPES: tuple[ModelShape, ...] = (LLAMA2_7B, LLAMA2_70B, LLAMA3_8B, QWEN25_7B,
                                           with_kv_heads(LLAMA3_8B, 32), with_kv_heads(LLAMA3_8B, 1))


def _attention_kind(shape: ModelShape) -> str:
    if shape.kv_heads == shape.heads:
        return "MHA"
    return "MQA" if shape.kv_heads == 1 else f"GQA ({shape.group_size} q/kv)"


def kv_cache_table(shapes: Iterable[ModelShape] | None = None, mem_bytes: float = 80 * 2**30,
                   context: int = 4096, dtype_bytes: int = 2, kv_dtype_bytes: int | None = None,
                   unshared: float = 1.0) -> list[dict]:
    """One dict per model: its KV-cache size and the largest batch that fits ``mem_bytes``.

    Args:
        shapes: `ModelShape` objects (any, e.g. ``ModelShape.from_config(...)`` of the bundled
            checkpoint); default `KV_TABLE_SHAPES`.
        mem_bytes: accelerator memory in bytes (default 80 GiB, one H100 80GB).
        context: tokens each sequence holds (prompt + generated), for ``kv_bytes_per_seq``
            and ``max_batch``.
        dtype_bytes: element size of weights and activations.
        kv_dtype_bytes: element size of the KV cache (default ``dtype_bytes``).
        unshared: the fraction of each sequence's cache that is its own (see `max_batch`).

    Keys of each row: ``name``, ``layers``, ``heads``, ``kv_heads``, ``head_dim``,
    ``attention`` ("MHA" / "GQA (g q/kv)" / "MQA"), ``params``, ``weight_bytes`` (``M``),
    ``kv_bytes_per_token`` (``β``), ``kv_fraction_of_mha`` (``kv_heads / heads``: β over the
    MHA model's β), ``kv_bytes_per_seq`` (``β·context``), ``alpha_bytes`` (``α``,
    `decode_temp_bytes_per_seq`), ``max_batch`` (`max_batch`; 0 when the weights alone do
    not fit), ``max_tokens`` (``max_batch·context``), ``context``, ``mem_bytes``.
    """
    shapes = KV_TABLE_SHAPES if shapes is None else shapes
    kv_dtype_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    table = []
    for s in shapes:
        M = s.weight_bytes(dtype_bytes)
        alpha = decode_temp_bytes_per_seq(s, dtype_bytes)
        beta = kv_bytes_per_token(s, kv_dtype_bytes)
        bs = max_batch(mem_bytes, M, alpha, beta, context, unshared)
        table.append({
            "name": s.name, "layers": s.layers, "heads": s.heads, "kv_heads": s.kv_heads,
            "head_dim": s.head_dim, "attention": _attention_kind(s), "params": s.params(),
            "weight_bytes": M, "kv_bytes_per_token": beta, "kv_fraction_of_mha": s.kv_heads / s.heads,
            "kv_bytes_per_seq": beta * context, "alpha_bytes": alpha, "max_batch": bs,
            "max_tokens": bs * context, "context": context, "mem_bytes": mem_bytes,
        })
    return table


# --------------------------------------------------------------------------- one token, with and without the cache
def lm_head_cost(shape: ModelShape, rows: int, dtype_bytes: int = 2) -> OpCost:
    """`OpCost` of the LM head (``[rows, D] @ [D, V]``): weights once, ``rows`` hidden states in,
    ``rows`` logit vectors out."""
    D, V = shape.hidden, shape.vocab
    return OpCost(gemm_flops(rows, V, D), gemm_bytes(rows, V, D, dtype_bytes))


def _logit_rows(context: int, batch: int, cached: bool, logits: str) -> int:
    if logits not in ("last", "all"):
        raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
    return batch if cached or logits == "last" else batch * (context + 1)


def _step_layer_costs(shape: ModelShape, context: int, batch: int, cached: bool, dtype_bytes: int) -> StepCosts:
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    if cached:
        return decode_costs(shape, context + 1, batch, dtype_bytes)   # attends to context + itself
    return prefill_costs(shape, context + 1, batch, dtype_bytes)       # re-run the whole sequence


def per_token_costs(shape: ModelShape, context: int, batch: int = 1, cached: bool = True,
                    dtype_bytes: int = 2, logits: str = "last") -> OpCost:
    """Whole-model FLOPs and ideal bytes of the forward step that produces the next token of each
    of ``batch`` sequences, when ``context`` tokens are already known before the one fed in.

    The sequence so far is ``context + 1`` tokens: ``context`` earlier ones and the latest one
    (the token just sampled, at position ``context``; the model's ``start_pos``).

    - ``cached=True`` (one decode step, `decode_costs` with ``context + 1`` keys): every weight is
      read once and applied to ``batch`` rows; the new token's K and V are written (the K/V GEMM
      outputs) and the cache of ``context + 1`` tokens is read by attention. Per token this is
      ``≈ 2·N`` FLOPs (``N`` weights) plus ``4·layers·H·d·(context + 1)``: it grows **linearly**
      with the context, and so do its bytes (``kv_bytes_per_token · (context + 1)`` per sequence).
    - ``cached=False`` (no cache: recompute everything, `prefill_costs` of ``context + 1`` tokens):
      ``≈ 2·N·(context + 1)`` FLOPs in the weight GEMMs plus causal attention over
      ``(context + 1)(context + 2)/2`` pairs per head, i.e. ``O(context)`` per token from the
      GEMMs and ``O(context²)`` from attention (which overtakes the GEMMs past `crossover_context`).

    ``logits``: ``"last"`` counts the LM head on the last position only (all a sampler needs);
    ``"all"`` counts it on all ``context + 1`` positions, as ``model(ids)`` computes when
    nothing is cached (the extra logits are thrown away). With the cache there is only one
    position, so ``logits`` does not matter.

    Left out, as everywhere in this module: embedding lookup, norms, RoPE, softmax, sampling.
    """
    layer = _step_layer_costs(shape, context, batch, cached, dtype_bytes)
    rows = _logit_rows(context, batch, cached, logits)
    return layer.total * shape.layers + lm_head_cost(shape, rows, dtype_bytes)


def per_token_time(shape: ModelShape, context: int, peak_flops: float, bandwidth: float, batch: int = 1,
                   cached: bool = True, dtype_bytes: int = 2, logits: str = "last") -> float:
    """Roofline lower bound (seconds) of the step of `per_token_costs`: `step_time` of its
    layers (weight GEMMs and attention as separate kernels, each at ``max(flops/peak, bytes/bw)``)
    plus the LM head. Tokens per second is ``batch / per_token_time(...)``."""
    layer = _step_layer_costs(shape, context, batch, cached, dtype_bytes)
    rows = _logit_rows(context, batch, cached, logits)
    return step_time(shape, layer, peak_flops, bandwidth, lm_head_rows=rows, dtype_bytes=dtype_bytes)


def generation_step_costs(shape: ModelShape, prompt_len: int, new_tokens: int, batch: int = 1,
                          cached: bool = True, dtype_bytes: int = 2, logits: str = "last") -> list[OpCost]:
    """The `OpCost` of each step of generating ``new_tokens`` tokens after a ``prompt_len``-token
    prompt (entry ``k`` produces token ``k + 1``); ``np.cumsum`` of them gives the cumulative cost.

    Step 0 processes the prompt (a prefill of ``prompt_len`` tokens, context ``prompt_len − 1``)
    in both cases. With the cache, step ``k ≥ 1`` is a decode step at context
    ``prompt_len + k − 1``, so the cumulative cost grows **linearly** in ``new_tokens``, plus a
    quadratic attention term that stays small while the context is short next to `crossover_context`.
    Without the cache, step ``k`` re-runs a prefill of ``prompt_len + k`` tokens, so the
    cumulative GEMM work grows **quadratically** in ``new_tokens`` (``≈ N·n²`` FLOPs for
    ``n`` tokens from a short prompt), and the attention work cubically.
    """
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    if new_tokens < 0:
        raise ValueError(f"new_tokens must be >= 0, got {new_tokens}")
    steps = []
    for k in range(new_tokens):
        context = prompt_len - 1 + k
        steps.append(per_token_costs(shape, context, batch, cached=cached and k > 0,
                                     dtype_bytes=dtype_bytes, logits=logits))
    return steps


def generation_costs(shape: ModelShape, prompt_len: int, new_tokens: int, batch: int = 1,
                     cached: bool = True, dtype_bytes: int = 2, logits: str = "last") -> OpCost:
    """Total `OpCost` of `generation_step_costs` (prompt processing included)."""
    total = OpCost(0, 0)
    for step in generation_step_costs(shape, prompt_len, new_tokens, batch, cached, dtype_bytes, logits):
        total = total + step
    return total


# =========================================================================== kernels, by chapter
# The functions above model a whole layer with ideal traffic. The ones below count what one
# call of a chapter's kernel (or of its NumPy reference's schedule) computes or moves, with
# the kernel's own tiles. Units: FLOPs, bytes. A ``*_traffic`` function returns a per-array
# (or per-pass) breakdown ``{name: {"read": bytes, "write": bytes}}``; `total_bytes` adds one
# up. A ``*_bytes`` function returns a total. Where a count depends on a kernel's tiling
# (a block size, a split count), it is an argument; a default of ``None`` reads the kernel's
# constant lazily, so that importing this module never imports Triton.

def total_bytes(traffic: dict[str, dict[str, int]]) -> int:
    """Reads plus writes (bytes) of a traffic dict (`fa1_traffic`, `naive_attention_traffic`,
    `minillm.reference.ch03_online_softmax.HBM.bytes`: any ``{name: {"read": …, "write": …}}``)."""
    return sum(rw["read"] + rw["write"] for rw in traffic.values())


def per_array_bytes(traffic: dict[str, dict[str, int]]) -> dict[str, int]:
    """Reads plus writes (bytes) of each entry of a traffic dict: ``{name: bytes}``."""
    return {name: rw["read"] + rw["write"] for name, rw in traffic.items()}


# --------------------------------------------------------------------------- Chapter 1: naive attention
def attention_head_flops(q_len: int, kv_len: int, head_dim: int, causal: bool = True) -> int:
    """FLOPs of ``Q·Kᵀ`` and ``P·V`` for one query head of one sequence, counting only the
    (query, key) pairs that are scored (`attention_pairs`): ``4·d·pairs``. `attention_flops`
    is this times the query heads."""
    return 4 * head_dim * attention_pairs(q_len, kv_len, causal)


def nominal_attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool,
                            backward: bool = False) -> float:
    """FLOPs credited to attention by convention (the FlashAttention-2 paper's, used for every
    TFLOP/s the benchmarks report): ``4·B·H·q_len·kv_len·d`` for the forward (two matmuls of
    ``2·…`` each), halved when causal, whether or not a kernel skips the masked half; the
    backward is credited 2.5x the forward (five matmuls to the forward's two), whatever a
    kernel actually recomputes. (`attention_head_flops` counts the causal pairs exactly:
    ``L·(L+1)/2``, not ``L²/2``.)"""
    flops = 4.0 * batch * heads * q_len * kv_len * head_dim
    if causal:
        flops /= 2
    return flops * 2.5 if backward else flops


def naive_attention_traffic(batch: int, q_heads: int, kv_heads: int, q_len: int, kv_len: int,
                            head_dim: int, elem_bytes: int) -> dict[str, dict[str, int]]:
    """HBM bytes each pass of Chapter 1's `minillm.kernels.ch01_naive_attention.naive_attention`
    must move at least (every operand read once, every result written once):
    ``{pass: {"read": bytes, "write": bytes}}`` for the passes ``scores``, ``softmax``, ``pv``.

    The eight matrix reads/writes of the standard algorithm: pass 1 reads Q and K and writes S;
    pass 2 reads S and writes P; pass 3 reads P and V and writes O. S is fp32 (4 bytes), P and
    the inputs/outputs use ``elem_bytes``. The softmax pass also writes the fp32 lse vector.
    K and V are counted once per KV head (GQA shares them).
    """
    q = batch * q_heads * q_len * head_dim * elem_bytes
    kv = batch * kv_heads * kv_len * head_dim * elem_bytes  # K or V: GQA shares them, read once
    s_elems = batch * q_heads * q_len * kv_len
    lse = batch * q_heads * q_len * 4
    return {
        "scores": {"read": q + kv, "write": s_elems * 4},
        "softmax": {"read": s_elems * 4, "write": s_elems * elem_bytes + lse},
        "pv": {"read": s_elems * elem_bytes + kv, "write": q},
    }


# --------------------------------------------------------------------------- Chapter 2: the KV cache
def kv_cache_bytes(tokens: int, kv_heads: int, head_dim: int, elem_bytes: int = 2, layers: int = 1) -> int:
    """Bytes of the K and V caches of ``tokens`` cached tokens (all sequences together) in
    ``layers`` layers: ``2 (K and V) · layers · tokens · H_kv · d · elem_bytes``.
    `kv_bytes_per_token` is this for one token of a whole model."""
    return 2 * layers * tokens * kv_heads * head_dim * elem_bytes


def decode_attention_bytes(seq_lens, q_heads: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """HBM bytes one call of Chapter 2's `minillm.kernels.ch02_kv_cache.decode_attention` must
    move at least: each sequence's K and V over its length (read once, shared by the query heads
    of a group), q read, out written (``elem_bytes`` each) and the fp32 lse written.
    ``seq_lens``: an iterable of lengths."""
    lens = [int(n) for n in seq_lens]
    kv = kv_cache_bytes(sum(lens), kv_heads, head_dim, elem_bytes)
    q_and_out = 2 * len(lens) * q_heads * head_dim * elem_bytes
    return kv + q_and_out + len(lens) * q_heads * 4


# --------------------------------------------------------------------------- Chapter 3: online softmax, FA1 order
def online_softmax_traffic(rows: int, n_cols: int, in_bytes: int, out_bytes: int | None = None,
                           block_n: int | None = None) -> dict[str, int]:
    """HBM bytes one call of `minillm.kernels.ch03_online_softmax.online_softmax` moves:
    ``{"read", "write", "minimal"}`` (bytes).

    A streamed row is read twice (statistics, then output) and written once; a row that fits
    in one block (``n_cols <= block_n``; default the kernel's ``MAX_ONE_TILE``) is read once.
    Each row also writes its fp32 lse. ``minimal`` is what any softmax must move: read once,
    write once."""
    if block_n is None:
        from minillm.kernels.ch03_online_softmax import MAX_ONE_TILE as block_n
    out_bytes = in_bytes if out_bytes is None else out_bytes
    one_tile = n_cols <= block_n
    elems = rows * n_cols
    write = elems * out_bytes + rows * 4
    return {"read": elems * in_bytes * (1 if one_tile else 2), "write": write,
            "minimal": elems * in_bytes + write}


def fa1_traffic(batch: int, q_heads: int, q_len: int, kv_len: int, head_dim: int, elem_bytes: int,
                block_kv: int, acc_bytes: int = 4, stat_bytes: int = 4) -> dict[str, dict[str, int]]:
    """HBM bytes `minillm.reference.ch03_online_softmax.tiled_attention` (and the FA1-order
    Triton kernel) moves, per array: ``{name: {"read": bytes, "write": bytes}}`` for
    ``q, k, v, o, l, m, out, lse``.

    With ``Tc = ⌈kv_len / block_kv⌉`` outer iterations, per (batch, query head):

    - ``K, V``: read once, ``kv_len·d`` elements each (every query head reads its KV head
      itself: under GQA the heads of a group read the same K/V, counted each time);
    - ``Q``: read ``Tc`` times, ``Tc·q_len·d``: the price of K/V-outer order;
    - ``O`` (running output, ``acc_bytes`` per element: fp32 in the kernel) and ``ℓ, m``
      (``stat_bytes``): written and read back ``Tc - 1`` times, ``(Tc-1)·q_len·(d + 2)``
      each way;
    - ``out`` (``elem_bytes``) and ``lse`` (``stat_bytes``): written once.

    With ``Bc ≈ M/4d`` the ``Tc``-fold terms are ``≈ 4·N²·d²/M``: the paper's
    ``Θ(N²d²/M)``, against ``Θ(N²)`` for the naive algorithm. ``Tc = 1`` is the minimum: read
    Q, K, V once, write the output once."""
    tc = math.ceil(kv_len / block_kv) if kv_len else 0
    heads = batch * q_heads
    rows_e = heads * q_len * head_dim            # elements of Q (or O)
    revisits = max(tc - 1, 0)
    kv = heads * kv_len * head_dim * elem_bytes
    return {
        "q": {"read": tc * rows_e * elem_bytes, "write": 0},
        "k": {"read": kv, "write": 0},
        "v": {"read": kv, "write": 0},
        "o": {"read": revisits * rows_e * acc_bytes, "write": revisits * rows_e * acc_bytes},
        "l": {"read": revisits * heads * q_len * stat_bytes, "write": revisits * heads * q_len * stat_bytes},
        "m": {"read": revisits * heads * q_len * stat_bytes, "write": revisits * heads * q_len * stat_bytes},
        "out": {"read": 0, "write": (rows_e * elem_bytes) if tc else 0},
        "lse": {"read": 0, "write": (heads * q_len * stat_bytes) if tc else 0},
    }


def tiled_attention_traffic(batch: int, q_heads: int, q_len: int, kv_len: int, head_dim: int, elem_bytes: int,
                            block_n: int | None = None) -> dict[str, dict[str, int]]:
    """HBM bytes `minillm.kernels.ch03_online_softmax.tiled_attention` moves, per array
    (``q, k, v, o, l, m, out, lse``; ``{"read", "write"}`` each): `fa1_traffic` with the
    kernel's K/V block (``block_n``, default its ``FA1_BLOCK_N``) and its fp32 workspace. K/V
    are counted once per *query* head, as each program loads them itself (under GQA, repeats
    may come from L2)."""
    if block_n is None:
        from minillm.kernels.ch03_online_softmax import FA1_BLOCK_N as block_n
    return fa1_traffic(batch, q_heads, q_len, kv_len, head_dim, elem_bytes, block_n, acc_bytes=4, stat_bytes=4)


def traffic_comparison(seq_len: int, head_dim: int, sram_bytes: int | None = None,
                       elem_bytes: int = 2) -> dict[str, float]:
    """HBM bytes of one attention head (``q_len = kv_len = seq_len``): FlashAttention-1 with
    the paper's block sizes for ``sram_bytes`` (default the A100's,
    `minillm.reference.ch03_online_softmax.A100_SRAM_BYTES`) against Chapter 1's naive
    algorithm (`naive_attention_traffic`). Returns ``block_q, block_kv`` (elements),
    ``fa1_bytes, naive_bytes`` (bytes) and ``naive_over_fa1``."""
    from minillm.reference.ch03_online_softmax import A100_SRAM_BYTES, fa1_block_sizes

    sram_bytes = A100_SRAM_BYTES if sram_bytes is None else sram_bytes
    br, bc = fa1_block_sizes(sram_bytes, head_dim, elem_bytes)
    naive = total_bytes(naive_attention_traffic(1, 1, 1, seq_len, seq_len, head_dim, elem_bytes))
    fa1 = total_bytes(fa1_traffic(1, 1, seq_len, seq_len, head_dim, elem_bytes, bc))
    return {"block_q": br, "block_kv": bc, "fa1_bytes": fa1, "naive_bytes": naive, "naive_over_fa1": naive / fa1}


# --------------------------------------------------------------------------- Chapter 4: FlashAttention-2
def fa2_traffic(batch: int, q_heads: int, q_len: int, kv_len: int, head_dim: int, block_m: int, block_n: int,
                causal: bool = False, window: int | None = None, elem_bytes: int = 2) -> dict[str, dict[str, int]]:
    """HBM bytes of the FlashAttention-2 forward (`minillm.reference.ch04_flash_attention.fa2_forward`,
    one program per ``block_m`` query rows), per array ``q, k, v, o, lse``
    (``{"read", "write"}`` each): Q read and O written once (``elem_bytes``), the fp32 lse
    written once, K and V read once per (query head, Q block) that does not skip their
    ``block_n``-key block (`minillm.reference.ch04_flash_attention.classify_blocks`)."""
    from minillm.reference.ch04_flash_attention import SKIP, block_slices, classify_blocks

    classes = classify_blocks(q_len, kv_len, block_m, block_n, causal, window)
    widths = np.array([s.stop - s.start for s in block_slices(kv_len, block_n)])
    keys_read = int((widths[None, :] * (classes != SKIP)).sum())       # per query head
    heads = batch * q_heads
    return {"q": {"read": heads * q_len * head_dim * elem_bytes, "write": 0},
            "k": {"read": heads * keys_read * head_dim * elem_bytes, "write": 0},
            "v": {"read": heads * keys_read * head_dim * elem_bytes, "write": 0},
            "o": {"read": 0, "write": heads * q_len * head_dim * elem_bytes},
            "lse": {"read": 0, "write": heads * q_len * 4}}


def nonmatmul_flops(q_len: int, kv_len: int, head_dim: int, block_m: int, block_n: int, style: str = "fa2",
                    causal: bool = False, window: int | None = None) -> dict[str, int]:
    """Count the floating-point operations of one attention head, FA1-style or FA2-style.

    Runs the loops of `minillm.reference.ch04_flash_attention.fa2_forward` (one program per Q
    block, the K/V blocks it does not skip streaming past) for one head, on zeros since the
    values do not matter, with ``style="fa2"``'s ``fa2_tile_step`` and ``fa2_finalize`` or
    ``style="fa1"``'s ``fa1_tile_step`` and ``fa1_finalize`` (all in that module), and returns
    what the steps counted: ``exp``, ``mul``, ``add`` (subtractions included), ``max``,
    ``div`` and ``log``, their total ``nonmatmul``, and ``matmul`` (the two products of a
    tile, ``2·r·c·d`` FLOPs each). Skipped blocks cost nothing; masked ones cost a whole
    tile, as in the kernel.

    The difference is change (2) of FlashAttention-2. Per row and visited K/V block, FA1
    spends ``d + 2`` more multiplies, one more exp, one more add and ``d`` divisions, where
    FA2 divides ``d`` times per row in all. (The loop order plays no part: it moves memory
    traffic, not arithmetic.) Why it matters: a GPU's tensor cores run matmuls far faster
    than its other units run anything else (A100: 312 TFLOP/s of fp16 matmul, 19.5 TFLOP/s
    of non-matmul fp32), so a non-matmul FLOP costs as much time as some 16 matmul FLOPs.
    """
    from collections import Counter

    from minillm.reference import ch04_flash_attention as fa

    styles = {"fa1": (fa.fa1_tile_step, fa.fa1_finalize), "fa2": (fa.fa2_tile_step, fa.fa2_finalize)}
    if style not in styles:
        raise ValueError(f"style must be 'fa1' or 'fa2', got {style!r}")
    step, finalize = styles[style]
    q, k, v = np.zeros((q_len, head_dim)), np.zeros((kv_len, head_dim)), np.zeros((kv_len, head_dim))
    classes = fa.classify_blocks(q_len, kv_len, block_m, block_n, causal, window)
    flops: Counter = Counter()
    for i, rows in enumerate(fa.block_slices(q_len, block_m)):
        n_rows = rows.stop - rows.start
        state = (np.zeros((n_rows, head_dim)), np.zeros(n_rows), np.full(n_rows, -np.inf))
        for j, cols in enumerate(fa.block_slices(kv_len, block_n)):
            if classes[i, j] != fa.SKIP:
                state = step(q[rows], k[cols], v[cols], *state, 1.0, None, flops)
        finalize(*state, flops)
    counts = {kind: flops[kind] for kind in ("exp", "mul", "add", "max", "div", "log")}
    counts["nonmatmul"] = sum(counts.values())
    counts["matmul"] = flops["matmul"]
    return counts


def warp_partition_traffic(block_m: int, block_n: int, head_dim: int, warps: int, split: str,
                           elem_bytes: int = 2, acc_bytes: int = 4) -> dict[str, int]:
    """Shared-memory traffic (bytes) and barriers of one tile step of
    `minillm.reference.ch04_flash_attention.simulate_warp_split`, closed form:
    ``{"operand_read_bytes", "exchange_write_bytes", "exchange_read_bytes", "barriers"}``.

    ``Br = block_m`` rows, ``Bc = block_n`` keys, ``d = head_dim``, ``W = warps``; operands
    (Q, K, V) are ``elem_bytes`` each, exchanged partials ``acc_bytes`` (fp32).

    - split-Q (FlashAttention-2): operand reads ``(Br·d + W·2·Bc·d)·elem_bytes`` (every warp
      reads all of K and V); nothing exchanged, no barrier.
    - split-K (FlashAttention-1): operand reads ``(W·Br·d + 2·Bc·d)·elem_bytes`` (every warp
      reads all of Q); exchanged per step, ``acc_bytes`` each: partial maxima (``W·Br``
      written, ``W·W·Br`` read: every warp reads all of them), partial sums (``W·Br`` each
      way) and partial outputs (``W·Br·d`` each way); two barriers.

    Operand reads favour neither scheme in general: split-Q has every warp read K and V,
    split-K has every warp read Q. The difference is the exchange. At ``Br = Bc = d = 64``
    with 4 warps, split-Q reads 72 KiB of operands per tile step and that is all; split-K
    reads 48 KiB of operands, but also writes 66 KiB of partial results to shared memory and
    reads 69 KiB back, and stops every warp at two barriers. (Both also need a barrier per
    step before the K/V tile can be refilled; it is not counted here.)
    """
    from minillm.reference.ch04_flash_attention import check_warp_split

    check_warp_split(block_m, block_n, warps, split)
    br, bc, d, w = block_m, block_n, head_dim, warps
    if split == "q":
        return {"operand_read_bytes": (br * d + w * 2 * bc * d) * elem_bytes,
                "exchange_write_bytes": 0, "exchange_read_bytes": 0, "barriers": 0}
    return {"operand_read_bytes": (w * br * d + 2 * bc * d) * elem_bytes,
            "exchange_write_bytes": (w * br + w * br + w * br * d) * acc_bytes,
            "exchange_read_bytes": (w * w * br + w * br + w * br * d) * acc_bytes,
            "barriers": 2}


# --------------------------------------------------------------------------- Chapter 5: paged attention
def paged_decode_attention_bytes(seq_lens, q_heads: int, kv_heads: int, head_dim: int, elem_bytes: int,
                                 block_size: int | None = None) -> int:
    """HBM bytes one call of `minillm.kernels.ch05_paged_attention.paged_decode_attention` must
    move at least: those of Chapter 2's contiguous kernel (`decode_attention_bytes`: K and V
    over each sequence's length, q, out, lse) plus, given ``block_size``, the int32 table
    entries that cover each length (read once). ``seq_lens``: an iterable of lengths."""
    lens = [int(n) for n in seq_lens]
    table = 0 if block_size is None else 4 * sum(-(-n // block_size) for n in lens)
    return decode_attention_bytes(lens, q_heads, kv_heads, head_dim, elem_bytes) + table


# --------------------------------------------------------------------------- Chapter 7: flash-decoding
def split_workspace_bytes(batch: int, q_heads: int, num_splits: int, head_dim: int) -> int:
    """HBM bytes the split workspace adds to a `minillm.kernels.ch07_flash_decoding.flash_decode_attention`
    call with ``num_splits > 1``: stage 1 writes ``(head_dim + 1)`` fp32 per (sequence, query
    head, split) and stage 2 reads them back; 0 with one split (no workspace)."""
    if num_splits <= 1:
        return 0
    return 2 * batch * q_heads * num_splits * (head_dim + 1) * 4


def flash_decode_attention_bytes(seq_lens, q_heads: int, kv_heads: int, head_dim: int, elem_bytes: int,
                                 block_size: int | None = None, num_splits: int = 1) -> int:
    """HBM bytes one `minillm.kernels.ch07_flash_decoding.flash_decode_attention` call moves at
    least: those of Chapter 5's kernel (`paged_decode_attention_bytes`: K, V, q, out, lse,
    table) plus the workspace (`split_workspace_bytes`). The benchmark reports bandwidth over
    the first part only (the useful bytes), so that the workspace shows up as lost bandwidth."""
    lens = [int(n) for n in seq_lens]
    return (paged_decode_attention_bytes(lens, q_heads, kv_heads, head_dim, elem_bytes, block_size)
            + split_workspace_bytes(len(lens), q_heads, num_splits, head_dim))


# --------------------------------------------------------------------------- Chapter 9: the engine
def kv_block_bytes(num_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one block id of the engine's KV pool: its ``block_size`` rows of K and of V in
    every layer (`kv_cache_bytes` of ``block_size`` tokens)."""
    return kv_cache_bytes(block_size, kv_heads, head_dim, dtype_bytes, layers=num_layers)


# --------------------------------------------------------------------------- Chapter 11: virtual memory
# vAttention keeps the keys and the values of each layer in their own virtual tensor; physical
# pages of ``page_bytes`` (2 MB through CUDA's cuMemCreate) are mapped behind a request's
# stretch of each tensor as it grows.
def vmm_bytes_per_token_layer(kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of one token in one virtual tensor (the K, or the V, of one layer):
    ``H_kv · d · dtype_bytes`` (2 KiB for Llama-3-8B in bf16; half of `gqa_kv_bytes_per_token`)."""
    return kv_heads * head_dim * dtype_bytes


def vmm_pages_per_tensor(tokens, bytes_per_token: int, page_bytes: int) -> np.ndarray:
    """Pages of one virtual tensor that ``tokens`` (an int or an array) tokens touch:
    ``ceil(tokens · bytes_per_token / page_bytes)``."""
    tokens = np.asarray(tokens, dtype=np.int64)
    return -(-tokens * bytes_per_token // page_bytes)


def vmm_slot_bytes(max_len: int, bytes_per_token: int, page_bytes: int) -> int:
    """Virtual bytes of one request's slot: room for ``max_len`` tokens, rounded up to whole
    pages (so that two requests never share a physical page)."""
    return int(vmm_pages_per_tensor(max_len, bytes_per_token, page_bytes)) * page_bytes


def vmm_mapped_waste_bytes(tokens, bytes_per_token: int, page_bytes: int) -> np.ndarray:
    """Mapped bytes that hold no token, per request and tensor: the unused tail of the last
    page, ``pages · page_bytes − tokens · bytes_per_token`` (less than one page)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    return vmm_pages_per_tensor(tokens, bytes_per_token, page_bytes) * page_bytes - tokens * bytes_per_token


def vmm_pages_needed(tokens: int, kv_heads: int, head_dim: int, page_bytes: int, dtype_bytes: int = 2,
                     layers: int = 1) -> int:
    """Physical pages a request of ``tokens`` tokens holds: ``ceil(tokens · b / page_bytes)``
    per virtual tensor (``b`` = `vmm_bytes_per_token_layer`), times ``2 · layers`` tensors."""
    per_tensor = int(vmm_pages_per_tensor(tokens, vmm_bytes_per_token_layer(kv_heads, head_dim, dtype_bytes),
                                          page_bytes))
    return 2 * layers * per_tensor


def vmm_tokens_per_page(kv_heads: int, head_dim: int, page_bytes: int, dtype_bytes: int = 2) -> float:
    """Tokens one page holds in one tensor: the block size a page amounts to (1024 for
    Llama-3-8B in bf16 with 2 MB pages; 8192 with one KV head per GPU under 8-way TP)."""
    return page_bytes / vmm_bytes_per_token_layer(kv_heads, head_dim, dtype_bytes)


__all__ += ["vmm_bytes_per_token_layer", "vmm_pages_per_tensor", "vmm_slot_bytes", "vmm_mapped_waste_bytes",
            "vmm_pages_needed", "vmm_tokens_per_page"]  # Chapter 11


# --------------------------------------------------------------------------- Chapter 13: tensor parallelism
def ring_allreduce_bytes(size_bytes: float, world: int) -> float:
    """Bytes each of ``world`` ranks sends (and receives) in a ring all-reduce of a
    ``size_bytes`` buffer: a reduce-scatter then an all-gather, each ``world - 1`` steps of
    ``size_bytes / world``: ``2 (N - 1) / N · size``. 0 for one rank."""
    return 2 * (world - 1) / world * size_bytes if world > 1 else 0.0


def tp_allreduce_bytes_per_token(shape: ModelShape, tp: int, dtype_bytes: int = 2, embedding: bool = True) -> float:
    """Bytes each rank sends per token of a forward pass under Megatron-style tensor
    parallelism over ``tp`` ranks (ring all-reduces): two all-reduces of the ``hidden``-wide
    activation per layer (after the row-parallel o and down projections), plus one for the
    vocabulary-parallel embedding when ``embedding``. The logits' all-gather is
    `tp_logits_gather_bytes_per_token`. Prefill or decode, it is the same per token: the
    all-reduced activation is ``[tokens, hidden]``."""
    count = 2 * shape.layers + (1 if embedding else 0)
    return count * ring_allreduce_bytes(shape.hidden * dtype_bytes, tp)


def tp_logits_gather_bytes_per_token(shape: ModelShape, tp: int, dtype_bytes: int = 2) -> float:
    """Bytes each rank sends per sampled token when the vocabulary-parallel logits are
    all-gathered: its ``V / tp`` logits to each of the ``tp - 1`` others (ring all-gather:
    ``(tp - 1) / tp · V`` elements)."""
    return (tp - 1) / tp * shape.vocab * dtype_bytes if tp > 1 else 0.0


# --------------------------------------------------------------------------- Chapter 12: multi-head latent attention
# KV-cache bytes per token and per layer of the four ways to cache attention's keys and values
# (``dtype_bytes`` per element). MHA caches a key and a value per head, GQA per KV head, MQA
# one pair; MLA (DeepSeek-V2) caches one latent vector of ``kv_lora_rank`` plus the shared
# rotary key of ``qk_rope_head_dim``, from which every head's key and value are recomputed
# (or, in the absorbed form, attended over directly).
def mha_kv_bytes_per_token(heads: int, head_dim: int, dtype_bytes: int = 2, v_head_dim: int | None = None) -> int:
    """MHA: ``heads · (d_k + d_v) · dtype_bytes`` (``v_head_dim`` defaults to ``head_dim``)."""
    return heads * (head_dim + (head_dim if v_head_dim is None else v_head_dim)) * dtype_bytes


def gqa_kv_bytes_per_token(kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """GQA: ``2 · H_kv · d · dtype_bytes``."""
    return 2 * kv_heads * head_dim * dtype_bytes


def mqa_kv_bytes_per_token(head_dim: int, dtype_bytes: int = 2) -> int:
    """MQA: one key and one value, ``2 · d · dtype_bytes``."""
    return 2 * head_dim * dtype_bytes


def mla_kv_bytes_per_token(kv_lora_rank: int, qk_rope_head_dim: int, dtype_bytes: int = 2) -> int:
    """MLA: ``(d_c + d_R) · dtype_bytes``, the latent and the decoupled rotary key, whatever the
    number of heads (1152 bytes in bf16 for DeepSeek-V2/V3's 512 + 64)."""
    return (kv_lora_rank + qk_rope_head_dim) * dtype_bytes


def mla_equivalent_gqa_groups(kv_lora_rank: int, qk_rope_head_dim: int, head_dim: int) -> float:
    """The number of GQA groups (KV heads of ``head_dim``) that cache as many elements per
    token as MLA: ``(d_c + d_R) / (2 d)``; DeepSeek-V2's paper: 2.25 for 512 + 64 and d = 128."""
    return (kv_lora_rank + qk_rope_head_dim) / (2 * head_dim)


@dataclass(frozen=True)
class AttentionCacheShape:
    """What a model's attention caches, from its public ``config.json``: ``kind`` is ``"MHA"``,
    ``"GQA"``, ``"MQA"`` or ``"MLA"``; ``head_dim`` is the query/key width per head
    (``qk_nope_head_dim + qk_rope_head_dim`` for MLA) and ``v_head_dim`` the value width."""
    name: str
    kind: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def kv_bytes_per_token_layer(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes per token in one layer."""
        if self.kind == "MLA":
            return mla_kv_bytes_per_token(self.kv_lora_rank, self.qk_rope_head_dim, dtype_bytes)
        return self.kv_heads * (self.head_dim + self.v_head_dim) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes per token, all layers."""
        return self.layers * self.kv_bytes_per_token_layer(dtype_bytes)

    def mha_bytes_per_token_layer(self, dtype_bytes: int = 2) -> int:
        """What the same heads would cache as MHA (every head its own key and value)."""
        return mha_kv_bytes_per_token(self.heads, self.head_dim, dtype_bytes, self.v_head_dim)


# Values from each model's public Hugging Face config.json.
LLAMA2_7B_CACHE = AttentionCacheShape("Llama-2-7B", "MHA", layers=32, heads=32, kv_heads=32, head_dim=128,
                                      v_head_dim=128)
LLAMA3_8B_CACHE = AttentionCacheShape("Llama-3-8B", "GQA", layers=32, heads=32, kv_heads=8, head_dim=128,
                                      v_head_dim=128)
#: deepseek-ai/DeepSeek-V2-Lite: 27 layers, 16 heads, kv_lora_rank 512, qk_rope_head_dim 64,
#: qk_nope_head_dim 128, v_head_dim 128, q_lora_rank null (hidden 2048).
DEEPSEEK_V2_LITE_CACHE = AttentionCacheShape("DeepSeek-V2-Lite", "MLA", layers=27, heads=16, kv_heads=1,
                                             head_dim=192, v_head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64)
#: deepseek-ai/DeepSeek-V3: 61 layers, 128 heads, kv_lora_rank 512, qk_rope_head_dim 64,
#: qk_nope_head_dim 128, v_head_dim 128, q_lora_rank 1536 (hidden 7168).
DEEPSEEK_V3_CACHE = AttentionCacheShape("DeepSeek-V3", "MLA", layers=61, heads=128, kv_heads=1, head_dim=192,
                                        v_head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64)
MLA_TABLE_SHAPES = (LLAMA2_7B_CACHE, LLAMA3_8B_CACHE, DEEPSEEK_V2_LITE_CACHE, DEEPSEEK_V3_CACHE)


def mla_kv_table(shapes: Iterable[AttentionCacheShape] = MLA_TABLE_SHAPES, dtype_bytes: int = 2,
                 context: int = 32768) -> list[dict]:
    """One row per model: ``name``, ``kind``, ``layers``, ``heads``, ``bytes_per_token_layer``,
    ``bytes_per_token`` (all layers), ``mha_bytes_per_token_layer`` (the same heads as MHA),
    ``vs_mha`` (the fraction of that), and ``gib_per_sequence`` (one sequence of ``context``
    tokens, all layers)."""
    rows = []
    for s in shapes:
        per_layer = s.kv_bytes_per_token_layer(dtype_bytes)
        rows.append({"name": s.name, "kind": s.kind, "layers": s.layers, "heads": s.heads,
                     "bytes_per_token_layer": per_layer, "bytes_per_token": s.kv_bytes_per_token(dtype_bytes),
                     "mha_bytes_per_token_layer": s.mha_bytes_per_token_layer(dtype_bytes),
                     "vs_mha": per_layer / s.mha_bytes_per_token_layer(dtype_bytes),
                     "gib_per_sequence": context * s.kv_bytes_per_token(dtype_bytes) / 2**30})
    return rows


def mla_decode_bytes(seq_lens, heads: int, kv_lora_rank: int, qk_rope_head_dim: int, elem_bytes: int) -> int:
    """HBM bytes one absorbed MLA decode call (`minillm.kernels.ch12_mla.mla_decode_attention`)
    moves at least: every sequence's latent rows once (``(d_c + d_R)`` elements a token, shared
    by all heads), the absorbed queries ``[B, H, d_c + d_R]`` and the latent outputs
    ``[B, H, d_c]``, plus the fp32 lse ``[B, H]``."""
    lens = [int(n) for n in seq_lens]
    width = kv_lora_rank + qk_rope_head_dim
    return (sum(lens) * width * elem_bytes + len(lens) * heads * (width + kv_lora_rank) * elem_bytes
            + len(lens) * heads * 4)


def mla_decode_flops(seq_lens, heads: int, kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """FLOPs of absorbed MLA decode attention: per (head, key) ``2 (d_c + d_R)`` for the score
    and ``2 d_c`` for ``P·V`` over the latent."""
    return sum(int(n) for n in seq_lens) * heads * 2 * (2 * kv_lora_rank + qk_rope_head_dim)


def mla_naive_decode_bytes(seq_lens, heads: int, qk_head_dim: int, v_head_dim: int, elem_bytes: int) -> int:
    """HBM bytes of decode attention over the *decompressed* K/V of the same tokens (what the
    naive form reads if the decompressed keys and values were cached): ``H · (d_qk + d_v)``
    elements per token, plus queries and outputs."""
    lens = [int(n) for n in seq_lens]
    return (sum(lens) * heads * (qk_head_dim + v_head_dim) * elem_bytes
            + len(lens) * heads * (qk_head_dim + v_head_dim) * elem_bytes)


def mla_kv_block_bytes(num_layers: int, latent_dim: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one block id of an MLA model's paged pool: ``block_size`` latent rows of
    ``latent_dim = d_c + d_R`` in every layer (no separate V)."""
    return num_layers * block_size * latent_dim * dtype_bytes


__all__ += [  # Chapter 12
    "mha_kv_bytes_per_token", "gqa_kv_bytes_per_token", "mqa_kv_bytes_per_token", "mla_kv_bytes_per_token",
    "mla_equivalent_gqa_groups", "AttentionCacheShape", "LLAMA2_7B_CACHE", "LLAMA3_8B_CACHE",
    "DEEPSEEK_V2_LITE_CACHE", "DEEPSEEK_V3_CACHE", "MLA_TABLE_SHAPES", "mla_kv_table", "mla_decode_bytes",
    "mla_decode_flops", "mla_naive_decode_bytes", "mla_kv_block_bytes",
]


# == Chapter 10: where a decode step's time goes ================================================

def llama_weight_bytes(hidden: int, intermediate: int, layers: int, q_heads: int, kv_heads: int, head_dim: int,
                       vocab: int, dtype_bytes: int = 2, tied: bool = False) -> int:
    """Bytes of the weights a decode step reads once: per layer the q/k/v/o projections
    (``h·(H + 2 Hkv)·D + H·D·h``), the SwiGLU MLP (``3·h·I``) and two norms (``2h``); the final
    norm and the ``lm_head`` (``V·h``). The embedding is read a row per token (nothing to
    count); with ``tied`` it is the ``lm_head``, counted once either way."""
    q, kv = q_heads * head_dim, kv_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * intermediate + 2 * hidden
    return (layers * per_layer + hidden + vocab * hidden) * dtype_bytes


def decode_floor_s(weight_bytes: float, kv_bytes: float, bandwidth: float, kernels: int = 0,
                   per_kernel_s: float = 0.0) -> dict[str, float]:
    """The floor model of one decode step: every byte it must move (the weights once, the KV
    cache it attends over) at the copy bandwidth ``bandwidth`` (B/s, read + written as
    `bench.common.measure_ceilings` counts it), plus ``kernels`` times the time one kernel
    costs even when it does nothing (``per_kernel_s``, measured inside a CUDA graph).
    Returns ``{"bytes_s", "kernels_s", "total_s"}``."""
    bytes_s = (weight_bytes + kv_bytes) / bandwidth
    kernels_s = kernels * per_kernel_s
    return {"bytes_s": bytes_s, "kernels_s": kernels_s, "total_s": bytes_s + kernels_s}


def decode_kernels_per_step(layers: int, per_layer: int, outside_layers: int) -> int:
    """Kernels of one decode step: ``per_layer`` in each of ``layers``, plus those before and
    after them (embedding, rotary angles, final norm, ``lm_head``, sampling)."""
    return layers * per_layer + outside_layers


__all__ += ["llama_weight_bytes", "decode_floor_s", "decode_kernels_per_step"]  # Chapter 10
