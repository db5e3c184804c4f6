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

from redroll.shared.checkpoint_reads import load_checkpoint
from redroll.shared.events import parse_line, parse_summary
from redroll.shared.keys import WORKERS_GROUP, Keys, stream_name
from redroll.shared.streams import text

REASON_FINISHED = "finished"
REASON_LEASE_LOST = "lease lost"
REASON_HANDED_BACK = "handed back"
REASON_WORKER_DIED = "worker died"
REASON_DEAD = "dead-lettered"
REASON_RUNNING = "still in flight"
REASON_UNKNOWN = "not in the log"


class Event(msgspec.Struct, kw_only=True):
    """One event of the log, as it is."""

    at: Optional[float]
    """Unix seconds."""
    kind: str
    fields: dict[str, Any]


class Step(msgspec.Struct, kw_only=True):
    """A step of the request's life on one of its entries."""

    at: float
    """When it happened (Unix seconds)."""
    entry: str
    """The request entry it happened to."""


class Submitted(Step, kw_only=True):
    """The request's submit, as its entry in the request stream tells it (``at``: its id's time).

    Attributes:
        stream: the request stream it was queued on.
        priority: ``high`` or ``normal``.
        lane: the affinity lane it was queued on (None: the shared or high-priority stream).
        producer: the producer whose reply stream waits for the record (None: the record goes to
            the results stream).
    """

    stream: str
    priority: str
    lane: Optional[int] = None
    producer: Optional[str] = None


class GroupStep(msgspec.Struct, kw_only=True):
    """A consumer group of the stream the record went to, and whether it applied the record."""

    group: str
    stream: str
    applied: Optional[bool]
    """True: applied; False: not (yet); None: no longer known (its de-duplication window passed)."""


class DeliveryStep(msgspec.Struct, kw_only=True):
    """One delivery of the request's entry to a worker, and how it ended."""

    worker: str
    """The worker it was delivered to."""
    entry: str
    """The request entry delivered."""
    at: Optional[float] = None
    """When it was delivered: known for reclaims (logged); a first delivery is not logged."""
    n: int
    """The entry's delivery count with this delivery."""
    previous: Optional[str] = None
    """A reclaimed entry's previous owner."""
    why: Optional[str] = None
    """Why a reclaimed entry was taken back."""
    ended: str = REASON_UNKNOWN
    """finished, lease lost, handed back, worker died, dead-lettered, still in flight, or not in the log."""
    ended_at: Optional[float] = None
    """When it ended, when the log says."""


class CheckpointStep(Step, kw_only=True):
    """A run of checkpoints one delivery saved (the log keeps the last of a run, with its count;
    ``at``: when the last of them was saved)."""

    worker: str
    tokens: int
    """Tokens saved by the last of them."""
    saves: int = 1


class RecordStep(Step, kw_only=True):
    """The request's record: the finish that published it (``at``), of its ``entry``."""

    worker: str
    """The worker whose finish published it."""
    status: str
    """finished, aborted, expired or error."""
    reply: str
    """The stream the record went to."""
    result_entry: str
    """The record's entry id in ``reply``."""
    tokens: Optional[int] = None
    """Output tokens, all samples."""
    engine_ms: Optional[float] = None
    """Time in the engine (the record's ``meta_info.engine_ms``)."""
    queue_ms: Optional[float] = None
    """Time from the submit to the claim (``meta_info.queue_ms``)."""
    weight_version: Optional[str] = None
    attempt: Optional[int] = None
    """Which delivery of the entry made it (1: the first)."""
    requeued: int = 0
    """How often ``redroll dead requeue`` had given it another attempt."""
    error: Optional[str] = None
    in_redis: Optional[bool] = None
    """Whether the record itself is still in ``reply`` (consumers delete or trim what they read)."""


class DeadStep(Step, kw_only=True):
    """The request's entry (or its record, for a consumer group) dead-lettered, at ``at``."""

    source: str
    """Who dead-lettered it: worker, producer or consumer:<group>."""
    reason: str
    """Why, naming the field and rule, or the deliveries and the last error."""
    deliveries: Optional[int] = None
    by: Optional[str] = None
    """The process that wrote the letter."""


class Now(msgspec.Struct, kw_only=True):
    """What Redis holds of the request at the moment of the trace."""

    queued_entry: Optional[str] = None
    """The entry its submit de-duplication key names (queued or in flight; gone once it finished)."""
    owner: Optional[str] = None
    """The worker that holds that entry now (None: not delivered yet, or no longer pending)."""
    deliveries: Optional[int] = None
    checkpoint_tokens: Optional[int] = None
    """Tokens in its checkpoint (a resumable request, until its finish deletes it)."""


