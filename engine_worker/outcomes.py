"""How an entry leaves the worker: a fenced finish, a dead letter, or a hand-back to the fleet.

Every record is published by the fenced finish script, so a worker that lost its lease
(paused, cut off, reclaimed by another) cannot publish.

When Redis refuses a write (the scripts report it per item and write nothing of that item):
* a producer's private reply stream that cannot take entries (exhausted ids, a key of another
  type) costs only its own request: it is dead-lettered once, the letter naming the stream and
  the error (the producer learns of it from the letter's ``reply_error`` field);
* anything else — ``{ns}:results`` or ``{ns}:dead`` broken, out of memory, a read-only replica —
  blocks the pipeline, not one request: the worker stops claiming, keeps the output and its lease,
  and retries with backoff until the write is accepted (loudly: log, heartbeat, metric). When
  the stream works again it publishes and claims again, without an operator.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Awaitable, Callable, TypeVar

import redis

from redroll.engine_worker.checkpoints import is_resumed
from redroll.engine_worker.context import WorkerContext
from redroll.engine_worker.flights import DEATHS_SUFFIX, Flights, InFlight
from redroll.engine_worker.publisher import Finish
from redroll.observability.tracing import end_span
from redroll.shared.codec import ValidationError
from redroll.shared.keys import WORKERS_GROUP, owner_key_for, submitted_as
from redroll.shared.refusals import StreamRefusedError
from redroll.shared.scripts import DeadLetter, DeadLetterOutcome, OwnershipError, call_or_refused, dead_letter_refused
from redroll.shared.streams import text
from redroll.shared.types import CompletionRecord, GenerationRequest, RecordStatus

log = logging.getLogger("redroll.worker")

T = TypeVar("T")

PUBLISH_HOLD = "publish"
"""The claiming hold while Redis refuses this worker's records or dead letters."""

