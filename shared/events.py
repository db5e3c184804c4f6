"""The per-request event log: a short capped, expiring string per request (``Keys.events``).

One line per event: ``<unix ms>\t<kind>\t<name>=<value>\t...`` (values hold no tab or
newline). The Lua scripts of the atomic steps append theirs inside the step (a checkpoint, the
finish, a dead letter); a worker appends what it takes back (XCLAIM), pipelined. What every
request goes through anyway is not logged but read from what Redis holds when asked (see
redroll/ops/trace.py): its submit (the request entry's id is its time; the entry's stream and fields
say priority, lane and producer, and the finish event names them once the entry is gone), its
first delivery (the worker that ended it, or holds it now), and the consumer groups that applied
its record (their de-duplication sets). So a request that runs once costs the log one SET, in its
finish (measured: benchmarks/event_log.py).

``delivered``  worker, entry, stream, n (delivery count), from (the previous owner), why
               (why it was taken back: its worker died, handed back by …, after an error: …)
``checkpoint`` worker, entry, stream, tokens (saved so far), saves (a run of saves by one delivery
               is one line: the last, counting them)
``finished``   worker, entry, stream, status, reply (where the record went), rec (its entry id
               there), summary (tokens,engine_ms,queue_ms,weight_version,attempt,requeued,error)
``fenced``     worker, entry, stream: its finish found the entry no longer this worker's (lease lost)
``dead``       entry, stream, source (worker: a request entry; consumer:<group>, producer: a record's),
               deliveries, by (the consumer that wrote the dead letter), reason
``trimmed``    n: how many of the oldest events gave way to the cap (always first, time 0)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from redroll.shared.keys import events_key, stream_name
from redroll.shared.streams import text
from redroll.shared.types import CompletionRecord


@dataclass(frozen=True)
class EventLog:
    """The event log's bounds: at most ``max_bytes`` (the oldest events give way) and it expires
    ``ttl_s`` after its last event."""

    max_bytes: int = 4096
    ttl_s: int = 3600

    every_request: bool = True
    """True: every request's finish is logged; False: a finish only adds to a log that an
    incident began (a reclaim, a checkpoint, a lost lease, a dead letter)."""

    @classmethod
    def from_settings(cls, settings: Any) -> "EventLog | None":
        """The log the settings ask for (``event_log``: off, incidents or all), or None when off."""
        if settings.event_log == "off":
            return None
        return cls(max_bytes=settings.event_log_max_bytes, ttl_s=settings.event_log_ttl_s,
                   every_request=settings.event_log == "all")

    def script_args(self) -> list[Any]:
        """What a script is given for the log: its cap and TTL."""
        return [self.max_bytes, self.ttl_s]

    def finish_args(self) -> list[Any]:
        """What the finish script is given: the cap, negative when only incidents begin a log."""
        return [self.max_bytes if self.every_request else -self.max_bytes, self.ttl_s]


OFF_ARGS = ["0", "0"]
"""What a script is given when the log is off (a cap of 0: nothing is written)."""


def script_args(log: EventLog | None) -> list[Any]:
    return log.script_args() if log is not None else OFF_ARGS


def finish_args(log: EventLog | None) -> list[Any]:
    return log.finish_args() if log is not None else OFF_ARGS


SUMMARY_FIELDS = ("tokens", "engine_ms", "queue_ms", "weight_version", "attempt", "requeued", "error")
"""What the ``finished`` event keeps of a record, comma-separated in this order (empty: none)."""


def record_summary(record: CompletionRecord) -> str:
    """What the ``finished`` event keeps of a record (the record itself is consumed and trimmed)."""
    meta = record.meta_info
    tokens = 0
    for ids in record.output_token_ids:
        tokens += len(ids)
    version = meta.get("weight_version")
    error = clean(record.error)[:200].replace(",", ";") if record.error else ""
    return (f"{tokens},{meta.get('engine_ms', '')},{meta.get('queue_ms', '')},"
            f"{'' if version is None else clean(version).replace(',', ';')},{meta.get('attempt', '')},"
            f"{record.requeued or ''},{error}")


def parse_summary(raw: str) -> dict[str, str]:
    """:func:`record_summary` back, as the values that are there."""
    return {k: v for k, v in zip(SUMMARY_FIELDS, raw.split(",", len(SUMMARY_FIELDS) - 1)) if v}


def clean(value: Any) -> str:
    """A value as a line holds it (tabs and newlines become spaces)."""
    return text(value).replace("\t", " ").replace("\n", " ")


CHECKPOINT_COUNTS_WIDTH = 26
"""A checkpoint event's counts (``<tokens>\tsaves=<n>``) are padded with spaces to this width, so
the line of a delivery's run of checkpoints keeps one width and each save rewrites it in place
(checkpoint_many.lua); :func:`parse_line` drops the padding."""


def checkpoint_event(worker: str, stream: str, entry_id: str, tokens: int, saves: int) -> str:
    """A checkpoint's event line after its time (which the function puts before it): the worker,
    the entry and its request stream (after the hash tag), the tokens saved and the writer's saves
    of that entry so far."""
    line = "\t" + event_fields("checkpoint", {"worker": worker, "entry": entry_id, "stream": stream_name(stream),
                                              "tokens": tokens, "saves": saves})
    counts = len(line) - line.index("\ttokens=") - len("\ttokens=")
    return line + " " * (CHECKPOINT_COUNTS_WIDTH - counts)


def event_fields(kind: str, fields: dict[str, Any]) -> str:
    """An event line's kind and fields (``<kind>\t<name>=<value>\t…``; a None value is left out)."""
    return "\t".join([kind, *(f"{k}={clean(v)}" for k, v in fields.items() if v is not None)])


