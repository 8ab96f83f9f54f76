"""Chapter 9: the engine's `RequestOutput` as OpenAI response bodies, whole or streamed.

A whole response is built from the finished output. A stream is built from each output as it
arrives: for every completion (a *choice*), what is new since the last chunk. The engine's
running text never takes anything back (`minillm.engine.detokenizer`), so the new text is
simply the text past what was sent; a choice's last chunk carries its real ``finish_reason``.

Log-probabilities come in the two formats of the API: the completions endpoint's parallel
lists (``tokens``, ``token_logprobs``, ``top_logprobs`` as ``{token: logprob}``, which also
holds the sampled token, and ``text_offset``), and chat's list of ``{"token", "logprob",
"bytes", "top_logprobs"}``.

A completions request may carry several prompts (`minillm.server.multi_prompt`): its output is a
`MergedOutput` whose ``parts`` are the prompts' own outputs. With ``echo``, each choice's text
(and log-probabilities: the prompt's, the first token's ``null``) starts with its prompt's.
``prompt_logprobs`` (vLLM's extra) come as vLLM writes them: per prompt token (the first
``null``), ``{token id: {"logprob", "rank", "decoded_token"}}`` for the token itself and the
most likely alternatives; per choice for completions (in a stream: in each choice's first
chunk), once for the whole response for chat.
"""
from __future__ import annotations

import functools
import time

from tokenizers import decoders

from minillm.engine.request import RequestOutput, TokenLogprob

__all__ = ["Formatter"]


