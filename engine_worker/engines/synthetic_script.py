"""The synthetic engine's scripted replies (``--script FILE``): a model that says given texts.

A tiny random model never calls a tool on its own; a test or an example that needs a model which
does scripts its replies instead: ``FILE`` is a JSON list of texts, and the reply to a request is
the text at the index of its turn (the number of assistant messages in its chat; 0 for a text or
token-id prompt; the last text once the list is used up). The engine then speaks bytes: each
reply is its UTF-8 bytes as token ids (one per byte), decoded back the same way, so the record's
text, the parsers that read it (``--tool-call-parser``) and the gateway's answer are exactly what
the script says. A reply longer than ``max_new_tokens`` is cut (``length``); one that fits ends
with ``stop``, as a model that emitted its end-of-sequence token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import msgspec

from redroll.shared.types import GenerationRequest


class ScriptBytes:
    """The scripted engine's tokenizer: text is its UTF-8 bytes (ids 0-255); a chat, its messages
    encoded (no template: the reply is scripted, not derived from them)."""

    chat_template = "(the messages' own bytes)"
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(t & 255 for t in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, conversation: list[dict], tools: list | None = None, **_: object) -> list[int]:
        return list(msgspec.msgpack.encode([conversation, tools]))


def load_script(path: str) -> list[bytes]:
    """The replies of a script file (a JSON list of texts)."""
    replies = json.loads(Path(path).read_text())
    if not isinstance(replies, list) or not replies or not all(isinstance(r, str) for r in replies):
        raise ValueError(f"{path}: a script is a JSON list of at least one text")
    return [r.encode() for r in replies]


def reply_for(script: list[bytes], request: GenerationRequest) -> bytes:
    """The scripted reply to ``request``: the text of its turn."""
    turn = sum(1 for m in request.messages or () if m.role == "assistant")
    return script[min(turn, len(script) - 1)]


def scripted_ids(reply: bytes, max_new_tokens: int) -> tuple[list[int], str]:
    """A reply's token ids within the budget, and how it ended."""
    ids = list(reply[:max_new_tokens])
    return ids, "stop" if len(reply) <= max_new_tokens else "length"


__all__ = ["ScriptBytes", "load_script", "reply_for", "scripted_ids"]


