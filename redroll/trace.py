"""The life of one request, from its event log (``{ns}:events:<request_id>``, see shared/events.py)
and what Redis still holds of it: ``redroll trace REQUEST_ID``, and the dashboard's request page.

:func:`request_timeline` reads; :func:`render_timeline` draws it for a terminal. Where Redis no
longer holds a step (the log trimmed to its cap, or expired; a record consumed), the timeline says
so in ``gaps`` rather than guessing.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional, Sequence

import msgspec
from redis.asyncio import Redis

from redroll.shared.keys import WORKERS_GROUP, Keys
from redroll.shared.streams import text

REASON_FINISHED = "finished"
REASON_LEASE_LOST = "lease lost"
REASON_HANDED_BACK = "handed back"
REASON_WORKER_DIED = "worker died"
REASON_DEAD = "dead-lettered"
REASON_RUNNING = "still in flight"
REASON_UNKNOWN = "not in the log"


class Event(msgspec.Struct, kw_only=True):
    """One entry of the event log, as it is."""

    id: str
    at: float
    """Unix seconds (from the entry id)."""
    kind: str
    fields: dict[str, str]


class Submitted(msgspec.Struct, kw_only=True):
    at: float
    entry: str
    stream: str
    priority: str
    """``high`` or ``normal``."""
    lane: Optional[int] = None
    producer: Optional[str] = None
    """The producer whose reply stream waits for the record (None: the record goes to the results stream)."""


class DeliveryStep(msgspec.Struct, kw_only=True):
    at: float
    worker: str
    entry: str
    n: int
    """The entry's delivery count with this delivery."""
    how: str
    """``read`` (a claim), ``reclaimed``, or with affinity lanes the kind of claim (own, shared, stolen, …)."""
    previous: Optional[str] = None
    """A reclaimed entry's previous owner."""
    why: Optional[str] = None
    """Why a reclaimed entry was taken back."""
    ended: str = REASON_UNKNOWN
    """finished, lease lost, handed back, worker died, dead-lettered, still in flight, or not in the log."""
    ended_at: Optional[float] = None


class CheckpointStep(msgspec.Struct, kw_only=True):
    """A run of checkpoints one delivery saved (the log keeps the last of a run, with its count)."""

    at: float
    """When the last of them was saved."""
    worker: str
    entry: str
    tokens: int
    """Tokens saved by the last of them."""
    saves: int = 1


class RecordStep(msgspec.Struct, kw_only=True):
    at: float
    worker: str
    entry: str
    status: str
    reply: str
    """The stream the record went to."""
    result_entry: str
    tokens: Optional[int] = None
    engine_ms: Optional[float] = None
    queue_ms: Optional[float] = None
    weight_version: Optional[str] = None
    attempt: Optional[int] = None
    error: Optional[str] = None
    in_redis: Optional[bool] = None
    """Whether the record itself is still in ``reply`` (consumers delete or trim what they read)."""


class DeadStep(msgspec.Struct, kw_only=True):
    at: float
    entry: str
    source: str
    reason: str
    deliveries: Optional[int] = None
    by: Optional[str] = None


class AppliedStep(msgspec.Struct, kw_only=True):
    at: float
    group: str
    consumer: str


class Now(msgspec.Struct, kw_only=True):
    """What Redis holds of the request at the moment of the trace."""

    queued_entry: Optional[str] = None
    """The entry its submit de-duplication key names (queued or in flight; gone once it finished)."""
    owner: Optional[str] = None
    """The worker that holds that entry now (None: not delivered, or no longer pending)."""
    deliveries: Optional[int] = None
    checkpoint_tokens: Optional[int] = None
    """Tokens in its checkpoint (a resumable request, until its finish deletes it)."""


class Timeline(msgspec.Struct, kw_only=True):
    request_id: str
    events_key: str
    log_found: bool
    events_kept: int = 0
    events_trimmed: int = 0
    """Events the log's cap (``event_log_max_len``) dropped, oldest first; -1: some, how many unknown."""
    ttl_s: Optional[int] = None
    """Seconds until the log expires."""
    submitted: Optional[Submitted] = None
    deliveries: list[DeliveryStep] = []
    checkpoints: list[CheckpointStep] = []
    records: list[RecordStep] = []
    dead_letters: list[DeadStep] = []
    applied: list[AppliedStep] = []
    now: Now = msgspec.field(default_factory=Now)
    gaps: list[str] = []
    """What Redis no longer holds (and so the timeline cannot show)."""
    events: list[Event] = []

    def to_builtins(self) -> dict[str, Any]:
        """A JSON-able dict (the dashboard's and ``--json``'s form)."""
        return msgspec.to_builtins(self)


