"""Chapter 9: the request bodies the server accepts, and how they become `SamplingParams`.

Two layers check a request. Pydantic checks each field's type and range here: integers must
be JSON integers (``"max_tokens": 5.5`` or ``"5"`` is refused, not rounded), ``temperature >=
0``, ``0 < top_p <= 1``, ``logprobs`` in ``[0, 20]``. What depends on the model is checked by
`LLMEngine.add_request`: an empty prompt, ``n`` or the beam width above ``max_n``, prompt +
``max_tokens`` above ``max_model_len``. Either failure is an HTTP 400 in OpenAI's error
envelope (`minillm.server.app`).

Fields the OpenAI API has that change nothing here (``user``, ``store``, ``metadata``,
``service_tier``, ``parallel_tool_calls``) are ignored, as are fields no API defines (vLLM also
ignores unknown fields, with a warning in its log; so does minillm). A field that would change
the output and that minillm does not implement (``response_format`` other than text,
``tools``, ``tool_choice`` other than ``"none"``, ``functions``, ``function_call``, ``suffix``,
``audio``, ``prediction``, vLLM's ``guided_*``, ...: `UNSUPPORTED`) is refused with a 400 whose
``param`` names it, never ignored.

Sampling parameters (vLLM's semantics, `minillm.decoding.sampling.SamplingParams`):
``presence_penalty``, ``frequency_penalty`` (``[-2, 2]``) and ``logit_bias`` (``{"token id":
bias}``, each bias clamped to ``[-100, 100]``) are OpenAI's; ``repetition_penalty``, ``min_p``,
``min_tokens``, ``include_stop_str_in_output`` and ``prompt_logprobs`` are vLLM's extras.

Extra fields beyond the OpenAI API (vLLM's names; the ``openai`` client sends them with
``extra_body={...}``):

- ``top_k``: sample from the ``k`` most likely tokens only (``0``: all).
- ``stop_token_ids``: token ids that end a completion (kept in its ``token_ids``, its text
  left out unless ``include_stop_str_in_output``).
- ``ignore_eos``: do not stop at the model's end-of-sequence token (benchmarks do).
- ``use_beam_search`` with ``best_of`` or ``num_beams``: beam search of that width (default:
  ``n``, at least 2), returning the ``n`` best hypotheses, best first, deterministic
  (``temperature``, ``top_p``, ``top_k`` and ``seed`` do not apply). ``num_beams > 1`` alone
  also selects beam search. ``length_penalty`` (default 1) divides a hypothesis' summed
  log-probability by ``length ** length_penalty``.
"""
from __future__ import annotations

import logging
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from minillm.decoding.sampling import SamplingParams
from minillm.engine.config import InvalidRequest

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest"]

MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS
log = logging.getLogger("minillm.server")

#: The most prompts one completions request may carry (each is an engine request of its own).
MAX_PROMPTS = 256

# Known fields minillm does not implement, and when a value asks for something (null, and the
# values that ask for nothing, pass).
UNSUPPORTED = {
    "response_format": lambda v: v is not None and v != {"type": "text"},
    "tools": bool,
    "tool_choice": lambda v: v not in (None, "none"),
    "functions": bool,
    "function_call": lambda v: v not in (None, "none"),
    "suffix": bool,
    "audio": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]),
    "prediction": lambda v: v is not None,
    "web_search_options": lambda v: v is not None,
    "guided_json": lambda v: v is not None,
    "guided_regex": lambda v: v is not None,
    "guided_choice": lambda v: v is not None,
    "guided_grammar": lambda v: v is not None,
    "structured_outputs": lambda v: v is not None,
}


def _opt(tp, **constraints):
    """An optional field with range constraints on its value (``null`` means the default)."""
    return Annotated[tp, Field(**constraints)] | None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)   # NaN and Infinity are refused

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data):
        """Refuse a string holding half a UTF-16 pair (``"\\ud800"``), which nothing can encode."""
        from minillm.server.tokens import find_surrogate

        if (where := find_surrogate(data)) is not None:
            raise InvalidRequest(f"{where}: the string holds a lone UTF-16 surrogate, which is not valid Unicode "
                                 "text", param=where.split(".")[0], code="invalid_unicode")
        return data

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
    # sampling parameters (see the module docstring)
    presence_penalty: _opt(float, ge=-2, le=2) = None
    frequency_penalty: _opt(float, ge=-2, le=2) = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: _opt(float, gt=0) = None
    min_p: _opt(float, ge=0, le=1) = None
    min_tokens: _opt(StrictInt, ge=0) = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: _opt(StrictInt, ge=0, le=MAX_LOGPROBS) = None
    # known, not implemented: refused when they ask for anything (`UNSUPPORTED`)
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data):
        """Fields no API defines are ignored, with a warning in the log (vLLM's behaviour)."""
        if isinstance(data, dict) and (unknown := sorted(set(data) - set(cls.model_fields))):
            # Client text goes to the log: a few names, each cut short, so no body can flood it.
            names = ", ".join(repr(str(name)[:40]) for name in unknown[:8])
            more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
            log.warning("ignored request fields: %s%s", names, more)
        return data

    def check_supported(self) -> None:
        """Refuse (400, ``param`` = the field) a known field asking for what minillm lacks."""
        for name, asks in UNSUPPORTED.items():
            if name in type(self).model_fields and asks(getattr(self, name)):
                raise InvalidRequest(f"{name} is not supported by this server", param=name, code="unsupported")

    def logit_bias_ids(self) -> dict[int, float] | None:
        """OpenAI's ``{"token id": bias}``, biases clamped to ``[-100, 100]``."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
            bias[token] = min(100.0, max(-100.0, value))
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        self.check_supported()
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
            if logprobs is not None:
                raise InvalidRequest("logprobs is not supported with beam search", param="logprobs")
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
                length_penalty=self.length_penalty, logit_bias=self.logit_bias_ids(),
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                min_p=self.min_p or 0.0, min_tokens=self.min_tokens or 0,
                include_stop_str_in_output=self.include_stop_str_in_output,
                prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs)
        except ValueError as e:  # SamplingParams' messages start with the field's name
            raise InvalidRequest(str(e), param=str(e).split()[0]) from None


class CompletionRequest(_Request):
    """``POST /v1/completions``. ``prompt``: text, token ids, or a list of either (one
    completion per prompt, ``n`` choices each: choice ``i * n + j`` is prompt ``i``'s ``j``-th).

    ``echo`` puts the prompt in front of each choice's text; with ``logprobs``, its tokens'
    log-probabilities too (the first token's is ``null``). ``max_tokens: 0`` is allowed with
    ``echo`` only: the prompt alone comes back (as vLLM, one token is generated and dropped).
    """

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: _opt(StrictInt, ge=0) = None       # OpenAI's default: 16
    logprobs: _opt(StrictInt, ge=0, le=MAX_LOGPROBS) = None
    echo: bool = False
    suffix: Any = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per completion (a list of one for a single prompt).

        At most `MAX_PROMPTS` in one request: each becomes an engine request, so a body of many
        tiny prompts must not turn into millions of them.
        """
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        if len(prompt) > MAX_PROMPTS:
            raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt",
                                 code="too_many_prompts")
        return list(prompt)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt and no completion."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens must be >= 1 (0 only with echo)", param="max_tokens")
        max_tokens = 16 if self.max_tokens is None else max(self.max_tokens, 1)
        prompt_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else None
        return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs)


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