_TRANSPORT_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class Outcomes:
    def __init__(self, ctx: WorkerContext, flights: Flights):
        self.ctx = ctx
        self.flights = flights
        self._refusing: dict[InFlight, StreamRefusedError] = {}
        """Entries whose record or dead letter Redis refuses, and what it answered last."""
        self.retry_max_s = 2.0
        self._results_cap = max(0, ctx.settings.results_max_len)
        """The results stream's MAXLEN safety cap (0 or less in the settings: none)."""

    @property
    def blocked(self) -> dict[str, str]:
        """Streams refusing this worker's writes now → what they answered."""
        return {exc.key: exc.message for exc in self._refusing.values()}

    # ------------------------------------------------------------ finish

    def _publication(self, flight: InFlight, request: GenerationRequest, record: CompletionRecord) -> Finish:
        part = self.ctx.part_of[flight.stream]
        reply_key = request.reply_to or part.results
        flight.publishing = True
        return Finish(stream=flight.stream, entry_id=flight.entry_id, reply_key=reply_key,
                      rid_key=part.rid(request.request_id), record=record,
                      cap=self._results_cap if reply_key == part.results else 0,
                      partial_key=part.partial(request.request_id)
                      if flight.checkpointed or is_resumed(request) else None,
                      incidents=(flight.taken_back or flight.uncounted_runs > 0 or flight.checkpointed
                                 or request.requeued > 0 or is_resumed(request)))

    async def finish(self, flight: InFlight, request: GenerationRequest, record: CompletionRecord) -> None:
        publication = self._publication(flight, request, record)
        try:
            published = await self._write(flight, lambda: self.ctx.publisher.finish(publication))
        except StreamRefusedError as exc:  # a private reply stream that cannot take entries
            reason = f"reply stream {exc.key} refused the record: {exc.message}"
            await self.dead_letter(flight, flight.fields, reason, request=request, reply_refused=reason)
            return
        except OwnershipError as exc:  # nothing published; no error record either: it is not its waiter's
            await self.dead_letter(flight, flight.fields, str(exc))
            return
        if published is None:
            return  # handed back (a drain) while Redis refused it: the fleet runs it again
        await self._settled(flight, request, record, published)

    def finish_many(self, items: list[tuple[InFlight, GenerationRequest, CompletionRecord]]
                    ) -> Awaitable[list[tuple[InFlight, Exception]]]:
        """Queue the finishes of many entries at once, in one publisher call (one future for them
        all); awaiting what this returns settles them. Those the call did not settle (a refusal, a
        lost connection) go through :meth:`finish` each, with its retries, holds and dead letters.
        It gives the entries whose finish still failed, and why."""
        published = self.ctx.publisher.finish_many(
            [self._publication(flight, request, record) for flight, request, record in items])
        return self._settle_many(items, published)

    async def _settle_many(self, items: list[tuple[InFlight, GenerationRequest, CompletionRecord]],
                           published: Awaitable[list]) -> list[tuple[InFlight, Exception]]:
        try:
            outcomes: list = await published
        except Exception:
            outcomes = [None] * len(items)
        again = []
        for item, outcome in zip(items, outcomes):
            if type(outcome) is bool:
                await self._settled(*item, outcome)
            else:
                again.append(item)
        if not again:
            return []
        results = await asyncio.gather(*(self.finish(*item) for item in again), return_exceptions=True)
        return [(item[0], exc) for item, exc in zip(again, results) if isinstance(exc, Exception)]

    async def _settled(self, flight: InFlight, request: GenerationRequest, record: CompletionRecord,
                       published: bool) -> None:
        ctx = self.ctx
        stats = ctx.stats
        if flight.span is not None:
            end_span(flight.span, published=published)
            flight.span = None
        if published:
            stats.published += 1
            stats.by_status[record.status.value] = stats.by_status.get(record.status.value, 0) + 1
            if ctx.metrics is not None:
                ctx.metrics.observe(record.meta_info.get("queue_ms"), record.meta_info.get("engine_ms"))
            if flight.taken_back:
                await ctx.redis.hdel(ctx.keys.errors, *notes_of(flight))
            if log.isEnabledFor(logging.DEBUG):
                log.debug("request %s %s", request.request_id, record.status.value, extra=flight.context())
        else:
            stats.fenced += 1
            log.warning("request %s: lease lost (entry %s now owned elsewhere); output dropped",
                        request.request_id, flight.entry_id, extra=flight.context())

    # ------------------------------------------------------------ dead letters

    async def dead_letter(self, flight: InFlight, fields: dict, reason: str, *,
                          error: ValidationError | None = None, request: GenerationRequest | None = None,
                          reply_refused: str | None = None) -> None:
        ctx = self.ctx
        part = ctx.part_of[flight.stream]
        request_id = request.request_id if request else (error.request_id if error else None)
        reply_to = request.reply_to if request else (error.reply_to if error else None)
        if request_id is not None and reply_to is None:
            reply_to = part.results
        if reply_to is not None and not part.is_reply_key(reply_to):
            reply_to = None  # never write outside the pipeline's own streams
        record = None
        if request_id is not None and reply_to is not None and reply_refused is None:
            record = CompletionRecord.failed(request, request_id=request_id, status=RecordStatus.ERROR,
                                             error=reason, worker=ctx.name,
                                             n=request.n if request else 1,
                                             meta_info={"worker": ctx.name, "attempt": flight.attempt})
            if request is None and error is not None:
                record.callback = error.callback  # (routed to the handler the request named)
        owner = owner_key_for(reply_to) if record is not None and reply_to else None
        if record is not None and not await self._bound(part.rid(request_id), owner, request_id,
                                                              submitted_as(flight.stream, flight.entry_id)):
            record = None  # (an entry that fails the ownership checks gets no error record: see finish_many.lua)
        flight.publishing = True
        letter = DeadLetter(stream=flight.stream, entry_id=flight.entry_id, reason=reason, source="worker",
                            fields=fields, deliveries=flight.deliveries, delete_entry=True,
                            reply_to=reply_to if record else None, error_record=record,
                            rid_key=part.rid(request_id) if request_id else None,
                            partial_key=part.partial(request_id) if request_id else None, reply_refused=reply_refused)

        async def attempt() -> DeadLetterOutcome:
            reply = await call_or_refused(lambda: ctx.batcher.call(lambda pipe: ctx.scripts.dead_letter_in(
                pipe, dead_key=part.dead, group=WORKERS_GROUP, consumer=ctx.name, letter=letter)), ctx.scripts,
                dead_letter_refused)
            outcome = DeadLetterOutcome.from_reply(reply)
            if outcome.refused is not None:
                raise StreamRefusedError(part.dead, outcome.refused)
            return outcome

        outcome = await self._write(flight, attempt)
        if outcome is None:
            return
        if outcome.done:
            ctx.stats.dead_lettered += 1
            if owner is not None and record is not None:
                await ctx.redis.hdel(owner, request_id)  # (it named this entry: checked above)
            if flight.taken_back:
                await ctx.redis.hdel(ctx.keys.errors, *notes_of(flight))
            log.warning("request %s (entry %s) dead-lettered: %s", request_id or "?", flight.entry_id, reason,
                        extra={"request_id": request_id, "entry_id": flight.entry_id})
            if outcome.reply_error and reply_refused is None:
                log.warning("request %s: its error record was refused (%s); the dead letter names its reply "
                            "stream, which is how its waiter learns of it", request_id, outcome.reply_error)
        else:
            ctx.stats.fenced += 1

    async def _bound(self, rid_key: str, owner: str | None, request_id: str, entry: str) -> bool:
        """The ownership checks of finish_many.lua, for an error record: the rid key names this
        entry (``entry``: its stream and id, :func:`submitted_as`) or is gone, and the producer whose
        reply stream it goes to submitted it."""
        async with self.ctx.redis.pipeline(transaction=False) as pipe:
            pipe.get(rid_key)
            if owner is not None:
                pipe.hget(owner, request_id)
            found = await pipe.execute(raise_on_error=False)
        held = found[0].decode() if isinstance(found[0], bytes) else None  # (another type: not a holder)
        if held is not None and not held.endswith(" " + entry):
            return False
        return owner is None or (isinstance(found[1], bytes) and found[1].decode() == entry)

    # ------------------------------------------------------------ refused writes

    async def _write(self, flight: InFlight, attempt: Callable[[], Awaitable[T]]) -> T | None:
        """``attempt()`` until Redis accepts it. Short outages are retried; a refusal (see the module
        docstring) blocks claiming and is retried with backoff while the entry is still this
        worker's. Returns None when the entry was handed back meanwhile (a drain). Raises the
        refusal of a private reply stream that cannot take entries (the caller dead-letters)."""
        try:
            return await self.retrying(attempt)
        except StreamRefusedError as exc:
            refused = exc
        part = self.ctx.part_of[flight.stream]
        if _only_this_request(refused, part.reply_prefix):
            raise refused
        self._note(flight, refused)
        delay = 0.25
        try:
            while not flight.handed_back:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
                try:
                    return await attempt()
                except StreamRefusedError as exc:
                    if _only_this_request(exc, part.reply_prefix):
                        raise
                    self._note(flight, exc)
                except _TRANSPORT_ERRORS:
                    pass
            return None
        finally:
            self._forget(flight)

    def _note(self, flight: InFlight, exc: StreamRefusedError) -> None:
        before = self.blocked
        self._refusing[flight] = exc
        kinds = self.ctx.stats.refusals
        kinds[exc.kind] = kinds.get(exc.kind, 0) + 1
        if before.get(exc.key) != exc.message:
            log.error("%s refuses writes (%s): claiming paused, %d record(s) held and retried until it "
                      "accepts them (see redroll status; a stream whose ids are exhausted needs redroll repair)",
                      exc.key, exc.message, len(self._refusing))
        self.flights.hold(PUBLISH_HOLD)

    def _forget(self, flight: InFlight) -> None:
        exc = self._refusing.pop(flight, None)
        if exc is not None and exc.key not in self.blocked:
            log.info("%s accepts writes again", exc.key)
        if not self._refusing:
            self.flights.release(PUBLISH_HOLD)

    # ------------------------------------------------------------ errors, hand-backs

    async def record_error(self, flight: InFlight, error: str) -> None:
        """Keep the last engine error of an entry where whichever worker dead-letters it can read it."""
        try:
            await self.ctx.redis.hset(self.ctx.keys.errors, flight.key, error)
        except redis.RedisError as exc:
            log.warning("could not record the error of %s: %s", flight.entry_id, exc)

    async def last_error(self, flight: InFlight) -> str | None:
        last = await self.ctx.redis.hget(self.ctx.keys.errors, flight.key)
        return text(last) if last is not None else None

    async def hand_back(self, flight: InFlight) -> None:
        """Give an entry back to the fleet now (owner-checked; the delivery count is not raised)."""
        ctx = self.ctx
        flight.handed_back = True  # (no lease renewal of it from now on)
        try:
            lost = await ctx.scripts.renew(flight.stream, WORKERS_GROUP, ctx.name, [flight.entry_id],
                                           idle_ms=ctx.settings.claim_idle_ms,
                                           marks=ctx.part_of[flight.stream].reclaim_marks)
            if not lost:
                ctx.stats.handed_back += 1
        except redis.RedisError as exc:
            log.warning("hand-back of %s failed (%s); it will be reclaimed after claim_idle", flight.entry_id, exc)

    async def hand_back_all(self, flights: list[InFlight], note: str | list[str]) -> int:
        """Give many entries back at once, each marked as handed back on purpose (``note``, or one
        note per flight), so whoever takes them does not treat them as suspects of killing a worker."""
        return await hand_back_entries(self.ctx, [(f.stream, f.entry_id) for f in flights], note)

    @staticmethod
    async def retrying(call: Callable[[], Awaitable[T]], attempts: int = 8) -> T:
        """Retry a Redis call through short outages while the lease is still ours."""
        delay = 0.1
        for i in range(attempts):
            try:
                return await call()
            except _TRANSPORT_ERRORS:
                if i == attempts - 1:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")


