"""A streamed chat's tool calls: what of its text streams as content, and the calls' deltas.

The worker's parser reads a sample's calls when its record is built (the gateway holds no
tokenizer and no parser), so a streamed chat with ``tools`` sends its text as content only up to
where a call may start: the first marker of any family the workers read (``<tool_call>``,
``<|python_tag|>``, ``{``: :data:`~redroll.engine_worker.engines.tool_calls.START_MARKERS`), or
the start of a text that may be the beginning of one; under a ``required`` or named choice the
whole output is calls, so none of it streams as content. When the record lands, the rest comes as
OpenAI streams it: the content not yet sent, then per call (by ``index``) a delta with its ``id``,
``type`` and ``function.name`` (``arguments`` empty), then one with its ``arguments``, then the
finish (``tool_calls``).
"""

from __future__ import annotations

from typing import Any

from redroll.engine_worker.engines.tool_calls import START_MARKERS
from redroll.shared.types import CompletionRecord

MARKERS = tuple(sorted({m for family in START_MARKERS.values() for m in family}))


def sendable(text: str) -> int:
    """How much of ``text`` is surely content: up to the first marker, or to a tail that may be a
    marker's beginning."""
    cut = len(text)
    for marker in MARKERS:
        at = text.find(marker)
        if at >= 0:
            cut = min(cut, at)
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut if text[:cut].strip() else 0  # (leading whitespace waits: a call may follow it)


class ToolCallStream:
    """The content sent so far, per choice."""

    def __init__(self, constrained: bool):
        self.constrained = constrained
        self.texts: dict[int, str] = {}
        self.sent: dict[int, int] = {}

    @classmethod
    def of(cls, body: Any) -> "ToolCallStream | None":
        tools, choice = getattr(body, "tools", None), getattr(body, "tool_choice", None)
        if not tools or choice == "none":
            return None
        return cls(constrained=choice == "required" or isinstance(choice, dict))

    def take(self, index: int, text: str, record: CompletionRecord | None) -> tuple[str, list[dict[str, Any]]]:
        """The content to send now for choice ``index`` (``text`` just arrived), and, once its
        ``record`` is here, its calls' deltas."""
        whole = self.texts.get(index, "") + text
        self.texts[index] = whole
        sent = self.sent.get(index, 0)
        calls = record.tool_calls[0] if record is not None and record.tool_calls else None
        if record is None:
            upto = sent if self.constrained else max(sent, sendable(whole))
        elif calls is None:
            upto = len(whole)
        else:
            content = calls.content or ""
            whole, upto = content, len(content)
        self.sent[index] = max(sent, upto)
        out = whole[sent:upto] if upto > sent else ""
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(calls.calls if calls is not None else ()):
            deltas.append({"index": i, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": i, "function": {"arguments": call.arguments}})
        return out, deltas


__all__ = ["MARKERS", "ToolCallStream", "sendable"]
