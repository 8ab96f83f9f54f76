"""Chapter 10: the fused decode path of `LlamaForCausalLM.forward_paged`.

The same model, the same weights, the same paged cache and attention kernels; fewer, larger
kernels per layer (the notebook ``chapters/10_fused_decode.ipynb`` measures why that matters):

================================  =====================================  ==========================
torch model (per layer)           fused path                             kernels
================================  =====================================  ==========================
RMSNorm, residual add             `add_rmsnorm` (add, norm, one pass)    1
q, k, v projections               one GEMM on the merged ``W_qkv``       1 (Chapter 8's dispatch)
rotary of q and k, cache write    `rope_write_kv`                        1
attention                         unchanged (Chapters 4, 5, 7)           —
o projection                      unchanged                              —
residual add, RMSNorm             `add_rmsnorm`                          1
gate and up projections           one GEMM on the merged ``W_gate_up``   1
SiLU, multiply                    `silu_mul`                             1
down projection                   unchanged                              —
================================  =====================================  ==========================

The kernels are `minillm.kernels.ch10_fused_decode`. The merged weights are built once, at
`enable_fused_decode`, and the original ``q_proj.weight`` (etc.) become views of the merged
tensor: no memory is added, and the torch path (``forward``, the contiguous cache, the
unfused ``forward_paged``) keeps working on the very same numbers.

When Chapter 8's dispatch picks the GEMV for the step's rows (decode steps of a few
sequences), four more kernels per layer go: each `add_rmsnorm` is folded into the GEMV that
reads its output (`add_rmsnorm_gemv`, the final norm into the LM head's), `rope_write_kv`
into the end of the q/k/v projection's (`add_rmsnorm_gemv_rope`), `silu_mul` into the down
projection's (`silu_mul_gemv`), and the o projection runs on the same kernel (`decode_gemv`).
On Hopper these kernels, and attention between them, chain as programmatic dependent
launches (`minillm.kernels.ch10_fused_decode.pdl_enabled`). A 1B Llama's decode step of one
sequence is then 5 kernels a layer instead of 9 (`FusedDecode.fold_into_gemv` forces either
way).

Without a CUDA graph, a step's time is the host's Python around its launches, and every layer
repeats it with the same answers. So each eager step runs layer 1 through its wrappers while
recording its launches (`minillm.kernels.base.recording`), and layers 2 and up replay them
with their own weights and cache slices swapped in (`FusedDecode.replay_layers`): the same
kernels, the same logits, a fraction of the host time.

The residual stream is carried separately from the block outputs, as vLLM's layers do:
``h, residual = add_rmsnorm(block_out, residual, w)`` replaces ``x = x + block_out; h =
norm(x)``. Logits are computed for the rows that sample only (each sequence's last new token,
``last_only``), after the final norm of those rows alone.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from minillm.model.paged import PagedBatch, PagedKVCache, paged_attention

__all__ = ["FUSED_MODES", "FusedDecode", "enable_fused_decode", "supports_fused_decode"]

#: ``EngineConfig.fused_decode``: ``"auto"`` (on CUDA with the Triton attention kernels),
#: ``"on"`` (force; on a CPU the kernels run in Triton's interpreter), ``"off"``.
FUSED_MODES = ("auto", "on", "off")
#: Where the q/k/v projection runs as a GEMV, fold the rotary embedding and the cache write
#: into its end (`minillm.kernels.ch10_fused_decode.add_rmsnorm_gemv_rope`) instead of running
#: `rope_write_kv` after it. A switch for measurements: on an H100 (1B Llama, one sequence,
#: context 128, CUDA graph) 1.051 -> 0.978 ms a step.
FOLD_ROPE = True
#: Launch a decode step's attention kernel as a programmatic dependent launch where the fused
#: kernels are (`minillm.kernels.ch10_fused_decode.pdl_enabled`), so that the chain does not
#: break at attention. A switch for measurements: with the fold above, 0.978 -> 0.964 ms on
#: the H100 (its launch hidden, and the o projection's first loads under it).
ATTENTION_PDL = True


#: `FusedDecode.replay_layers`' default. On an H100 host (280M Llama, 64 sequences, eager), the
#: step's host time went from about 12 ms to 4-8 ms (``chapters/10_fused_decode.ipynb``).
REPLAY_LAYERS = True


@dataclass
class _Step:
    """What every layer of one step shares: the batch, the cache, the rotary tables, and which
    projections run as PDL-chained GEMVs with their neighbours folded in."""
    batch: PagedBatch
    cache: PagedKVCache
    cos: torch.Tensor
    sin: torch.Tensor
    pdl: bool
    gemv_qkv: bool
    gemv_o: bool
    gemv_gate_up: bool
    gemv_down: bool


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a kernel compiled for ``a`` runs unchanged on ``b``: dtype, shape, strides and
    16-byte alignment alike."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and (a.data_ptr() % 16 == 0) == (b.data_ptr() % 16 == 0))


@dataclass
class _LayerWeights:
    qkv: torch.Tensor                  # [(H + 2 Hkv) D, hidden]
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor              # [2 I, hidden]
    gate_up_bias: torch.Tensor | None


def _merge(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``linears`` along the output rows, and make each
    layer's own parameters views of their rows of the result (so memory is not doubled). A
    second call, with the parameters unchanged since, returns the same merged tensors."""
    cached = getattr(linears[0], "_fused_merge", None)
    if cached is not None and cached[2] == [id(lin.weight) for lin in linears]:
        return cached[0], cached[1]
    merged = []
    for attr in ("weight", "bias"):
        params = [getattr(lin, attr) for lin in linears]
        if params[0] is None:
            merged.append(None)
            continue
        with torch.no_grad():
            full = torch.cat([p.detach() for p in params]).contiguous()
        start = 0
        for lin, p in zip(linears, params):
            setattr(lin, attr, nn.Parameter(full[start:start + p.shape[0]], requires_grad=False))
            start += p.shape[0]
        merged.append(full)
    linears[0]._fused_merge = (merged[0], merged[1], [id(lin.weight) for lin in linears])
    return merged[0], merged[1]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What `minillm.model.torch_model.Linear` does with a weight of its own: Chapter 8's
    dispatcher on CUDA in fp16/bf16, ``F.linear`` elsewhere (a recorded call while a layer is
    being recorded, so that its replays make it too)."""
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype:
        from minillm.model.torch_model import _flat_gemm_linear

        dispatch = _flat_gemm_linear()
        if dispatch is not None:
            return dispatch(x, weight, bias)
    from minillm.kernels.ch08_flat_gemm import blas_linear

    return blas_linear(x, weight, bias)


def supports_fused_decode(model) -> bool:
    """Whether ``model`` can run the fused path: a Llama/Qwen2 `LlamaForCausalLM` (not MLA,
    rotary over the whole head), one process's or one rank's shard of a tensor-parallel model
    (Chapter 13), and importable kernels."""
    from minillm.model.torch_model import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM) or hasattr(model, "make_runner"):
        return False
    c = model.config
    if getattr(c, "is_mla", False) or c.rope_dim != c.head_dim or c.head_dim % 2:
        return False
    try:
        import minillm.kernels.ch10_fused_decode  # noqa: F401
    except ImportError:
        return False
    return True


class FusedDecode:
    """``fused(batch, cache, last_only) -> logits``: `LlamaForCausalLM.forward_paged` with
    the fused kernels (installed as ``model.fused_decode`` by `enable_fused_decode`)."""

    def __init__(self, model):
        from minillm.kernels import ch10_fused_decode as kernels

        self.model, self.k = model, kernels
        #: None: fold the norms and SwiGLU into the GEMVs where the dispatch picks the GEMV;
        #: True/False: always/never (True runs the folded kernels under the interpreter too).
        self.fold_into_gemv: bool | None = None
        #: Record layer 1's launches each step and replay them for layers 2 and up (eager steps:
        #: the wrappers' Python runs for two layers instead of all; `minillm.kernels.base.recording`).
        self.replay_layers = REPLAY_LAYERS
        self._distributed = any(hasattr(mod, "reduce") for mod in model.modules())
        self._alike = None   # (the cache, whether every layer's tensors are like layer 1's)
        self._own: list[list[torch.Tensor]] | None = None   # per layer, its weights (`_layer_tensors`)
        #: The last step's layers made by replay, and why its recording was not replayed (None
        #: when it was, or when none was made).
        self.replayed_layers, self.refusal = 0, None
        self.weights = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            qkv, qkv_b = _merge([a.q_proj, a.k_proj, a.v_proj])
            gate_up, gate_up_b = _merge([m.gate_proj, m.up_proj])
            self.weights.append(_LayerWeights(qkv, qkv_b, gate_up, gate_up_b))

    def __call__(self, batch: PagedBatch, cache: PagedKVCache, last_only: bool = False) -> torch.Tensor:
        from minillm.kernels.base import recording
        from minillm.model.torch_model import rope_cos_sin

        model, c, k = self.model, self.model.config, self.k
        D = c.head_dim
        x = model.model.embed_tokens(batch.input_ids)                                   # [N, hidden]
        cos, sin = rope_cos_sin(batch.positions, D, c.rope_theta, x.dtype)              # [N, D], once a step
        # Which projections fold into GEMVs: every layer has the same shapes and rows, so one
        # decision each per step (asked per layer, they were a few percent of an eager step).
        a, m = model.model.layers[0].self_attn, model.model.layers[0].mlp
        gemv = (self._gemv(x, self.weights[0].qkv), self._gemv(x, a.o_proj.weight),
                self._gemv(x, self.weights[0].gate_up), self._gemv(x, m.down_proj.weight))
        step = _Step(batch, cache, cos, sin, ATTENTION_PDL and k.pdl_enabled(x.device), *gemv)
        residual, replay = None, None
        self.replayed_layers, self.refusal = 0, None
        for i in range(len(model.model.layers)):
            if replay is not None:  # layer 1's launches again, with this layer's weights and cache
                replay.replay([*self._layer_tensors(cache, i), x, residual])
                self.replayed_layers += 1
            elif i == 1 and self._can_replay(x):
                with recording() as rec:
                    out = self._layer(i, x, residual, step)
                # x and residual are the buffers the next layers read and overwrite in turn
                replay = rec if self._bind(rec, cache, x, residual, *out) else None
                self.refusal = rec.reason
                x, residual = out
            else:
                x, residual = self._layer(i, x, residual, step)
        if last_only and batch.max_seqlen_q != 1:  # only the rows that sample (one new token each: all rows)
            rows = batch.last_token_rows
            x, residual = x[rows], residual[rows]
        head = model.lm_head
        gemv_head = self._gemv(x, head.weight)
        logits = self._norm_linear(x, residual, model.model.norm, head.weight, head.bias, gemv_head)[0]
        gather = getattr(head, "gather", None)   # tensor parallel: this rank's vocabulary rows -> all of them
        return gather(logits) if gather is not None else logits

    def _layer(self, i: int, x: torch.Tensor, residual: torch.Tensor | None, step: "_Step"
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer ``i``: ``(x, residual) -> (x, residual)``, both ``[N, hidden]``."""
        c, k, layer, w, cache, batch = self.model.config, self.k, self.model.model.layers[i], self.weights[i], \
            step.cache, step.batch
        H, Hkv, D, N = c.num_attention_heads, c.num_key_value_heads, c.head_dim, x.shape[0]
        ln = layer.input_layernorm
        if step.gemv_qkv and FOLD_ROPE:  # one kernel: norm, q/k/v, rotary, cache write
            q, residual = k.add_rmsnorm_gemv_rope(x, residual, ln.weight, ln.eps, w.qkv, w.qkv_bias, H, step.cos,
                                                  step.sin, cache.k[i], cache.v[i], batch.slot_mapping)
        else:
            qkv, residual = self._norm_linear(x, residual, ln, w.qkv, w.qkv_bias, step.gemv_qkv)  # [N, (H + 2Hkv) D]
            q = qkv[:, :H * D].view(N, H, D)
            kk = qkv[:, H * D:(H + Hkv) * D].view(N, Hkv, D)
            v = qkv[:, (H + Hkv) * D:].view(N, Hkv, D)
            q = k.rope_write_kv(q, kk, v, step.cos, step.sin, cache.k[i], cache.v[i], batch.slot_mapping)
        # Attention chains with its neighbours where they are PDL GEMVs (the regime measured).
        out = paged_attention(q, cache, i, batch, scale=D ** -0.5, pdl=step.pdl and step.gemv_qkv)  # [N, H, D]
        x = self._project(out.reshape(N, H * D), layer.self_attn.o_proj, step.gemv_o)
        ln = layer.post_attention_layernorm
        gate_up, residual = self._norm_linear(x, residual, ln, w.gate_up, w.gate_up_bias, step.gemv_gate_up)
        down = layer.mlp.down_proj
        if step.gemv_down:  # SwiGLU's activation folded into the down GEMV
            x = _partial_sums_added(down, k.silu_mul_gemv(gate_up, down.weight, down.bias))
        else:
            x = _partial_sums_added(down, _linear(k.silu_mul(gate_up), down.weight, down.bias))
        return x, residual

    # -- replaying layer 1's launches for the layers after it ----------------------------
    def _can_replay(self, x: torch.Tensor) -> bool:
        """Whether this step records layer 1 and replays it (`replay_layers`): not while a CUDA
        graph is captured (the graph already launches the step once), nor on a tensor-parallel
        rank (its layers end in all-reduces, which are not launches), nor with autograd on."""
        if not self.replay_layers or len(self.model.model.layers) < 3 or self._distributed:
            return False
        if torch.is_grad_enabled():  # recorded GEMMs write into given outputs, which autograd refuses
            return False
        return not (x.is_cuda and torch.cuda.is_current_stream_capturing())

    def _layer_tensors(self, cache: PagedKVCache, i: int) -> list[torch.Tensor]:
        """Everything of layer ``i`` a launch may point to: its parameters and buffers, its
        merged weights (listed once: walking the modules costs tens of microseconds), its K
        and V pools."""
        if self._own is None:
            self._own = []
            for layer, w in zip(self.model.model.layers, self.weights):
                merged = [t for t in (w.qkv, w.qkv_bias, w.gate_up, w.gate_up_bias) if t is not None]
                self._own.append([*layer.parameters(), *layer.buffers(), *merged])
        return [*self._own[i], cache.k[i], cache.v[i]]

    def _bind(self, rec, cache: PagedKVCache, x_in, residual_in, x_out, residual_out) -> bool:
        """Prepare ``rec`` (layer 1's launches) for the later layers: their tensors take the place
        of layer 1's, and the layer's outputs the place of its inputs. False (with
        `Recording.reason` set) where it cannot be replayed, e.g. where a later layer's tensors
        differ from layer 1's in dtype, shape or 16-byte alignment (the binaries were
        specialized on them)."""
        first = self._layer_tensors(cache, 1)
        if self._alike is None or self._alike[0]() is not cache:  # checked once per cache
            self._alike = (weakref.ref(cache), all(
                _same_kind(a, b) for i in range(2, len(self.model.model.layers))
                for a, b in zip(first, self._layer_tensors(cache, i), strict=True)))
        if not (self._alike[1] and _same_kind(x_in, x_out) and _same_kind(residual_in, residual_out)):
            rec.refuse("a later layer's tensors are not like layer 1's (dtype, shape, strides, alignment)")
        return rec.bind([*first, x_in, residual_in])

    def _gemv(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether this projection runs as a GEMV with its neighbours folded in: where Chapter
        8's dispatch picks the GEMV for these rows (on CUDA, fp16/bf16), or as `fold_into_gemv`
        forces (True also under the interpreter, for the tests)."""
        if self.fold_into_gemv is not None:
            return self.fold_into_gemv
        if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype):
            return False
        from minillm.engine.gemm_table import table_for_device
        from minillm.kernels.ch08_flat_gemm import choose_kernel

        return choose_kernel(x.shape[0], weight.shape[0], weight.shape[1], table_for_device(x.device)) == "gemv"

    def _norm_linear(self, x, residual, norm, weight, bias, gemv: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(linear(rmsnorm(x + residual)), x + residual)``: one kernel where ``gemv`` (`_gemv`'s
        answer for these rows and this weight), else `add_rmsnorm` and the dispatched linear layer."""
        if gemv:
            return self.k.add_rmsnorm_gemv(x, residual, norm.weight, norm.eps, weight, bias)
        h, residual = self.k.add_rmsnorm(x, residual, norm.weight, norm.eps)
        return _linear(h, weight, bias), residual

    def _project(self, x: torch.Tensor, linear: nn.Linear, gemv: bool) -> torch.Tensor:
        """``linear(x)``: the same GEMV kernel as its neighbours where ``gemv`` (so it chains
        with them, `minillm.kernels.ch10_fused_decode.pdl_enabled`), else the dispatched linear
        layer; a row-parallel layer's partial sums added up either way."""
        kernel = self.k.decode_gemv if gemv else _linear
        return _partial_sums_added(linear, kernel(x, linear.weight, linear.bias))


def _partial_sums_added(linear: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """``y`` computed by our own kernel from ``linear``'s weight, completed as ``linear``'s
    forward would: a row-parallel layer of Chapter 13 (`minillm.distributed.tp`) holds a slice
    of the input features, so each rank's ``y`` is a partial sum the ranks add up."""
    reduce = getattr(linear, "reduce", None)
    return reduce(y) if reduce is not None else y


def enable_fused_decode(model, cache: PagedKVCache, mode: str = "auto") -> bool:
    """Install (or remove) the fused path on ``model`` for steps over ``cache``; returns
    whether it is on. ``"auto"``: on when the cache is on CUDA with the Triton attention
    kernels and the model supports it (`supports_fused_decode`); ``"on"``: on wherever the
    model supports it (raises ``ValueError`` otherwise); ``"off"``: the torch path."""
    if mode not in FUSED_MODES:
        raise ValueError(f"fused_decode must be one of {FUSED_MODES}, got {mode!r}")
    if hasattr(model, "enable_fused_decode"):  # a tensor-parallel model (Chapter 13): on every rank's shard
        return model.enable_fused_decode(cache, mode)
    supported = supports_fused_decode(model)
    if mode == "on" and not supported:
        raise ValueError("fused_decode='on' needs a Llama/Qwen2 model (not MLA) and Triton")
    on = supported and (mode == "on" or (mode == "auto" and cache.pool.is_cuda and cache.kernels is not None))
    if supported or hasattr(model, "fused_decode"):
        model.fused_decode = FusedDecode(model) if on else None
    return on
