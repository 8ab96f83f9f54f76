"""Chapter 9's incremental detokenizer against decoding the whole completion at every token.

The oracle is the definition: after each token, the completion's text is the decoding of the
prompt's last tokens followed by the output, minus the prompt tokens' own text (or the output
decoded alone when that prefix does not match), cut before the first stop string that ends past
the first ``min_tokens`` tokens' text, with a final stop token's text left out. The detokenizer
must give exactly that text (and its stable part) after every token, for a byte-level tokenizer
(the bundled one) and a SentencePiece-style one (a leading space stripped, byte fallback).
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engine.detokenizer import CONTEXT_TOKENS, REPLACEMENT, Detokenizer


def bundled_tokenizer():
    from minillm.engine import BUNDLED_MODEL
    from minillm.model import load_tokenizer

    return load_tokenizer(BUNDLED_MODEL)[0]


def metaspace_tokenizer():
    """A tiny SentencePiece-style tokenizer (Llama's decoder: "▁" to space, byte fallback,
    the first leading space stripped), built in memory."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(256):
        vocab[f"<0x{i:02X}>"] = len(vocab)
    for piece in ["▁", "▁the", "▁a", "b", "c", "ab", "▁stop", "op", "st", "é", "▁é", "\n", "▁\n", "x", "▁x"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok


TOKENIZERS = {"bundled": bundled_tokenizer(), "metaspace": metaspace_tokenizer()}


def expected_text(tok, prompt, output, stop, include_stop, stop_token_ids, min_tokens):
    """(text, stop_reason) after ``output``, from whole decodes at every token (the definition)."""
    def decode(ids):
        return tok.decode(list(ids), skip_special_tokens=True)

    context = list(prompt[-CONTEXT_TOKENS:])
    context_text = decode(context)

    def text_of(ids):
        full = decode(context + list(ids))
        return full[len(context_text):] if full.startswith(context_text) else decode(ids)

    min_end = None
    for n in range(1, len(output) + 1):
        ids = output[:n]
        if min_end is None and n >= min_tokens:
            min_end = len(text_of(ids[:min_tokens]))
        if ids[-1] in stop_token_ids and not include_stop:
            ids = ids[:-1]
        text = text_of(ids)
        if min_end is None:
            continue
        hits = [(i, s) for s in stop if (i := text.find(s, max(0, min_end - len(s) + 1))) >= 0]
        if hits:
            at, reason = min(hits)
            return text[:at + len(reason) if include_stop else at], reason
    return text, None


def metaspace_units():
    """Token runs of the SentencePiece-style tokenizer that decode to whole characters: each
    piece, and 'é' as its two UTF-8 bytes. (Byte tokens in arbitrary order are left out: its
    byte-fallback decoder turns every byte of an invalid run into U+FFFD, a valid space included,
    so a later byte can rewrite the text of earlier ones, for any detokenizer.)"""
    vocab = TOKENIZERS["metaspace"].get_vocab()
    pieces = sorted(i for t, i in vocab.items() if not t.startswith("<"))   # the dict's order varies
    return [[i] for i in pieces] + [[vocab["<0xC3>"], vocab["<0xA9>"]]]


METASPACE_UNITS = metaspace_units()


@st.composite
def token_ids(draw, name, min_size, max_size, lone_byte=None):
    if name == "bundled":   # byte-level: any ids, invalid UTF-8 included
        ids = st.integers(0, TOKENIZERS[name].get_vocab_size() - 1)
        return draw(st.lists(ids, min_size=min_size, max_size=max_size))
    units = draw(st.lists(st.sampled_from(METASPACE_UNITS), min_size=min_size, max_size=max_size))
    out = [i for unit in units for i in unit]
    if lone_byte is not None and draw(st.booleans()):   # 'é' split across the prompt and the output
        out = [TOKENIZERS[name].get_vocab()[lone_byte]] + out if lone_byte == "<0xA9>" else out + [
            TOKENIZERS[name].get_vocab()[lone_byte]]
    return out


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(TOKENIZERS)))
    prompt = draw(token_ids(name, 1, 8, "<0xC3>"))
    output = draw(token_ids(name, 1, 40, "<0xA9>"))
    # stop strings that occur: pieces of the output's own text, and one that may not
    text = TOKENIZERS[name].decode(output, skip_special_tokens=True)
    stop = []
    for _ in range(draw(st.integers(0, 2))):
        if len(text) >= 2 and draw(st.booleans()):
            i = draw(st.integers(0, len(text) - 2))
            stop.append(text[i:i + draw(st.integers(1, min(4, len(text) - i)))])
        else:
            stop.append(draw(st.sampled_from(["\n\n", " a", "é", "zz"])))
    stop = [s for s in stop if s]
    stop_token_ids = draw(st.sets(st.sampled_from(output), max_size=2)) if draw(st.booleans()) else set()
    return name, prompt, output, stop, draw(st.booleans()), stop_token_ids, draw(st.integers(0, 6))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_incremental_text_equals_whole_decoding_after_every_token(case):
    name, prompt, output, stop, include_stop, stop_token_ids, min_tokens = case
    tok = TOKENIZERS[name]
    det = Detokenizer(tok, prompt, stop, stop_token_ids=stop_token_ids, include_stop=include_stop,
                      min_tokens=min_tokens)
    for n in range(1, len(output) + 1):
        reason = det.update(output[:n])
        want_text, want_reason = expected_text(tok, prompt, output[:n], stop, include_stop, stop_token_ids,
                                               min_tokens)
        assert (det.text, reason) == (want_text, want_reason), (n, det.text, want_text)
        assert det.update(output[:n]) == reason      # the same tokens again: nothing changes
        stable = det.stable_text
        assert want_text.startswith(stable) and not stable.endswith(REPLACEMENT)
        if reason is not None:
            break


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_a_fork_continues_on_its_own(name):
    tok = TOKENIZERS[name]
    vocab = tok.get_vocab_size()
    out = [(7 * i + 3) % vocab for i in range(30)]
    parent = Detokenizer(tok, [5, 6, 7])
    parent.update(out[:10])
    child = parent.copy()
    parent.update(out[:20])
    child.update(out[:10] + [4, 4, 4])
    assert parent.text == expected_text(tok, [5, 6, 7], out[:20], [], False, set(), 0)[0]
    assert child.text == expected_text(tok, [5, 6, 7], out[:10] + [4, 4, 4], [], False, set(), 0)[0]


class CountingTokenizer:
    """A tokenizer that records how many ids each ``decode`` call was given."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_an_update_costs_the_new_tokens_not_the_whole_completion():
    """A completion of 4,000 tokens updated after each: every decode is of a short window,
    where whole decodes would decode 8 million tokens in all."""
    tok = CountingTokenizer(TOKENIZERS["bundled"])
    out = [(37 * i + 11) % TOKENIZERS["bundled"].get_vocab_size() for i in range(4000)]
    det = Detokenizer(tok, [1, 2, 3], stop=["never appears \x00"])
    for n in range(1, len(out) + 1):
        det.update(out[:n])
    assert det.text == expected_text(TOKENIZERS["bundled"], [1, 2, 3], out, [], False, set(), 0)[0]
    assert max(tok.lengths) < 64 and sum(tok.lengths) < 40 * len(out), (max(tok.lengths), sum(tok.lengths))