class Timeline(msgspec.Struct, kw_only=True):
    """The life of one request, in order: what ``redroll trace`` prints and the dashboard shows."""

    request_id: str
    events_key: str
    """Its event log's key."""
    log_found: bool
    """Whether the event log was there (a request with no incident has none under ``incidents``)."""
    events_kept: int = 0
    events_trimmed: int = 0
    """Events the log's cap (``event_log_max_bytes``) dropped, oldest first."""
    ttl_s: Optional[int] = None
    """Seconds until the log expires."""
    submitted: Optional[Submitted] = None
    deliveries: list[DeliveryStep] = []
    checkpoints: list[CheckpointStep] = []
    records: list[RecordStep] = []
    dead_letters: list[DeadStep] = []
    groups: list[GroupStep] = []
    now: Now = msgspec.field(default_factory=Now)
    gaps: list[str] = []
    """What Redis no longer holds (and so the timeline cannot show)."""
    events: list[Event] = []

    def to_builtins(self) -> dict[str, Any]:
        """A JSON-able dict (the dashboard's and ``--json``'s form)."""
        return msgspec.to_builtins(self)

    @property
    def applied_by(self) -> list[str]:
        """The consumer groups that applied the record."""
        return [g.group for g in self.groups if g.applied]


def _at(entry_id: str) -> float:
    return int(entry_id.split("-", 1)[0]) / 1000.0


def _int(value: Any) -> Optional[int]:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _float(value: Any) -> Optional[float]:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _s(value: Any) -> str:
    return text(value) if value is not None else ""


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


def _decode(line: str) -> Event:
    at, kind, fields = parse_line(line)
    return Event(at=at, kind=kind, fields=dict(fields))


async def request_timeline(r: Redis, keys: Keys | Sequence[Keys], request_id: str, *,
                           dedup_window_s: int = 3600) -> Timeline:
    """The life of ``request_id`` as far as Redis still knows it. ``keys``: the pipeline's
    partitions (``Settings.partition_keys``), or one partition's keys; ``dedup_window_s``: the
    consumer groups' (``Settings.dedup_window_s``), to find which of them applied the record."""
    parts = [keys] if isinstance(keys, Keys) else list(keys)
    part = await _pick_partition(r, parts, request_id)
    key = part.events(request_id)
    async with r.pipeline(transaction=False) as pipe:
        pipe.get(key)
        pipe.ttl(key)
        pipe.get(part.rid(request_id))
        pipe.getrange(part.partial(request_id), 0, 63)
        raw, ttl, rid_value, partial_head = await pipe.execute(raise_on_error=False)
    if isinstance(raw, Exception):
        raise raw
    log = text(raw) if isinstance(raw, (bytes, str)) else ""
    events = [_decode(line) for line in log.split("\n") if line]
    t = Timeline(request_id=request_id, events_key=key, log_found=bool(events), events_kept=len(events),
                 ttl_s=ttl if isinstance(ttl, int) and ttl >= 0 else None, events=events)
    if events and events[0].kind == "trimmed":
        t.events_trimmed = _int(events[0].fields.get("n")) or 0
    await _live(r, part, t, rid_value, partial_head)
    _fold(t)
    await _after_finish(r, part, t, request_id, dedup_window_s)
    _gaps(t)
    return t


async def _live(r: Redis, part: Keys, t: Timeline, rid_value: Any, partial_head: Any) -> None:
    """The entry the rid key names (queued or in flight): where it is queued, by whom, and who holds it."""
    if isinstance(partial_head, (bytes, str)) and len(partial_head) == 64:
        # (the key's count, and the parts saved since its last consolidation: shared/checkpoint_reads.py)
        cp = await load_checkpoint(r, part, t.request_id)
        t.now.checkpoint_tokens = cp.tokens if cp is not None else _int(text(partial_head)[45:63])
    if not isinstance(rid_value, (bytes, str)) or " " not in text(rid_value):
        return
    entry = text(rid_value).rpartition(" ")[2]
    t.now.queued_entry = entry
    streams = part.request_streams
    async with r.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xrange(stream, entry, entry, count=1)
            pipe.xpending_range(stream, WORKERS_GROUP, min=entry, max=entry, count=1)
        found = await pipe.execute(raise_on_error=False)
    for stream, got, pending in zip(streams, found[0::2], found[1::2]):
        if isinstance(got, list) and got:
            fields = got[0][1]
            t.submitted = _submitted(entry, stream_name(stream), _s(fields.get(b"reply_to")) or None)
            if isinstance(pending, list) and pending:
                t.now.owner, t.now.deliveries = text(pending[0]["consumer"]), int(pending[0]["times_delivered"])


