"""The Llama-family model (Llama, Qwen2): config, NumPy reference, torch model, HF loader.

- ``config.ModelConfig``: parsed from a Hugging Face ``config.json``; unsupported features raise.
- ``reference.forward``: the float64 NumPy oracle (one sequence, no cache).
- ``torch_model.LlamaForCausalLM`` + ``KVCache`` + ``generate``: what the engine runs.
- ``loader``: ``load_model``, ``load_reference_params``, ``load_tokenizer`` from a local folder.
"""
from minillm.model.config import CheckpointError, ModelConfig
from minillm.model.loader import load_model, load_reference_params, load_tokenizer, render_chat
from minillm.model.torch_model import KVCache, LlamaForCausalLM, generate

__all__ = ["CheckpointError", "KVCache", "LlamaForCausalLM", "ModelConfig", "generate", "load_model",
           "load_reference_params", "load_tokenizer", "render_chat"]
