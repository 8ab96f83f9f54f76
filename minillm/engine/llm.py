"""Chapter 9: the offline API. ``LLM(path).generate(prompts, SamplingParams(...))``.

All prompts go into the engine at once and it steps until every one is done: continuous
batching does the rest (nothing here waits for a batch to fill or to drain).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from minillm import BUNDLED_MODEL

from minillm.decoding.sampling import SamplingParams
from minillm.engine.config import EngineConfig
from minillm.engine.engine import LLMEngine
from minillm.engine.request import RequestOutput
from minillm.model.config import CheckpointError
from minillm.model.loader import NoTokenizer

__all__ = ["BUNDLED_MODEL", "LLM"]


Prompt = str | Sequence[int]


class LLM:
    """A checkpoint and an engine around it.

    Args:
        model: a local Hugging Face-format folder (default: the bundled model). A folder without
            ``tokenizer.json`` runs too: prompts are then token ids, and completions token ids
            with empty text (a text prompt raises `minillm.model.CheckpointError`).
        **config: `EngineConfig` fields (``device``, ``num_blocks``, ``max_num_seqs``, ...).

    Raises:
        minillm.model.CheckpointError: the folder is not a checkpoint minillm can load (the
            message names the file and the problem).
    """

    def __init__(self, model: str | Path = BUNDLED_MODEL, **config):
        config = EngineConfig(**config)
        if (Path(model) / "tokenizer.json").exists() or not (Path(model) / "config.json").exists():
            self.engine = LLMEngine.from_pretrained(model, config)
        else:
            self.engine = _engine_without_tokenizer(Path(model), config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (text, or a list of token ids); outputs in prompt order.
        ``params`` is one `SamplingParams` for all, or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        if isinstance(self.tokenizer, NoTokenizer) and (any(isinstance(p, str) for p in prompts)
                                                        or any(sp.stop for sp in params)):
            raise CheckpointError(self.tokenizer.message)  # before any request is queued
        engine = self.engine
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for request in engine._step():
                        if request.finished:
                            done[request.request_id] = request.output()
                            bar.update()
        except BaseException:
            for request_id in ids:  # leave the engine clean for the next call
                engine.abort(request_id)
            raise
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | Sequence[list[dict]], params: SamplingParams | None = None,
             *, use_tqdm: bool = True) -> list[RequestOutput]:
        """`generate` on conversations rendered with the checkpoint's chat template."""
        from minillm.model.loader import render_chat

        if self.engine.chat_template is None:
            raise ValueError("this checkpoint has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [render_chat(self.engine.chat_template, m) for m in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)


def _engine_without_tokenizer(path: Path, config: EngineConfig) -> LLMEngine:
    """`LLMEngine.from_pretrained` for a folder without ``tokenizer.json`` (same device and dtype
    defaults), with a `NoTokenizer`."""
    import torch

    from minillm.model import load_model

    config.device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if config.tensor_parallel_size > 1:  # Chapter 13
        from minillm.distributed import load_parallel_model
        model = load_parallel_model(path, config.tensor_parallel_size, device=config.device,
                                    dtype=config.dtype or ("float32" if config.device == "cpu" else None))
        return LLMEngine(model, NoTokenizer(path), config, model_name=path.name)
    model, _ = load_model(path, device=config.device, dtype=config.dtype or ("float32" if config.device == "cpu"
                                                                              else None))
    return LLMEngine(model, NoTokenizer(path), config, model_name=path.name)