def notes_of(flight: InFlight) -> list[str]:
    """The fields of ``{ns}:errors`` about ``flight``: its last error or hand-back note, and for
    one taken back from a worker that died its death note (see ``Claimer._reclaim_halving``)."""
    return [flight.key, flight.key + DEATHS_SUFFIX] if flight.reclaimed else [flight.key]


def _only_this_request(exc: StreamRefusedError, reply_prefix: str) -> bool:
    """A refusal that only concerns the request it is about: a producer's private reply stream that
    cannot take entries. Everything else (the shared streams, memory, a replica) concerns them all."""
    return exc.key.startswith(reply_prefix) and not exc.transient


NOTICE_NOTE = re.compile(r"\(notice[^)]*, uncounted=(\d+)\)$")
"""A hand-back on notice (a worker told to stop): the taker keeps the entry's delivery count (a
notice is no failure of the request: a request preempted many times is never dead-lettered for
it), and the note says how many runs that count leaves out (the records' ``attempt`` adds them)."""


def notice_note(worker: str, why: str, uncounted: int) -> str:
    """The note of an entry ``worker`` hands back on notice (see :data:`NOTICE_NOTE`)."""
    return f"handed back by {worker} (notice{', ' + why if why != 'notice' else ''}, uncounted={uncounted})"