class Formatter:
    """Builds one request's response bodies.

    Args:
        chat: chat completions (else text completions).
        model: the model name the responses report.
        tokenizer: a ``tokenizers.Tokenizer``, to spell the tokens of log-probabilities.
        request_id: the engine's id, also the response's.
        prompts: the completions request's prompts (text or ids), for ``echo``.
        echo: put each prompt in front of its choices; ``echo_only``: and drop the one token
            generated (``max_tokens: 0``).
        prompt_logprobs: report the prompts' log-probabilities.
    """

    def __init__(self, chat: bool, model: str, tokenizer, request_id: str, *, prompts: list | None = None,
                 echo: bool = False, echo_only: bool = False, prompt_logprobs: bool = False):
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.prompts, self.echo, self.echo_only, self.want_prompt_logprobs = prompts, echo, echo_only, prompt_logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.sent: dict[int, tuple[int, int, int]] = {}  # choice -> (chars, tokens, token chars) streamed
        self.done: set[int] = set()                       # choices whose last chunk went out

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    # == whole ===================================================================================
    def response(self, output: RequestOutput) -> dict:
        choices = []
        for c in output.outputs:
            if self.chat:
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": self._chat_logprobs(c.logprobs),
                                "finish_reason": c.finish_reason})
            else:
                text, lps = self._view(c, output)
                choice = {"index": c.index, "text": text, "logprobs": self._completion_logprobs(lps),
                          "finish_reason": c.finish_reason}
                if self.want_prompt_logprobs:
                    choice["prompt_logprobs"] = self._prompt_logprobs(self._part(c, output).prompt_logprobs)
                choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        if self.chat and self.want_prompt_logprobs:
            body["prompt_logprobs"] = self._prompt_logprobs(output.prompt_logprobs)
        body["usage"] = self.usage(output)
        return body

    # == echo and prompt log-probabilities (completions) ==========================================
    @staticmethod
    def _part(c, output):
        """The prompt's own output that choice ``c`` belongs to."""
        parts = getattr(output, "parts", None)
        return output if parts is None else parts[c.index // output.n]

    def _view(self, c, output) -> tuple[str, list | None]:
        """Choice ``c``'s text and log-probabilities as the response shows them (echo)."""
        text, lps = c.text, c.logprobs
        if self.echo_only:
            text, lps = "", ([] if lps is not None else None)
        if self.echo:
            part = self._part(c, output)
            prompt = self.prompts[c.index // getattr(output, "n", 1)] if self.prompts else part.prompt
            if not isinstance(prompt, str):
                prompt = self.tokenizer.decode(list(part.prompt_token_ids), skip_special_tokens=False)
            text = prompt + text
            if lps is not None:
                given = part.prompt_logprobs or [None] * len(part.prompt_token_ids)
                lps = [lp if lp is not None else TokenLogprob(t, None, None)
                       for t, lp in zip(part.prompt_token_ids, given)] + list(lps)
        return text, lps

    def _prompt_logprobs(self, lps: list[TokenLogprob | None] | None) -> list | None:
        if lps is None:
            return None
        out = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                        "decoded_token": self.token_text(lp.token_id)}}
            for rank, (t, v) in enumerate(lp.top, start=1):
                entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": self.token_text(t)})
            out.append(entry)
        return out

    def usage(self, output) -> dict:
        body = usage(output)
        if self.echo_only:   # the one token generated is dropped
            body["completion_tokens"], body["total_tokens"] = 0, body["prompt_tokens"]
        return body

    # == streamed ================================================================================
    def chunks(self, output: RequestOutput) -> list[dict]:
        """One chunk per choice with something new (text, tokens with logprobs, or its end)."""
        chunks = []
        for c in output.outputs:
            if c.index in self.done:
                continue
            chars, tokens, offset = self.sent.get(c.index, (0, 0, 0))
            text, lps = (c.text, c.logprobs) if self.chat else self._view(c, output)
            delta = text[chars:]
            new = lps[tokens:] if lps is not None else None
            if not delta and not new and not c.finished:
                continue
            choice: dict = {"index": c.index}
            if not self.chat and self.want_prompt_logprobs and c.index not in self.sent:
                choice["prompt_logprobs"] = self._prompt_logprobs(self._part(c, output).prompt_logprobs)
            if self.chat:
                first = c.index not in self.sent
                choice["delta"] = {"role": "assistant", "content": delta} if first else {"content": delta}
                choice["logprobs"] = self._chat_logprobs(new)
            else:
                choice["text"] = delta
                choice["logprobs"] = self._completion_logprobs(new, offset)
            choice["finish_reason"] = c.finish_reason
            if new:
                offset += sum(len(self.token_text(lp.token_id)) for lp in new)
            self.sent[c.index] = (len(text), len(lps) if lps is not None else 0, offset)
            if c.finished:
                self.done.add(c.index)
            chunks.append(self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice]))
        return chunks

    def usage_chunk(self, output: RequestOutput) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = self.usage(output)
        return body

    # == log-probabilities =======================================================================
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(self, lps: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
        if lps is None:
            return None
        tokens = [self.token_text(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [None if lp.logprob is None else   # an echoed prompt's first token
                                 {self.token_text(t): v for t, v in ((lp.token_id, lp.logprob), *lp.top)}
                                 for lp in lps],
                "text_offset": offsets}

    def _chat_logprobs(self, lps: list[TokenLogprob] | None) -> dict | None:
        if lps is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            return {"token": self.token_text(token_id), "logprob": logprob,
                    "bytes": token_bytes(self.tokenizer, token_id)}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in lps]}


def usage(output: RequestOutput) -> dict:
    """Token counts; ``cached_tokens``: prompt tokens the prefix cache served (whole blocks)."""
    prompt, completion = len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}


def token_bytes(tokenizer, token_id: int) -> list[int]:
    """A token's UTF-8 bytes. A byte-level BPE token may be part of a character, which its text
    cannot show; its vocabulary entry spells its exact bytes in GPT-2's byte alphabet."""
    piece = tokenizer.id_to_token(token_id) or ""
    alphabet = _byte_alphabet()
    if isinstance(tokenizer.decoder, decoders.ByteLevel) and all(ch in alphabet for ch in piece):
        return [alphabet[ch] for ch in piece]
    return list(tokenizer.decode([token_id], skip_special_tokens=False).encode())


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode``, inverted: printable bytes stand for themselves, the other
    bytes, in order, for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}

