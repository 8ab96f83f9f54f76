"""Chapter 9: text checks that cost nothing, done before any tokenizing.

**A lower bound on a prompt's tokens.** For a byte-level BPE tokenizer (GPT-2's scheme, and
the bundled model's), the pre-tokenizer maps every byte of the UTF-8 text to one character of
a 256-character alphabet, and every token is a vocabulary piece of at most ``max_token_bytes``
of those characters; an added (special) token matched in the raw text covers its own UTF-8
bytes. So a text of ``b`` bytes has at least ``ceil(b / max_token_bytes)`` tokens, and, since a
character is at least one byte, at least ``ceil(len(text) / max_token_bytes)``, which needs no
pass over the text at all. When that bound alone exceeds what the context can hold, the
prompt is refused before the tokenizer ever sees it: a 50 MB prompt costs nothing. For any
other kind of tokenizer the bound is 0 (nothing is refused early; the text is tokenized in a
thread pool, off the event loop and the engine thread).

**Lone surrogates.** JSON can spell ``"\\ud800"``, a half of a UTF-16 pair, which Python
keeps as a string no encoder accepts (the tokenizer raises ``TypeError``). `find_surrogate`
finds one anywhere in a parsed body, so that the request is refused with a 400 naming it.
"""
from __future__ import annotations

import json
import math
import re

from minillm.server.responses import _byte_alphabet

__all__ = ["PromptBound", "find_surrogate", "max_token_bytes"]

_SURROGATE = re.compile("[\ud800-\udfff]")


def find_surrogate(obj, where: str = "") -> str | None:
    """The path (``"messages.0.content"``) of the first string in ``obj`` (parsed JSON) that
    holds a lone surrogate, or ``None``."""
    if isinstance(obj, str):
        return where or "body" if not obj.isascii() and _SURROGATE.search(obj) else None
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
            return f"{where}.{key}" if where else key
        if isinstance(value, (str, dict, list, tuple)):
            found = find_surrogate(value, f"{where}.{key}" if where else str(key))
            if found is not None:
                return found
    return None


def max_token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes one token can cover, for a byte-level BPE ``tokenizers.Tokenizer``
    with no normalizer; ``None`` for any other tokenizer (no bound is known)."""
    spec = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE" \
            or not any(p.get("type") == "ByteLevel" for p in pres):
        return None
    alphabet = _byte_alphabet()
    longest = max((len(piece) if all(ch in alphabet for ch in piece) else len(piece.encode("utf-8", "surrogatepass"))
                   for piece in tokenizer.get_vocab(with_added_tokens=False)), default=1)
    added = (len(t.get("content", "").encode("utf-8", "surrogatepass")) for t in spec.get("added_tokens") or ())
    return max(longest, *added, 1)


class PromptBound:
    """``at_least(text)``: a lower bound on the tokens of ``text`` (see the module docstring)."""

    def __init__(self, tokenizer):
        self.max_token_bytes = max_token_bytes(tokenizer)

    def at_least(self, text: str, limit: int) -> int:
        """A lower bound on ``text``'s tokens, exact enough to tell whether it exceeds
        ``limit``: from its length alone when that suffices (O(1)), else from its UTF-8 size
        (only for texts shorter than ``limit * max_token_bytes`` characters)."""
        m = self.max_token_bytes
        if m is None:
            return 0
        bound = math.ceil(len(text) / m)
        if bound > limit or len(text) * 4 <= limit * m:   # decided, or even 4 bytes a char could not
            return bound
        return math.ceil(len(text.encode("utf-8", "surrogatepass")) / m)
