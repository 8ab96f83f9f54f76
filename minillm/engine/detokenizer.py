"""Chapter 9: token ids to text, one token at a time, and stop strings.

Decoding a completion's ids on their own can lose text at the seam with the prompt (a
SentencePiece tokenizer drops the leading space of a first token; a byte-level one may split a
character across tokens). So the completion is decoded after the prompt's last few tokens, and
the text of those few is cut off again.

A stop string ends a completion and is not part of its text. While the completion runs, its
last ``len(longest stop) - 1`` characters might still become the start of a stop string, and a
trailing U+FFFD might still become a whole character: `Detokenizer.stable_text` leaves them
out, so that text streamed to a client is never taken back.

vLLM's ``include_stop_str_in_output`` keeps the stop string in the text (cut after it, not
before), and the text of a stop token that ended the completion (otherwise left out). With
``min_tokens``, a stop string counts only if it ends past the text of the first ``min_tokens``
tokens (vLLM checks stop strings only from the token after those).

The text grows incrementally, as vLLM's detokenizer does: only a short window of the last
tokens is decoded per update (from ``prefix_offset``, a few tokens before the new ones, whose
text is subtracted again), and the window moves forward whenever its text ends on a whole
character. Decoding the whole completion at every token would cost time proportional to its
length per token, on the engine's thread, for every stream at once. Where the window's text
does not extend its prefix's (a tokenizer whose decoding of a span depends on what precedes
it in a way the window cannot see), the detokenizer falls back to decoding everything.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["Detokenizer"]

CONTEXT_TOKENS = 4   # prompt tokens decoded in front of the completion
REPLACEMENT = "\ufffd"


class Detokenizer:
    """The text of one completion (``tokenizer``: a ``tokenizers.Tokenizer``)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 *, stop_token_ids: Collection[int] = (), include_stop: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop_token_ids, self.include_stop, self.min_tokens = stop_token_ids, include_stop, min_tokens
        self.min_end: int | None = 0 if min_tokens == 0 else None  # chars of the first min_tokens tokens' text
        self.skip_special_tokens = skip_special_tokens
        self.context = list(prompt_ids[-CONTEXT_TOKENS:])
        self.context_text = self._decode(self.context)
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.stop_reason: str | None = None
        self._decoded = 0   # output tokens the last update saw
        # The incremental window: ``_tokens`` is the context then the output tokens consumed so
        # far (a trailing stop token left out is not consumed yet); ``_committed`` the output text
        # up to token ``_read``, which no later token changes; the next window starts at ``_prefix``.
        self._tokens = list(self.context)
        self._consumed = 0
        self._prefix, self._read = 0, len(self._tokens)
        self._committed = ""
        self._whole = False  # fall back to decoding everything (see the module docstring)
        self._checked = 0    # characters of committed text already searched for stop strings

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def copy(self) -> Detokenizer:
        twin = object.__new__(Detokenizer)
        twin.__dict__.update(self.__dict__)
        twin._tokens = list(self._tokens)
        return twin

    def update(self, output_ids: Sequence[int]) -> str | None:
        """Extend the text by the tokens past those of the last update; returns the stop string
        that now ends the text (the text is cut before it), or ``None``. Once a stop string is
        found the text no longer changes (later tokens cannot move its first occurrence)."""
        if len(output_ids) == self._decoded or self.stop_reason is not None:
            self._decoded = len(output_ids)
            return self.stop_reason
        self._decoded = len(output_ids)
        if self.min_end is None and len(output_ids) >= self.min_tokens:
            self.min_end = len(self._text_of(output_ids[:self.min_tokens]))
        end = len(output_ids)
        if output_ids and output_ids[-1] in self.stop_token_ids and not self.include_stop:
            end -= 1   # a stop token's text is not part of the completion
        self.text = self._extend(output_ids, end)
        if self.min_end is None:
            return None
        checked = self._checked   # text that an earlier search covered and no token changes since
        self._checked = len(self._committed)
        hits = [(i, s) for s in self.stop
                if (i := self.text.find(s, max(0, self.min_end - len(s) + 1, checked - len(s) + 1))) >= 0]
        if hits:
            at, self.stop_reason = min(hits)
            self.text = self.text[:at + len(self.stop_reason) if self.include_stop else at]
        return self.stop_reason

    def _extend(self, output_ids: Sequence[int], end: int) -> str:
        """The text of ``output_ids[:end]``, decoding only the window past ``_prefix``."""
        if self._whole:
            return self._text_of(output_ids[:end])
        self._tokens += output_ids[self._consumed:end]
        self._consumed = end
        window = self._decode(self._tokens[self._prefix:])
        before = self._decode(self._tokens[self._prefix:self._read])
        if not window.startswith(before):
            self._whole = True
            return self._text_of(output_ids[:end])
        new = window[len(before):]
        if new and not new.endswith(REPLACEMENT):   # whole characters: commit, move the window on
            self._committed += new
            self._prefix, self._read = self._read, len(self._tokens)
            return self._committed
        return self._committed + new

    def _text_of(self, output_ids: Sequence[int]) -> str:
        """The text of ``output_ids`` by decoding them all, after the context (the definition)."""
        full = self._decode(self.context + list(output_ids))
        return full[len(self.context_text):] if full.startswith(self.context_text) else self._decode(output_ids)

    @property
    def stable_text(self) -> str:
        """The text that no later token can change (see the module docstring)."""
        end = len(self.text) - self.hold
        while end > 0 and self.text[end - 1] == REPLACEMENT:
            end -= 1
        return self.text[:max(end, 0)]
