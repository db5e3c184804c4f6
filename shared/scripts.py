"""The project's Lua code (shared/lua/*.lua, one Redis function library: see functions.py), with
typed async wrappers that call it with FCALL.

Each function touches only keys of one hash tag, so it runs unchanged on Redis Cluster (claim.lua
reads several partitions' streams in one call on a single server only: on a cluster each claim
loop reads one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

import redis
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline

from redroll.shared import function_layouts as layouts
from redroll.shared.checkpoint_calls import CheckpointCalls
from redroll.shared.checkpoint_saves import CheckpointSave, checkpoint_outcomes, checkpoint_refused  # noqa: F401 (re-exported)
from redroll.shared.codec import encode_record
from redroll.shared.connection import large_argument
from redroll.shared.errors import RedrollError
from redroll.shared.events import EventLog, finish_args, record_summary, script_args
from redroll.shared.function_layouts import FunctionLayout
from redroll.shared.functions import (
    FunctionsMissingError,
    ensure_library,
    function_name,
    is_missing,
    load_library,
    whole_call_refusal,
)
from redroll.shared.keys import Keys, events_key, finish_marker_key, owner_key_for
from redroll.shared.refusals import StreamRefusedError
from redroll.shared.streams import text
from redroll.shared.types import CompletionRecord

FINISH_MARKER_TTL_MS = 300_000
"""How long a worker's finish marker (``Keys.finished``: the entries it finished lately) lives
after its last finish in that partition: 5 minutes, far beyond a retry of a finish whose reply was
lost (the worker retries at once, then for about 10 s of backoff)."""
FINISH_MARKER_CAP = 10_000
"""The most entries a finish marker keeps (the latest): it bounds the marker's memory (about
0.3 MB) and the one read of it that a call with an entry no longer owned makes. A retried finish is
recognised while fewer than this many later finishes of the same worker in the partition came
between its first run and the retry."""


OWNERSHIP_CHECKS = {
    3: "ownership check failed: the request_id is held by another entry (another submit holds it)",
    4: "ownership check failed: the producer whose reply stream this entry names did not submit it",
}
"""The finish's refusals of an entry that fails an ownership check (finish_many.lua), as the
reason its dead letter gives: nothing is published, the worker dead-letters it."""


class OwnershipError(RedrollError, ValueError):
    """A finish refused to publish an entry that failed an ownership check (:data:`OWNERSHIP_CHECKS`)."""


class DuplicateRequestError(RedrollError, RuntimeError):
    """A different submit already holds this request_id and it has not finished yet (or it was
    cancelled while queued and housekeeping has not released it yet)."""

    def __init__(self, request_id: str):
        super().__init__(
            f"request_id {request_id!r} is already queued or in flight (submitted by another caller), "
            "or was cancelled while queued and not yet released by housekeeping; "
            "pick a new request_id or wait for its record"
        )
        self.request_id = request_id


@dataclass(frozen=True)
class SubmitOutcome:
    entry_id: str
    retried: bool
    """True when the same token had already added this request (a retried submit)."""


@dataclass(frozen=True)
class DeadLetter:
    """What to write to the dead-letter stream for one pending entry."""

    stream: str
    entry_id: str
    reason: str
    source: str
    fields: Mapping[Any, Any]
    deliveries: int = 1
    delete_entry: bool = True
    reply_to: str | None = None
    error_record: CompletionRecord | None = None
    rid_key: str | None = None
    partial_key: str | None = None
    """The request's checkpoint key (with ``rid_key``): deleted when it names this entry."""
    reply_refused: str | None = None
    """Why the waiter's reply stream cannot take the error record (it refused the finished record):
    then none is sent, and the dead letter carries this as its ``reply_error`` field."""


@dataclass(frozen=True)
class DeadLetterOutcome:
    """What the dead-letter script did with one entry."""

    done: bool
    """Dead-lettered: the letter written, the entry acked (and deleted when asked)."""
    refused: str | None = None
    """The dead stream refused the letter: nothing was written, the entry stays pending."""
    reply_error: str | None = None
    """Dead-lettered, but the reply stream refused the error record (see the letter's reply_error)."""

    @property
    def fenced(self) -> bool:
        """The entry was no longer this consumer's: nothing was written."""
        return not self.done and self.refused is None

    @classmethod
    def from_reply(cls, reply: Sequence[Any]) -> "DeadLetterOutcome":
        code, message = int(reply[0]), _s(reply[1])
        if code == 1:
            return cls(done=True, reply_error=message or None)
        if code == -1:
            return cls(done=False, refused=message)
        return cls(done=False)