def _at(entry_id: str) -> float:
    return int(entry_id.split("-", 1)[0]) / 1000.0


def _int(value: Optional[str]) -> Optional[int]:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


async def _pick_partition(r: Redis, parts: Sequence[Keys], request_id: str) -> Keys:
    """The partition whose keys hold the request (its event log, else its rid key); the first when none does."""
    if len(parts) == 1:
        return parts[0]
    async with r.pipeline(transaction=False) as pipe:
        for part in parts:
            pipe.exists(part.events(request_id), part.rid(request_id))
        found = await pipe.execute()
    for part, n in zip(parts, found):
        if n:
            return part
    return parts[0]


async def request_timeline(r: Redis, keys: Keys | Sequence[Keys], request_id: str) -> Timeline:
    """The life of ``request_id`` as far as Redis still knows it. ``keys``: the pipeline's
    partitions (``Settings.partition_keys``), or one partition's keys."""
    parts = [keys] if isinstance(keys, Keys) else list(keys)
    part = await _pick_partition(r, parts, request_id)
    key = part.events(request_id)
    async with r.pipeline(transaction=False) as pipe:
        pipe.xrange(key, "-", "+")
        pipe.ttl(key)
        pipe.get(part.rid(request_id))
        pipe.getrange(part.partial(request_id), 0, 63)
        raw, ttl, rid_value, partial_head = await pipe.execute(raise_on_error=False)
    if isinstance(raw, Exception):
        raise raw
    events = [Event(id=text(i), at=_at(text(i)), kind=text(f.get(b"ev", b"?")),
                    fields={text(k): text(v) for k, v in f.items() if k != b"ev"}) for i, f in raw]
    t = Timeline(request_id=request_id, events_key=key, log_found=bool(events), events_kept=len(events),
                 ttl_s=ttl if isinstance(ttl, int) and ttl >= 0 else None, events=events)
    if events:
        t.events_trimmed = await _trimmed(r, key, events)
    _fold(t)
    await _live(r, part, t, rid_value, partial_head)
    await _records_still_there(r, t)
    _gaps(t)
    return t


async def _trimmed(r: Redis, key: str, events: list[Event]) -> int:
    """How many events the cap dropped: none when the log begins with the submit; else XINFO
    STREAM's entries-added less the events kept and the checkpoints merged (Redis 7+, Valkey), at
    least 1; -1 where the server does not say."""
    try:
        info = await r.xinfo_stream(key)
    except Exception:
        info = {}
    if events[0].kind == "submitted":
        return 0
    added = info.get("entries-added") if isinstance(info, dict) else None
    if isinstance(added, int):
        # (a checkpoint that replaced the one before it deleted that one: not trimmed)
        merged = sum((_int(e.fields.get("saves")) or 1) - 1 for e in events if e.kind == "checkpoint")
        return max(1, added - len(events) - merged)
    return -1