def _submitted(entry: str, stream: str, reply: Optional[str]) -> Submitted:
    lane = _int(stream.rsplit(":", 1)[-1]) if ":lane:" in stream else None
    producer = reply.split(":reply:", 1)[1] if reply and ":reply:" in reply else None
    return Submitted(at=_at(entry), entry=entry, stream=stream, lane=lane, producer=producer,
                     priority="high" if stream.endswith(":high") else "normal")


def _fold(t: Timeline) -> None:
    """Events into steps. Each entry's first delivery is found from what ended it (or who holds it
    now); each delivery ends with what came next for its entry."""
    by_entry: dict[str, DeliveryStep] = {}
    """The latest delivery of each entry."""

    def first_delivery(entry: str, worker: str) -> DeliveryStep:
        d = by_entry.get(entry)
        if d is None:
            d = by_entry[entry] = DeliveryStep(worker=worker, entry=entry, n=1)
            t.deliveries.append(d)
        return d

    def end(d: DeliveryStep, reason: str, at: Optional[float]) -> None:
        if d.ended == REASON_UNKNOWN:
            d.ended, d.ended_at = reason, at

    request_entries = set()
    for e in t.events:
        f = e.fields
        entry = _s(f.get("entry"))
        from_worker = e.kind == "dead" and _s(f.get("source")) == "worker"  # (else a record's dead letter)
        if e.kind in ("delivered", "checkpoint", "finished", "fenced") or from_worker:
            request_entries.add(entry)
            if t.submitted is None or (t.submitted.entry != entry and _at(entry) < t.submitted.at):
                t.submitted = _submitted(entry, _s(f.get("stream")), None)
        if e.kind == "delivered":
            before = first_delivery(entry, _s(f.get("from")) or "?")
            why = _s(f.get("why"))
            end(before, REASON_WORKER_DIED if "died" in why else REASON_HANDED_BACK if why.startswith("handed back")
                else why or REASON_LEASE_LOST, e.at)
            d = DeliveryStep(at=e.at, worker=_s(f.get("worker")), entry=entry, n=_int(f.get("n")) or before.n + 1,
                             previous=_s(f.get("from")) or None, why=why or None)
            t.deliveries.append(d)
            by_entry[entry] = d
        elif e.kind == "checkpoint":
            first_delivery(entry, _s(f.get("worker")))
            t.checkpoints.append(CheckpointStep(at=e.at or 0.0, worker=_s(f.get("worker")), entry=entry,
                                                tokens=_int(f.get("tokens")) or 0, saves=_int(f.get("saves")) or 1))
        elif e.kind == "finished":
            d = first_delivery(entry, _s(f.get("worker")))
            summary = parse_summary(_s(f.get("summary")))
            rec = RecordStep(at=e.at or 0.0, worker=_s(f.get("worker")), entry=entry, status=_s(f.get("status")),
                             reply=_s(f.get("reply")), result_entry=_s(f.get("rec")), tokens=_int(summary.get("tokens")),
                             engine_ms=_float(summary.get("engine_ms")), queue_ms=_float(summary.get("queue_ms")),
                             weight_version=summary.get("weight_version"), attempt=_int(summary.get("attempt")),
                             requeued=_int(summary.get("requeued")) or 0, error=summary.get("error"))
            t.records.append(rec)
            if t.submitted is not None and t.submitted.entry == entry:
                t.submitted.producer = t.submitted.producer or _submitted(entry, "", rec.reply).producer
            end(d, REASON_FINISHED, e.at)
        elif e.kind == "fenced":
            d = first_delivery(entry, _s(f.get("worker")))
            if d.worker == _s(f.get("worker")):
                end(d, REASON_LEASE_LOST, e.at)
        elif e.kind == "dead":
            t.dead_letters.append(DeadStep(at=e.at or 0.0, entry=entry, source=_s(f.get("source")),
                                           reason=_s(f.get("reason")), deliveries=_int(f.get("deliveries")),
                                           by=_s(f.get("by")) or None))
            if from_worker:
                end(by_entry.get(entry) or first_delivery(entry, _s(f.get("by"))), REASON_DEAD, e.at)
    # What runs now: the entry the rid key names, held by a worker.
    entry, owner = t.now.queued_entry, t.now.owner
    if entry is not None and owner is not None:
        d = by_entry.get(entry) or first_delivery(entry, owner)
        if d.worker == owner and d.ended == REASON_UNKNOWN:
            d.ended = REASON_RUNNING


