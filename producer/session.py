"""Multi-turn sessions: token-exact turns, each run where the conversation so far is cached.

A session keeps the conversation as token ids: turn k + 1's prompt is turn k's prompt ids + its
completion ids + the new part, never the conversation re-rendered as text and tokenized again (a
re-encoding of the model's text can give other ids: the trainer would learn from tokens the model
never produced). The new part is token ids (``turn(new_ids)``), or text the worker renders for
the new part only: ``turn(messages=[...])`` (a chat: the template's end of the last assistant
turn, the new messages, the generation prompt) or ``turn(prompt="...")`` (a text, encoded), sent
as ``prefix_ids`` + ``messages`` / ``prompt`` (docs/agents.md, "Sessions"). The first chat turn is
rendered whole. Every turn carries the session's ``affinity_key``: with affinity lanes on, all
turns queue on one lane and run on that lane's owner, whose prefix cache holds everything but the
new part; a turn whose worker died runs on another worker from the same ids.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from redroll.shared.types import CompletionRecord, RecordStatus


@dataclass
class Session:
    """One conversation. ``turn(new_ids)``, ``turn(messages=...)`` or ``turn(prompt=...)`` appends
    the new part to the conversation, generates the reply and appends it too; returns the turn's
    record (its ``prompt_token_ids``: the prompt as the engine ran it)."""

    producer: Any
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    conversation: list[int] = field(default_factory=list)
    """The conversation's token ids so far: the last turn's prompt + completion."""
    records: list[CompletionRecord] = field(default_factory=list)

    async def turn(self, new_ids: Sequence[int] | None = None, *, messages: Sequence[Mapping[str, Any]] | None = None,
                   prompt: str | None = None, **fields: Any) -> CompletionRecord:
        if (new_ids is not None) + (messages is not None) + (prompt is not None) != 1:
            raise ValueError("a turn is one of new_ids, messages or prompt")
        request_id = f"{self.key}-t{len(self.records)}"
        if new_ids is not None:
            if not new_ids and not self.conversation:
                raise ValueError("the first turn of a session needs a message")
            body: dict[str, Any] = {"input_ids": self.conversation + list(new_ids)}
        else:
            body = {"messages": list(messages)} if messages is not None else {"prompt": prompt}
            if self.conversation:
                body["prefix_ids"] = list(self.conversation)
            body["return_prompt_token_ids"] = True
        future = await self.producer.submit(request_id=request_id, affinity_key=self.key, **body, **fields)
        record: CompletionRecord = await future
        self.records.append(record)
        if record.status is RecordStatus.FINISHED:
            prompt_ids = body.get("input_ids") or record.prompt_token_ids or []
            self.conversation = list(prompt_ids) + list(record.output_token_ids[0])
        return record