def _fold(t: Timeline) -> None:
    """Events into steps; each delivery ends with what came next for its entry."""
    open_by_entry: dict[str, DeliveryStep] = {}
    for e in t.events:
        f = e.fields
        if e.kind == "submitted":
            stream = f.get("stream", "")
            lane = _int(stream.rsplit(":", 1)[-1]) if ":lane:" in stream else None
            reply = f.get("reply") or ""
            producer = reply.split(":reply:", 1)[1] if ":reply:" in reply else None
            t.submitted = Submitted(at=e.at, entry=f.get("entry", ""), stream=stream, lane=lane, producer=producer,
                                    priority="high" if stream.endswith(":high") else "normal")
        elif e.kind == "delivered":
            entry = f.get("entry", "")
            d = DeliveryStep(at=e.at, worker=f.get("worker", "?"), entry=entry, n=_int(f.get("n")) or 1,
                             how=f.get("how", "read"), previous=f.get("from"), why=f.get("why"))
            before = open_by_entry.get(entry)
            if before is not None and before.ended == REASON_UNKNOWN:
                why = d.why or ""
                before.ended = (REASON_WORKER_DIED if "died" in why else REASON_HANDED_BACK
                                if why.startswith("handed back") else why or REASON_LEASE_LOST)
                before.ended_at = e.at
            t.deliveries.append(d)
            open_by_entry[entry] = d
        elif e.kind == "checkpoint":
            t.checkpoints.append(CheckpointStep(at=e.at, worker=f.get("worker", "?"), entry=f.get("entry", ""),
                                                tokens=_int(f.get("tokens")) or 0, saves=_int(f.get("saves")) or 1))
        elif e.kind in ("finished", "fenced", "dead"):
            entry = f.get("entry", "")
            d = open_by_entry.get(entry)
            if e.kind == "finished":
                try:
                    summary = msgspec.json.decode(f.get("summary") or "{}")
                except msgspec.DecodeError:
                    summary = {}
                summary = summary if isinstance(summary, dict) else {}
                wv = summary.get("weight_version")
                t.records.append(RecordStep(
                    at=e.at, worker=f.get("worker", "?"), entry=entry, status=f.get("status", "?"),
                    reply=f.get("reply", ""), result_entry=f.get("rec", ""), tokens=summary.get("tokens"),
                    engine_ms=summary.get("engine_ms"), queue_ms=summary.get("queue_ms"),
                    weight_version=None if wv is None else str(wv), attempt=summary.get("attempt"),
                    error=summary.get("error")))
                reason = REASON_FINISHED
            elif e.kind == "fenced":
                reason = REASON_LEASE_LOST
            else:
                t.dead_letters.append(DeadStep(at=e.at, entry=entry, source=f.get("source", ""),
                                               reason=f.get("reason", ""), deliveries=_int(f.get("deliveries")),
                                               by=f.get("by")))
                reason = REASON_DEAD
            if d is not None and d.ended == REASON_UNKNOWN and (e.kind != "fenced" or d.worker == f.get("worker")):
                d.ended, d.ended_at = reason, e.at
        elif e.kind == "applied":
            t.applied.append(AppliedStep(at=e.at, group=f.get("group", "?"), consumer=f.get("consumer", "?")))


async def _live(r: Redis, part: Keys, t: Timeline, rid_value: Any, partial_head: Any) -> None:
    if isinstance(rid_value, (bytes, str)):
        token_entry = text(rid_value).split(" ", 1)
        if len(token_entry) == 2:
            t.now.queued_entry = token_entry[1]
    if isinstance(partial_head, (bytes, str)) and len(partial_head) == 64:
        t.now.checkpoint_tokens = _int(text(partial_head)[45:63])
    entry = t.now.queued_entry
    if entry is None:
        return
    streams = [t.submitted.stream] if t.submitted else []
    streams = [f"{part.tag}:{s}" for s in streams] or part.request_streams

    async with r.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xpending_range(stream, WORKERS_GROUP, min=entry, max=entry, count=1)
        pending = await pipe.execute(raise_on_error=False)
    for p in pending:
        if isinstance(p, list) and p:
            t.now.owner, t.now.deliveries = text(p[0]["consumer"]), int(p[0]["times_delivered"])
    for d in t.deliveries:
        if d.ended == REASON_UNKNOWN and d.entry == entry and d.worker == t.now.owner and d is t.deliveries[-1]:
            d.ended = REASON_RUNNING


async def _records_still_there(r: Redis, t: Timeline) -> None:
    if not t.records:
        return
    async with r.pipeline(transaction=False) as pipe:
        for rec in t.records:
            pipe.xrange(rec.reply, rec.result_entry, rec.result_entry, count=1)
        found = await pipe.execute(raise_on_error=False)
    for rec, got in zip(t.records, found):
        rec.in_redis = bool(got) if isinstance(got, list) else None


