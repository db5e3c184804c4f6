"""Multi-turn sessions: every turn of one conversation runs where the conversation so far is cached.

A session resubmits the whole conversation each turn (prompt + every previous output + the new
message, as token ids) with the session's ``affinity_key``; with affinity lanes on, all turns
queue on one lane and run on that lane's owner, whose prefix cache holds everything but the new
message. With lanes off the same code works, without the affinity.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from redroll.shared.types import CompletionRecord, RecordStatus


@dataclass
class Session:
    """One conversation. ``turn(new_ids)`` appends ``new_ids`` (the next user message, as token ids)
    to the conversation, generates the reply and appends it too; returns the turn's record."""

    producer: Any
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    conversation: list[int] = field(default_factory=list)
    records: list[CompletionRecord] = field(default_factory=list)

    async def turn(self, new_ids: list[int], **fields: Any) -> CompletionRecord:
        if not new_ids and not self.conversation:
            raise ValueError("the first turn of a session needs a message")
        input_ids = self.conversation + list(new_ids)
        future = await self.producer.submit(request_id=f"{self.key}-t{len(self.records)}", input_ids=input_ids,
                                            affinity_key=self.key, **fields)
        record: CompletionRecord = await future
        self.records.append(record)
        if record.status is RecordStatus.FINISHED:
            self.conversation = input_ids + list(record.output_token_ids[0])
        return record
