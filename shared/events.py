"""The per-request event log: a small capped, expiring stream per request (``Keys.events``).

The Lua scripts of the atomic steps (submit, checkpoint, finish, dead letter) append their event
inside the step; deliveries (claim reads, reclaims) and consumer groups' applies are appended by
the process that made them, pipelined with its other writes. ``redroll trace`` (:mod:`redroll.trace`)
reads the log back. Each event is one stream entry whose field ``ev`` names it:

``submitted``  entry, stream (``requests``, ``requests:high``, ``requests:lane:<j>``), reply (the
               producer's reply stream, or none)
``delivered``  worker, entry, n (delivery count), how (``read``: a claim read; ``reclaimed``),
               from (the previous owner of a reclaimed entry), why (why it was taken back)
``checkpoint`` worker, entry, tokens (saved so far)
``finished``   worker, entry, status, reply (where the record went), rec (its result entry id),
               summary (JSON: tokens, engine_ms, queue_ms, weight_version, error)
``fenced``     worker, entry: its finish found the entry was no longer this worker's (lease lost)
``dead``       entry, source, reason, deliveries
``applied``    group, consumer
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import msgspec

from .keys import events_key
from .streams import text
from .types import CompletionRecord

SUMMARY_ENCODER = msgspec.json.Encoder()


@dataclass(frozen=True)
class EventLog:
    """The event log's bounds: its entries are trimmed to the last ``max_len`` (XADD MAXLEN) and the
    stream expires ``ttl_s`` after its last event (EXPIRE with every append)."""

    max_len: int = 64
    ttl_s: int = 3600

    @classmethod
    def from_settings(cls, settings: Any) -> "EventLog | None":
        """The log the settings ask for, or None when ``event_log`` is off."""
        if not settings.event_log:
            return None
        return cls(max_len=settings.event_log_max_len, ttl_s=settings.event_log_ttl_s)

    def script_args(self) -> list[Any]:
        """What a script is given for the log: its cap and TTL."""
        return [self.max_len, self.ttl_s]


OFF_ARGS = ["0", "0"]
"""What a script is given when the log is off (a cap of 0: nothing is written)."""


def script_args(log: EventLog | None) -> list[Any]:
    return log.script_args() if log is not None else OFF_ARGS


def record_summary(record: CompletionRecord) -> bytes:
    """What the ``finished`` event keeps of a record (the record itself is consumed and trimmed)."""
    meta = record.meta_info
    summary: dict[str, Any] = {
        "tokens": sum(len(ids) for ids in record.output_token_ids),
        "engine_ms": meta.get("engine_ms"),
        "queue_ms": meta.get("queue_ms"),
        "weight_version": meta.get("weight_version"),
        "attempt": meta.get("attempt"),
    }
    if record.error:
        summary["error"] = record.error[:200]
    return SUMMARY_ENCODER.encode(summary)


def add_event(pipe: Any, key: str, log: EventLog, fields: dict[str, Any]) -> None:
    """Queue one event on ``pipe`` (a pipeline or a MULTI): XADD with the cap, then the TTL."""
    pipe.xadd(key, fields, maxlen=log.max_len, approximate=False)
    pipe.expire(key, log.ttl_s)


@dataclass(frozen=True)
class Delivery:
    """One delivery of an entry to a worker, as the claim that made it knows it."""

    stream: str
    entry_id: str
    fields: Any
    """The entry's stream fields (``rid`` names the request)."""
    n: int = 1
    how: str = "read"
    previous: str | None = None
    why: str | None = None


def delivery_events(deliveries: Iterable[Delivery], worker: str) -> list[tuple[str, dict[str, Any]]]:
    """(events key, fields) of each delivery whose entry names its request."""
    out = []
    for d in deliveries:
        rid = d.fields.get(b"rid", d.fields.get("rid")) if isinstance(d.fields, dict) else None
        if rid is None:
            continue
        fields: dict[str, Any] = {"ev": "delivered", "worker": worker, "entry": d.entry_id, "n": d.n, "how": d.how}
        if d.previous:
            fields["from"] = d.previous
        if d.why:
            fields["why"] = d.why
        out.append((events_key(d.stream, text(rid)), fields))
    return out


def add_events(pipe: Any, log: EventLog, events: Sequence[tuple[str, dict[str, Any]]]) -> None:
    for key, fields in events:
        add_event(pipe, key, log, fields)