def _gaps(t: Timeline) -> None:
    gaps: list[str] = []
    if not t.log_found:
        gaps.append(f"no event log for {t.request_id!r} ({t.events_key}): it expired (event_log_ttl_s after its "
                    "last event), the request was never submitted to this pipeline, or the event log is off "
                    "(event_log)")
    elif t.events_trimmed:
        n = "some" if t.events_trimmed < 0 else str(t.events_trimmed)
        gaps.append(f"the oldest {n} event(s) were trimmed (the log keeps the last event_log_max_len)")
    elif t.submitted is None:
        gaps.append("no submit in the log (submitted while the event log was off)")
    for rec in t.records:
        if rec.in_redis is False:
            gaps.append(f"the record {rec.result_entry} is no longer in {rec.reply} (read and deleted, or "
                        "trimmed): what it said is the log's summary")
    for d in t.deliveries:
        if d.ended == REASON_UNKNOWN and t.log_found:
            gaps.append(f"how delivery {d.n} of {d.entry} to {d.worker} ended is not in the log")
    t.gaps = gaps


# ---------------------------------------------------------------- terminal


def _clock(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def timeline_rows(t: Timeline) -> list[tuple[float, str, str]]:
    """(when, step, what) in time order: the table ``redroll trace`` prints."""
    rows: list[tuple[float, str, str]] = []
    if t.submitted is not None:
        s = t.submitted
        who = f"by producer {s.producer}" if s.producer else "fire-and-forget (records to the results stream)"
        lane = f", lane {s.lane}" if s.lane is not None else ""
        rows.append((s.at, "submitted", f"entry {s.entry} on {s.stream}, {s.priority} priority{lane}, {who}"))
    for d in t.deliveries:
        took = f" from {d.previous}" if d.previous else ""
        why = f" ({d.why})" if d.why else ""
        rows.append((d.at, f"delivery {d.n}", f"{d.worker} ({d.how}{took}){why} -> {d.ended}"))
    for c in t.checkpoints:
        saves = f" ({c.saves} saves)" if c.saves > 1 else ""
        rows.append((c.at, "checkpoint", f"{c.worker} saved {c.tokens} tokens{saves}"))
    for rec in t.records:
        facts = [f"status {rec.status}", f"{rec.tokens} tokens" if rec.tokens is not None else None,
                 f"engine {rec.engine_ms} ms" if rec.engine_ms is not None else None,
                 f"queue {rec.queue_ms} ms" if rec.queue_ms is not None else None,
                 f"weights {rec.weight_version}" if rec.weight_version is not None else None,
                 f"error: {rec.error}" if rec.error else None]
        where = "" if rec.in_redis is None else " (still there)" if rec.in_redis else " (no longer there)"
        rows.append((rec.at, "record", f"{rec.worker}: " + ", ".join(x for x in facts if x)
                     + f"; {rec.result_entry} on {rec.reply}{where}"))
    for dl in t.dead_letters:
        rows.append((dl.at, "dead letter", f"from {dl.source} by {dl.by}: {dl.reason}"))
    for a in t.applied:
        rows.append((a.at, "applied", f"consumer group {a.group} ({a.consumer})"))
    rows.sort(key=lambda row: row[0])
    return rows


def render_timeline(t: Timeline) -> Any:
    """A rich renderable of the timeline (steps, what Redis holds now, and the gaps)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"request {t.request_id}", title_justify="left")
    table.add_column("time (UTC)")
    table.add_column("+s", justify="right")
    table.add_column("step")
    table.add_column("what")
    rows = timeline_rows(t)
    start = rows[0][0] if rows else 0.0
    for at, step, what in rows:
        table.add_row(_clock(at), f"{at - start:.3f}", step, what)
    now = t.now
    state = []
    if now.queued_entry:
        state.append(f"entry {now.queued_entry} "
                     + (f"in flight on {now.owner} (delivery {now.deliveries})" if now.owner else "queued"))
    if now.checkpoint_tokens is not None:
        state.append(f"checkpoint of {now.checkpoint_tokens} tokens")
    parts: list[Any] = [table]
    if state:
        parts.append(Text("now: " + "; ".join(state)))
    if t.log_found:
        ttl = f", expires in {t.ttl_s} s" if t.ttl_s is not None else ""
        parts.append(Text(f"event log {t.events_key}: {t.events_kept} events{ttl}", style="dim"))
    for gap in t.gaps:
        parts.append(Text("not in Redis: " + gap, style="yellow"))
    return Group(*parts)
