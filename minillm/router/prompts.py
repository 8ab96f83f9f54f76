"""Chapter 13: a request body's prompt as the token ids the instance will see.

The router must name a request's blocks exactly as the instance will, so it tokenizes with the
same ``tokenizer.json`` and, for chat, renders the messages with the server's own code: the
server's `ChatMessage` model (text content parts joined) and `minillm.model.loader.render_chat`
with the checkpoint's template. A completion prompt that is already token ids is used as is;
of a list of prompts, the first decides (they all go to one instance).

A body the router cannot make sense of gives no token ids (``[]``): it is routed by load alone,
and the instance answers it, with its error if it is wrong, in OpenAI's envelope.
"""
from __future__ import annotations

from pathlib import Path

from minillm.model.loader import load_tokenizer, render_chat
from minillm.server.protocol import ChatMessage

__all__ = ["PromptTokenizer"]


class PromptTokenizer:
    """``token_ids(body, chat)``: the prompt's token ids, as an instance of ``model`` sees them."""

    def __init__(self, model: str | Path):
        self.tokenizer, self.chat_template = load_tokenizer(model)

    def token_ids(self, body: object, chat: bool) -> list[int]:
        if not isinstance(body, dict):
            return []
        try:
            if chat:
                if self.chat_template is None or not isinstance(body.get("messages"), list):
                    return []
                messages = [ChatMessage.model_validate(m).as_dict() for m in body["messages"]]
                return self.tokenizer.encode(render_chat(self.chat_template, messages)).ids
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]      # several prompts: the first decides
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt).ids
            if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return list(prompt)
        except Exception:   # noqa: BLE001 - a malformed body: the instance will say what is wrong
            return []
        return []