def event_line(kind: str, fields: dict[str, Any], at_ms: int | None = None) -> str:
    at = int(time.time() * 1000) if at_ms is None else at_ms
    return f"{at}\t{event_fields(kind, fields)}\n"


def parse_line(line: str) -> tuple[float | None, str, dict[str, str]]:
    """(Unix seconds or None, kind, fields) of one line of a log."""
    parts = line.rstrip(" ").split("\t")  # (a checkpoint's line is padded with spaces: see checkpoint_many.lua)
    try:
        ms = int(parts[0])
    except ValueError:
        ms = 0
    fields = dict(p.split("=", 1) if "=" in p else (p, "") for p in parts[2:])
    return (ms / 1000.0 if ms > 0 else None), (parts[1] if len(parts) > 1 else "?"), fields


def add_event(pipe: Any, key: str, log: EventLog, line: str) -> None:
    """Queue one event on ``pipe``: APPEND, then the TTL. (The cap is kept by the scripts' appends:
    the few a worker makes between two of them may exceed it by as much.)"""
    pipe.append(key, line)
    pipe.expire(key, log.ttl_s)


@dataclass(frozen=True)
class Delivery:
    """An entry a worker took back (XCLAIM), as the reclaim knows it.

    Attributes:
        stream: the request stream it is on.
        entry_id: its id there.
        fields: the entry's stream fields (``rid`` names the request).
        n: its delivery count with this delivery.
        previous: the consumer that held it before.
        why: why it was taken back (a death, a hand-back, a lost claim reply).
    """

    stream: str
    entry_id: str
    fields: Any
    n: int = field(kw_only=True)
    previous: str | None = field(default=None, kw_only=True)
    why: str | None = field(default=None, kw_only=True)


def delivery_events(deliveries: Iterable[Delivery], worker: str) -> list[tuple[str, str]]:
    """(events key, line) of each delivery whose entry names its request."""
    out = []
    for d in deliveries:
        rid = d.fields.get(b"rid", d.fields.get("rid")) if isinstance(d.fields, dict) else None
        if rid is None:
            continue
        line = event_line("delivered", {"worker": worker, "entry": d.entry_id, "stream": stream_name(d.stream),
                                        "n": d.n, "from": d.previous, "why": d.why})
        out.append((events_key(d.stream, text(rid)), line))
    return out


def add_events(pipe: Any, log: EventLog, events: Sequence[tuple[str, str]]) -> None:
    for key, line in events:
        add_event(pipe, key, log, line)
