"""Chapter 9: the request bodies the server accepts, and how they become `SamplingParams`.

Two layers check a request. Pydantic checks each field's type and range here: integers must
be JSON integers (``"max_tokens": 5.5`` or ``"5"`` is refused, not rounded), ``temperature >=
0``, ``0 < top_p <= 1``, ``logprobs`` in ``[0, 20]``. What depends on the model is checked by
`LLMEngine.add_request`: an empty prompt, ``n`` or the beam width above ``max_n``, prompt +
``max_tokens`` above ``max_model_len``. Either failure is an HTTP 400 in OpenAI's error
envelope (`minillm.server.app`). Fields the OpenAI API has and minillm does not use (``user``,
...) are ignored.

Extra fields beyond the OpenAI API (vLLM's names; the ``openai`` client sends them with
``extra_body={...}``):

- ``top_k``: sample from the ``k`` most likely tokens only (``0``: all).
- ``stop_token_ids``: token ids that end a completion (kept in its ``token_ids``).
- ``ignore_eos``: do not stop at the model's end-of-sequence token (benchmarks do).
- ``use_beam_search`` with ``best_of`` or ``num_beams``: beam search of that width (default:
  ``n``, at least 2), returning the ``n`` best hypotheses, best first, deterministic
  (``temperature``, ``top_p``, ``top_k`` and ``seed`` do not apply). ``num_beams > 1`` alone
  also selects beam search. ``length_penalty`` (default 1) divides a hypothesis' summed
  log-probability by ``length ** length_penalty``.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from minillm.decoding.sampling import SamplingParams
from minillm.engine.config import InvalidRequest

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest"]

MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS


def _opt(tp, **constraints):
    """An optional field with range constraints on its value (``null`` means the default)."""
    return Annotated[tp, Field(**constraints)] | None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: _opt(StrictInt, ge=1) = None
    temperature: _opt(float, ge=0) = None
    top_p: _opt(float, gt=0, le=1) = None
    top_k: _opt(StrictInt, ge=0) = None
    seed: _opt(StrictInt, ge=0, le=2**62) = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extras (see the module docstring)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    use_beam_search: bool = False
    best_of: _opt(StrictInt, ge=1) = None
    num_beams: _opt(StrictInt, ge=1) = None
    length_penalty: float = 1.0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        n = self.n or 1
        beam = self.use_beam_search or (self.num_beams or 1) > 1
        if beam:
            width = self.num_beams or self.best_of or max(n, 2)
            if width < 2:
                raise InvalidRequest(f"beam search needs a width (best_of or num_beams) >= 2, got {width}",
                                     param="best_of")
            if n > width:
                raise InvalidRequest(f"beam search returns at most its width ({width}) hypotheses, got n={n}",
                                     param="n")
        else:
            width = 1
            if self.best_of not in (None, n):
                raise InvalidRequest("best_of != n needs use_beam_search (it is the beam width)", param="best_of")
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p,
                max_tokens=max_tokens, stop_token_ids=tuple(self.stop_token_ids or ()), seed=self.seed, n=n,
                stop=self.stop or (), ignore_eos=self.ignore_eos, logprobs=logprobs, num_beams=width,
                length_penalty=self.length_penalty)
        except ValueError as e:  # SamplingParams' messages start with the field's name
            raise InvalidRequest(str(e), param=str(e).split()[0]) from None


class CompletionRequest(_Request):
    """``POST /v1/completions``. ``prompt``: text, token ids, or a list of one of either."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: _opt(StrictInt, ge=1) = None       # OpenAI's default: 16
    logprobs: _opt(StrictInt, ge=0, le=MAX_LOGPROBS) = None
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if prompt and isinstance(prompt, list) and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise InvalidRequest(f"this server takes one prompt per request, got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        if self.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        return prompt

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(16 if self.max_tokens is None else self.max_tokens, self.logprobs)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise InvalidRequest("only text content parts are supported", param="messages")
            content = "".join(p.text or "" for p in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``. Without ``max_tokens`` (or ``max_completion_tokens``) a
    reply may run to the end of the context: ``max_model_len`` minus the prompt."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: _opt(StrictInt, ge=1) = None
    max_completion_tokens: _opt(StrictInt, ge=1) = None
    logprobs: bool | None = False
    top_logprobs: _opt(StrictInt, ge=0, le=MAX_LOGPROBS) = None

    def to_sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs to be true", param="top_logprobs")
        max_tokens = self.max_completion_tokens or self.max_tokens or max(max_model_len - prompt_len, 1)
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