def refusal(reply: Any, key: str) -> StreamRefusedError | None:
    """A per-item script reply that is an error string (what ``key`` answered), as an exception."""
    if isinstance(reply, (bytes, str)):
        return StreamRefusedError(key, _s(reply))
    return None


def ownership_refusal(reply: Any) -> OwnershipError | None:
    """A finish item's reply that is an ownership check's refusal, as an exception."""
    if isinstance(reply, int) and reply in OWNERSHIP_CHECKS:
        return OwnershipError(OWNERSHIP_CHECKS[reply])
    return None


def raising_first_error(replies: list) -> list:
    """A pipeline's replies, executed with ``raise_on_error=False``, or its first error raised as it
    is (:class:`FunctionsMissingError` when the server lacks the function library). (redis-py's own
    raise writes the whole command into the message: for a call of 500 requests that formats
    hundreds of kilobytes of text, about 80 ms.)"""
    return call_replies(replies, [None] * len(replies))


def call_replies(replies: list, refusals: Sequence[Callable[[str], Any] | None]) -> list:
    """:func:`raising_first_error`, except that a function call refused as a whole for a reason
    each of its items would meet alone (out of memory, a read-only replica:
    :func:`~.functions.whole_call_refusal`) gets ``refusals[i](message)``, the per-item replies
    the call would have given, when ``refusals[i]`` is set."""
    out = list(replies)
    for i, reply in enumerate(replies):
        if not isinstance(reply, Exception):
            continue
        if is_missing(reply):
            raise FunctionsMissingError(str(reply)) from reply
        message = whole_call_refusal(reply)
        if message is None or refusals[i] is None:
            raise reply
        out[i] = refusals[i](message)
    return out


def submit_refused(stream: str, n: int) -> Callable[[str], list]:
    """The replies of a submit_many call of ``n`` items refused as a whole with a message."""
    return lambda message: [[3, f"{stream}: {message}"] for _ in range(n)]


def finish_refused(n: int) -> Callable[[str], list]:
    """The replies of a finish_many call of ``n`` items refused as a whole with a message."""
    return lambda message: [message] * n


def dead_letter_refused(message: str) -> list:
    """The reply of a dead_letter call refused as a whole: the dead stream refused the letter."""
    return [-1, message]


T = TypeVar("T")


async def with_library(client: Any, attempt: Callable[[], Awaitable[T]]) -> T:
    """The one gate every function call goes through: ``await attempt()`` (a call now, or a
    pipeline of calls whose replies :func:`call_replies` reads); when the server lacks the library
    (:class:`~.functions.FunctionsMissingError`: a fresh, flushed or failed-over server) it is
    loaded (:func:`~.functions.load_library`, when this user may: else
    :class:`~.functions.FunctionsNotLoadedError`) and ``attempt()`` runs once more."""
    try:
        return await attempt()
    except FunctionsMissingError:
        await load_library(client)
        return await attempt()


async def call_or_refused(call: Callable[[], Awaitable[Any]], scripts: "Scripts",
                          refused: Callable[[str], Any]) -> Any:
    """``await call()``, a function call queued on a pipeline elsewhere (a batcher), through
    :func:`with_library`; a call refused as a whole (out of memory, a read-only replica) returns
    ``refused(message)``."""
    async def attempt() -> Any:
        try:
            return await call()
        except redis.ResponseError as exc:
            if is_missing(exc):
                raise FunctionsMissingError(str(exc)) from exc
            message = whole_call_refusal(exc)
            if message is None:
                raise
            return refused(message)

    return await with_library(scripts.redis, attempt)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _run(script: str, keys: list, args: list, client: Any, refused: Callable[[str], Any] | None = None) -> Any:
    """Call function ``script`` now (returns an awaitable) or, on a pipeline, queue it (returns None:
    read the pipeline's replies with :func:`call_replies`).

    Called now, a missing library is loaded (when this user may: else
    :class:`~.functions.FunctionsNotLoadedError`) and the call made again, and a call refused as a
    whole (out of memory, a read-only replica) returns ``refused(message)`` when given.
    """
    name = function_name(script)
    if isinstance(client, (ClusterPipeline, Pipeline)):
        # (redis-py routes a cluster pipeline's raw command by the keys FCALL declares)
        client.execute_command("FCALL", name, len(keys), *keys, *args)
        return None
    return _call(client, name, keys, args, refused)