async def _after_finish(r: Redis, part: Keys, t: Timeline, request_id: str, dedup_window_s: int) -> None:
    """Whether each record is still in its stream, and which consumer groups of that stream applied it."""
    if not t.records:
        return
    streams = sorted({rec.reply for rec in t.records if rec.reply and not rec.reply.startswith(part.reply_prefix)})
    async with r.pipeline(transaction=False) as pipe:
        for rec in t.records:
            pipe.xrange(rec.reply, rec.result_entry, rec.result_entry, count=1)
        for stream in streams:
            pipe.xinfo_groups(stream)
        found = await pipe.execute(raise_on_error=False)
    for rec, got in zip(t.records, found):
        rec.in_redis = bool(got) if isinstance(got, list) else None
    groups = []
    for stream, info in zip(streams, found[len(t.records):]):
        if isinstance(info, list):
            groups += [(stream, text(g["name"])) for g in info]
    if not groups:
        return
    buckets = [part.applied_buckets(group, dedup_window_s) for _, group in groups]
    last = t.records[-1]  # (what consumer groups de-duplicate on: CompletionRecord.dedup_id)
    dedup_id = request_id if not last.requeued else f"{request_id}#requeue{last.requeued}"
    async with r.pipeline(transaction=False) as pipe:
        for keys_ in buckets:
            for k in keys_:
                pipe.exists(k)
                pipe.sismember(k, dedup_id)
        found = await pipe.execute(raise_on_error=False)
    i = 0
    for (stream, group), keys_ in zip(groups, buckets):
        exists = member = False
        for _ in keys_:
            exists = exists or bool(found[i])
            member = member or bool(found[i + 1])
            i += 2
        t.groups.append(GroupStep(group=group, stream=stream, applied=True if member else False if exists else None))


def _gaps(t: Timeline) -> None:
    gaps: list[str] = []
    if not t.log_found and t.now.queued_entry is None:
        gaps.append(f"no event log for {t.request_id!r} ({t.events_key}) and no queued entry: it ran without an "
                    "incident (with event_log=incidents only a reclaim, a checkpoint, a lost lease or a dead "
                    "letter begins a log), the log expired (event_log_ttl_s after its last event), the event "
                    "log is off, or the request was never submitted to this pipeline")
    if t.events_trimmed:
        gaps.append(f"the oldest {t.events_trimmed} event(s) were trimmed (the log keeps the last event_log_max_bytes)")
    if t.submitted is None and (t.log_found or t.now.queued_entry):
        gaps.append("the submit: neither its entry nor an event naming it is left")
    for rec in t.records:
        if rec.in_redis is False:
            gaps.append(f"the record {rec.result_entry} is no longer in {rec.reply} (read and deleted, or "
                        "trimmed): what it said is the log's summary")
    for g in t.groups:
        if g.applied is None:
            gaps.append(f"whether consumer group {g.group} applied it: its de-duplication sets of that time "
                        "expired (dedup_window_s)")
    for d in t.deliveries:
        if d.ended == REASON_UNKNOWN:
            gaps.append(f"how delivery {d.n} of {d.entry} to {d.worker} ended")
    t.gaps = gaps


# ---------------------------------------------------------------- terminal


def _clock(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def timeline_rows(t: Timeline) -> list[tuple[Optional[float], str, str]]:
    """(when, step, what) in time order (a step whose time is not known goes right after the one
    before it): the table ``redroll trace`` prints."""
    rows: list[tuple[Optional[float], str, str]] = []
    if t.submitted is not None:
        s = t.submitted
        who = f"by producer {s.producer}" if s.producer else "records to the results stream"
        lane = f", lane {s.lane}" if s.lane is not None else ""
        rows.append((s.at, "submitted", f"entry {s.entry} on {s.stream}, {s.priority} priority{lane}, {who}"))
    for d in t.deliveries:
        took = f" (taken back from {d.previous}: {d.why})" if d.previous else ""
        rows.append((d.at, f"delivery {d.n}", f"{d.worker}{took} -> {d.ended}"))
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
    for g in t.groups:
        state = "applied" if g.applied else "not applied (yet)" if g.applied is False else "not known"
        rows.append((None, "consumer group", f"{g.group} on {g.stream}: {state}"))
    # Stable order by time; an unknown time keeps its place after the step before it.
    # (to the millisecond, as the log keeps time: steps in one millisecond keep their order)
    keyed, last = [], 0
    for i, row in enumerate(rows):
        last = int(row[0] * 1000) if row[0] is not None else last
        keyed.append((last, i, row))
    keyed.sort(key=lambda k: k[:2])
    return [row for _, _, row in keyed]


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
    start = next((at for at, _, _ in rows if at is not None), 0.0)
    for at, step, what in rows:
        table.add_row(_clock(at) if at is not None else "", f"{at - start:.3f}" if at is not None else "", step, what)
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
