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

__all__ = ["BUNDLED_MODEL", "LLM"]


Prompt = str | Sequence[int]


class LLM:
    """A checkpoint and an engine around it.

    Args:
        model: a local Hugging Face-format folder (default: the bundled model).
        **config: `EngineConfig` fields (``device``, ``num_blocks``, ``max_num_seqs``, ...).
    """

    def __init__(self, model: str | Path = BUNDLED_MODEL, **config):
        self.engine = LLMEngine.from_pretrained(model, EngineConfig(**config))
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