def _run_layout(layout: FunctionLayout, client: Any, refused: Callable[[str], Any] | None = None, *,
                keys: Mapping[str, Any], args: Mapping[str, Any], items: Sequence[Mapping[str, Any]] = ()) -> Any:
    """:func:`_run` of ``layout``'s function with its keys, args and items by name (:meth:`FunctionLayout.pack`)."""
    return _run(layout.name, *layout.pack(keys, args, items), client, refused)


async def _call(client: Any, name: str, keys: list, args: list, refused: Callable[[str], Any] | None) -> Any:
    async def attempt() -> Any:
        try:
            return await client.execute_command("FCALL", name, len(keys), *keys, *args)
        except redis.ResponseError as exc:
            if is_missing(exc):
                raise FunctionsMissingError(str(exc)) from exc
            message = whole_call_refusal(exc)
            if message is None or refused is None:
                raise
            return refused(message)

    return await with_library(client, attempt)


class Scripts(CheckpointCalls):
    """The library's functions, called on one client. ``…_in`` calls accept a pipeline as ``client`` to batch
    them (then the reply comes with the pipeline's); the others run now."""

    run_layout = staticmethod(_run_layout)
    """(how :class:`~.checkpoint_calls.CheckpointCalls` calls a function by its layout)"""

    def __init__(self, redis: Redis, events: EventLog | None = None):
        self.redis = redis
        self.events = events
        """The per-request event log the functions append to (None: off; see shared/events.py)."""

    # -- submit
    @staticmethod
    def submit_outcome(request_id: str, reply: Sequence[Any]) -> SubmitOutcome:
        """One item's ``[code, value]`` as an outcome; raises :class:`DuplicateRequestError` (another
        submit holds the id) or :class:`StreamRefusedError` (nothing was written: out of memory, a
        read-only replica, a key of another type)."""
        code, value = int(reply[0]), _s(reply[1])
        if code == 0:
            raise DuplicateRequestError(request_id)
        if code == 3:
            key, _, message = value.partition(": ")
            raise StreamRefusedError(key, message)
        return SubmitOutcome(entry_id=value, retried=(code == 2))

    async def submit(self, requests_key: str, rid_key: str, token: str, request_id: str, reply_to: str | None,
                     data: bytes, rid_ttl_s: int) -> SubmitOutcome:
        """Submit one request now (see :meth:`submit_many_in` and :meth:`submit_outcome`)."""
        (reply,) = await self.submit_many_in(self.redis, requests_key=requests_key, rid_ttl_s=rid_ttl_s,
                                             items=[(rid_key, token, request_id, reply_to, data)])
        return self.submit_outcome(request_id, reply)

    def submit_many_in(self, client: Any, *, requests_key: str, rid_ttl_s: int,
                       items: Sequence[tuple[Any, ...]]) -> Any:
        """De-duplicated submit of many requests to one stream in one script call.

        ``items``: (rid_key, token, request_id, reply_to, data[, affinity_key]). Result: one
        [code, value] per item (see :meth:`submit_outcome`). A request whose reply_to is a
        producer's reply stream is noted in that producer's ownership hash (``Keys.owner``).
        """
        packed = []
        for rid_key, token, request_id, reply_to, data, *rest in items:
            owner = owner_key_for(reply_to) if reply_to else None
            packed.append({"rid_key": rid_key, "own_key": owner or rid_key, "reply_key": reply_to if owner else rid_key,
                           "token": token, "rid": request_id, "reply_to": reply_to or "",
                           "ak": (rest[0] if rest else None) or "", "data": large_argument(data)})
        return _run_layout(layouts.SUBMIT_MANY, client, submit_refused(requests_key, len(items)),
                           keys={"stream": requests_key}, args={"ttl": rid_ttl_s}, items=packed)

    # -- finish
    async def finish(self, *, requests_key: str, reply_key: str, rid_key: str, group: str, consumer: str,
                     entry_id: str, record: CompletionRecord, reply_cap: int = 0,
                     partial_key: str | None = None) -> int:
        """The fenced finish of one entry now: 1 published, 2 published by an earlier call (see
        :meth:`finish_many_in`), 0 fenced; raises
        :class:`StreamRefusedError` when the reply stream refused the record (nothing written)."""
        (reply,) = await self.finish_many_in(self.redis, requests_key=requests_key, group=group, consumer=consumer,
                                             worker=record.worker or "",
                                             items=[(entry_id, reply_key, rid_key, record, reply_cap,
                                                     partial_key)])
        error = refusal(reply, reply_key) or ownership_refusal(reply)
        if error is not None:
            raise error
        return int(reply)

    def finish_many_in(self, client: Any, *, requests_key: str, group: str, consumer: str, worker: str,
                       items: Sequence[tuple[Any, ...]]) -> Any:
        """Fenced finish of many entries of one stream in one script call.

        ``items``: (entry_id, reply_key, rid_key, record, reply_cap, checkpoint_key or None[, summary]),
        the record a :class:`CompletionRecord` or its stream fields from ``encode_record`` (then the
        event log's summary of it, :func:`~redroll.shared.events.record_summary`, comes along). Result:
        per item 1 (published), 2 (published by an earlier call of this consumer: a retry whose
        first reply was lost; nothing is written again), 0 (fenced), 3 or 4 (an ownership check
        refused it: see :data:`OWNERSHIP_CHECKS`) or the error its reply stream answered (see
        :func:`refusal`). A resumable request's checkpoint (when it names this entry)
        is deleted with the finish. The entries published are noted in ``consumer``'s finish marker
        (``Keys.finished``) for :data:`FINISH_MARKER_TTL_MS`.
        """
        packed = []
        for entry_id, reply_key, rid_key, record, cap, *rest in items:
            partial_key = rest[0] if rest else None
            f = encode_record(record) if isinstance(record, CompletionRecord) else record
            if self.events is None:
                summary = ""
            elif isinstance(record, CompletionRecord):
                summary = record_summary(record)
            else:
                summary = rest[1] if len(rest) > 1 and rest[1] is not None else ""
            packed.append({"reply_key": reply_key, "rid_key": rid_key, "partial_key": partial_key or rid_key,
                           "own_key": owner_key_for(reply_key) or rid_key,
                           "events_key": events_key(requests_key, text(f["rid"])), "entry": entry_id,
                           "rid": f["rid"], "status": f["status"], "data": large_argument(f["data"]), "cap": cap,
                           "resumable": "1" if partial_key else "0", "summary": summary})
        ev_cap, ev_ttl = finish_args(self.events)
        return _run_layout(layouts.FINISH_MANY, client, finish_refused(len(items)),
                           keys={"stream": requests_key, "marker": finish_marker_key(requests_key, consumer)},
                           args={"group": group, "consumer": consumer, "worker": worker,
                                 "marker_ttl": FINISH_MARKER_TTL_MS, "marker_cap": FINISH_MARKER_CAP,
                                 "ev_cap": ev_cap, "ev_ttl": ev_ttl}, items=packed)

    async def load_all(self) -> None:
        """Make sure the server has the function library (at start, and after a call found it
        missing): loads it when this user may, else raises
        :class:`~.functions.FunctionsNotLoadedError` naming what an administrator runs."""
        await ensure_library(self.redis)

    # -- claim (plain layout)
    async def claim(self, *, streams: Sequence[str], group: str, consumer: str,
                    budget: int) -> tuple[list[tuple[str, list]], list[str]]:
        """Up to ``budget`` new entries of ``streams``, read in their order with the budget carried
        over (see claim.lua). Returns the (stream, entries) pairs that had entries, and one
        ``"<stream>: <error>"`` for each stream that refused the read."""
        reply = await _run_layout(layouts.CLAIM, self.redis, keys={"streams": streams},
                                  args={"group": group, "consumer": consumer, "budget": budget})
        got: list[tuple[str, list]] = []
        refused: list[str] = []
        for i in range(0, len(reply), 2):
            stream, value = _s(reply[i]), reply[i + 1]
            if isinstance(value, (bytes, str)):
                refused.append(f"{stream}: {_s(value)}")
            else:
                got.append((stream, value))
        return got, refused

    # -- claim (affinity lanes)
    async def claim_lanes(self, *, high: str, own: Sequence[str], shared: str, others: Sequence[str], group: str,
                          consumer: str, budget: int, steal_after_ms: int,
                          steal_depth: int = 0) -> list[tuple[str, str, list]]:
        """Up to ``budget`` new entries: high priority, own lanes, the shared stream, then entries
        overdue in the other lanes, or beyond their first ``steal_depth`` undelivered entries (see
        claim_lanes.lua). Returns (stream, kind, entries) triples."""
        reply = await _run_layout(layouts.CLAIM_LANES, self.redis,
                                  keys={"high": high, "own": own, "shared": shared, "others": others},
                                  args={"group": group, "consumer": consumer, "budget": budget,
                                        "steal_ms": steal_after_ms, "depth": steal_depth})
        return [(_s(reply[i]), _s(reply[i + 1]), reply[i + 2]) for i in range(0, len(reply), 3)]

    # -- dead letter
    def dead_letter_in(self, client: Any, *, dead_key: str, group: str, consumer: str, letter: DeadLetter) -> Any:
        """Queue or run the dead-letter script; its reply reads with :meth:`DeadLetterOutcome.from_reply`."""
        replying = bool(letter.reply_to) and letter.error_record is not None
        f = encode_record(letter.error_record) if replying else {"rid": "", "status": "", "worker": "", "data": ""}
        rid = letter.fields.get(b"rid", letter.fields.get("rid"))
        logged = rid is not None and self.events is not None
        ev_cap, ev_ttl = script_args(self.events if logged else None)
        keys = {"source": letter.stream, "dead": dead_key, "reply_key": letter.reply_to if replying else None,
                "own_key": owner_key_for(letter.reply_to) if replying else None, "rid_key": letter.rid_key or None,
                "partial_key": (letter.partial_key or None) if letter.rid_key else None,
                # (without a log: a key of the same slot; a cap of 0 writes nothing there)
                "events_key": events_key(letter.stream, text(rid)) if logged else dead_key}
        args = {"group": group, "consumer": consumer, "entry": letter.entry_id, "reason": letter.reason,
                "source_name": letter.source, "delete_entry": "1" if letter.delete_entry else "0",
                "rec_rid": f["rid"], "rec_status": f["status"], "rec_worker": f["worker"], "rec_data": f["data"],
                "deliveries": letter.deliveries, "reply_refused": letter.reply_refused or "",
                "ev_cap": ev_cap, "ev_ttl": ev_ttl}
        return _run_layout(layouts.DEAD_LETTER, client, dead_letter_refused, keys=keys, args=args,
                           items=[{"name": k, "value": v} for k, v in letter.fields.items()])

    async def dead_letter(self, *, dead_key: str, group: str, consumer: str, letter: DeadLetter) -> DeadLetterOutcome:
        reply = await self.dead_letter_in(self.redis, dead_key=dead_key, group=group, consumer=consumer,
                                          letter=letter)
        return DeadLetterOutcome.from_reply(reply)

    # -- cancel
    def cancel_queued_in(self, client: Any, *, stream: str, reply_key: str, group: str,
                         entry_id: str, record: CompletionRecord) -> Any:
        """Publish ``record`` and delete the entry, only if no worker has taken it (1) — else 0, or
        the error the reply stream answered (nothing written). The request_id's rid key stays until
        housekeeping releases it (:meth:`release_rids`): producers may not delete rid keys."""
        f = encode_record(record)
        return _run_layout(layouts.CANCEL_QUEUED, client, lambda message: message,
                           keys={"stream": stream, "reply_key": reply_key},
                           args={"group": group, "entry": entry_id, "rid": f["rid"], "status": f["status"],
                                 "data": f["data"]})

    # -- a producer's acks
    def ack_replies_in(self, client: Any, *, stream: str, group: str, entries: Sequence[tuple[str, str]]) -> Any:
        """Ack and delete ``entries`` ((entry id, request_id or '') of records applied) on reply
        stream ``stream``, and take the finished marks they leave out of its producer's ownership
        hash, in one call (see ``shared/lua/ack_replies.lua``). Returns the number acked."""
        owner = owner_key_for(stream) or stream
        return _run_layout(layouts.ACK_REPLIES, client, keys={"stream": stream, "own_key": owner}, args={"group": group},
                           items=[{"entry": entry, "rid": rid} for entry, rid in entries])

    # -- housekeeping
    async def release_rids(self, streams: Sequence[str], rid_keys: Sequence[str], *,
                           dry_run: bool = False) -> list[str]:
        """Delete those of ``rid_keys`` whose entry is in none of ``streams`` (the request streams of
        their partition), each checked and deleted atomically; returns the keys released (with
        ``dry_run``: that would be)."""
        if not rid_keys:
            return []
        reply = await _run_layout(layouts.RELEASE_RIDS, self.redis, keys={"streams": streams, "rid_keys": rid_keys},
                                  args={"dry_run": "1" if dry_run else "0"})
        return [key for key, released in zip(rid_keys, reply) if int(released)]

    # -- leases
    async def renew(self, stream: str, group: str, consumer: str, entry_ids: Sequence[str],
                    idle_ms: int = 0, marks: str | None = None) -> list[str]:
        """Renew (idle_ms=0) or hand back (idle_ms=claim_idle) owned entries; returns ids lost.
        ``marks``: a worker's hand-back marks (``Keys.reclaim_marks``: see reclaim_scan.lua)."""
        if not entry_ids:
            return []
        lost = await _run_layout(layouts.RENEW, self.redis, keys={"stream": stream, "marks": marks or None},
                                 args={"group": group, "consumer": consumer, "idle_ms": int(idle_ms),
                                       "entry_ids": entry_ids})
        return [_s(x) for x in lost]

    async def reclaim_scan(self, *, streams: Sequence[str], marks: str, group: str, min_idle_ms: int,
                           count: int) -> list[list | str]:
        """What a reclaim pass looks at in one partition's ``streams`` (see reclaim_scan.lua): per
        stream, ``[id, consumer, idle ms, deliveries]`` rows, or the stream's refusal (a string)."""
        reply = await _run_layout(layouts.RECLAIM_SCAN, self.redis, keys={"streams": streams, "marks": marks},
                                  args={"group": group, "min_idle_ms": int(min_idle_ms), "count": int(count)})
        return [_s(x) if isinstance(x, (bytes, str)) else x for x in reply]

    # -- heartbeat with affinity lanes
    async def lanes_beat(self, keys: Keys, name: str, beat: str, *, claiming: bool, room: bool, late_ms: int,
                         stale_ms: int, settle_ms: int, epoch: int | None
                         ) -> tuple[int, list[str], list[str], list[str] | None]:
        """Write ``name``'s heartbeat (``beat`` JSON; '' deletes it) and its entry in the lane table
        (see lanes_beat.lua). Returns the table's epoch, the members whose beat is late, the full
        ones (asked only with ``room``), and the published member list when ``epoch`` is not the
        current one."""
        reply = await _run_layout(layouts.LANES_BEAT, self.redis,
                                  keys={"workers_key": keys.workers, "members_key": keys.lane_members,
                                        "full_key": keys.lane_full, "config_key": keys.config,
                                        "plan_key": keys.lane_plan},
                                  args={"name": name, "beat": beat, "claiming": int(claiming), "room": int(room),
                                        "late_ms": int(late_ms), "stale_ms": int(stale_ms),
                                        "known_epoch": -1 if epoch is None else int(epoch),
                                        "settle_ms": int(settle_ms)})
        current, late, full, plan = reply
        members = None if plan is None else [n for n in _s(plan).split("\n") if n]
        return int(current), [_s(x) for x in late], [_s(x) for x in full], members

    # -- housekeeping
    async def delete_consumer_if_empty(self, stream: str, group: str, consumer: str) -> int:
        """Delete ``consumer`` of ``group`` only if it holds no pending entry (checked atomically):
        -1 when it was kept, else what XGROUP DELCONSUMER answered."""
        return int(await _run_layout(layouts.DELETE_CONSUMER_IF_EMPTY, self.redis, keys={"stream": stream},
                                     args={"group": group, "consumer": consumer}))