def uncounted_runs(note: str) -> int | None:
    """The runs a hand-back on notice left out of the delivery count; None for any other note."""
    found = NOTICE_NOTE.search(note)
    return int(found.group(1)) if found else None


async def hand_back_entries(ctx: WorkerContext, entries: list[tuple[str, str]], note: str | list[str]) -> int:
    """Give (stream, entry id) pairs back to the fleet at once (owner-checked; their delivery
    counts stay), each marked as handed back on purpose (``note``, or one note per entry) so whoever
    takes them does not treat them as suspects of killing a worker; returns how many were still
    ours to hand back."""
    if not entries:
        return 0
    notes = [note] * len(entries) if isinstance(note, str) else note
    try:
        await ctx.redis.hset(ctx.keys.errors, mapping={ctx.flight_key(s, i): n for (s, i), n in zip(entries, notes)})
    except redis.ResponseError as exc:  # (out of memory: they are handed back all the same)
        log.warning("could not mark %d hand-back(s): %s", len(entries), exc)
    handed = 0
    for stream in dict.fromkeys(s for s, _ in entries):
        ids = [i for s, i in entries if s == stream]
        lost = await ctx.scripts.renew(stream, WORKERS_GROUP, ctx.name, ids, idle_ms=ctx.settings.claim_idle_ms,
                                       marks=ctx.part_of[stream].reclaim_marks)
        handed += len(ids) - len(lost)
        if lost:  # (finished meanwhile, or reclaimed: no finish of ours follows to delete their notes)
            try:
                await ctx.redis.hdel(ctx.keys.errors, *(ctx.flight_key(stream, i) for i in lost))
            except redis.RedisError as exc:
                log.warning("could not delete %d hand-back note(s): %s", len(lost), exc)
    ctx.stats.handed_back += handed
    return handed
