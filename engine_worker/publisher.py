"""Coalesce the fenced finishes of concurrent requests: one ``finish_many`` script call per
request stream per round trip, sent as soon as the event loop gets to it (no added wait).

A script call carries at most ``max_call_bytes`` of records (at least one record), and a round
trip as many calls as its batch needs: Redis runs a script call whole, so one call with dozens of
large records (n × thousands of tokens with logprobs) would hold every other client of that server,
producers, consumers and the rest of the fleet, for as long as storing all of them takes (3–8 ms
a MB on this project's machine). Between calls, Redis serves the others."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from redroll.shared.batcher import Coalescer
from redroll.shared.codec import encode_record
from redroll.shared.connection.durability import Durability
from redroll.shared.connection.sentinel import leave_demoted_primary
from redroll.shared.events import record_summary
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.scripts import Scripts, call_replies, finish_refused, ownership_refusal, refusal, with_library
from redroll.shared.types import CompletionRecord

log = logging.getLogger("redroll.worker")


@dataclass
class Finish:
    """One fenced finish: publish ``record`` to ``reply_key`` if this worker still owns the entry."""

    stream: str
    entry_id: str
    reply_key: str
    rid_key: str
    record: CompletionRecord
    cap: int
    """The reply stream's MAXLEN cap (0: none)."""
    partial_key: str | None = None
    """A resumable request's checkpoint key (deleted with the finish)."""
    incidents: bool = True
    """Whether the request may have had an incident (taken back, delivered again, checkpointed,
    requeued): with only incidents logged, the finish looks for its event log only then."""


Outcome = bool | Exception
"""Of one finish: True published (by this call, or by an earlier one whose reply was lost: the
script finds the entry in this worker's finish marker), False fenced (the entry is no longer this
worker's and it did not finish it), the
:class:`redroll.shared.refusals.StreamRefusedError` of a reply stream that refused the record, or
the :class:`redroll.shared.scripts.OwnershipError` of an entry that failed an ownership check."""


@dataclass
class _Queued:
    finish: Finish
    encoded: dict
    """The record's stream fields (``encode_record``)."""
    outcome: Outcome = False
    summary: str | None = None
    """What the request's event log keeps of the record (None: the log is off)."""


class Publisher(Coalescer[list[_Queued]]):
    """Queued items are groups of finishes (one request's, or a whole batch's), each with one future."""

    def __init__(self, scripts: Scripts, worker: str, max_batch: int = 256,
                 max_call_bytes: int = 1 << 20, durability: Durability = Durability()):
        super().__init__(max_batch)
        self.durability = durability
        """What a flush waits for after its finishes (replicas: see redroll.shared.connection.durability)."""
        self.scripts = scripts
        """The function library, on the worker's Redis client (``scripts.redis``)."""
        self.worker = worker
        """The worker's name: its consumer in the workers group, and the owner its finishes check."""
        self.max_call_bytes = max_call_bytes
        self.flushes = 0
        self.found_published = 0
        """Finishes retried after a lost reply that found their record published by the first try."""

    async def finish(self, finish: Finish) -> bool:
        """Publish the record if this worker still owns the entry (True), else drop it (False).

        Raises :class:`redroll.shared.refusals.StreamRefusedError` when the reply stream refused
        the record: nothing of it was written, and the entry is still this worker's."""
        (outcome,) = await self.finish_many([finish])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def finish_many(self, finishes: list[Finish]) -> asyncio.Future:
        """Many finishes (a claimed batch's records), queued at once behind one future: it gets one
        :data:`Outcome` each, or what the round trip raised (a lost connection: none is settled)."""
        log = self.scripts.events
        every = log is not None and log.every_request
        return self._enqueue([_Queued(f, encode_record(f.record), summary=record_summary(f.record)
                                      if log is not None and (every or f.incidents) else None)
                              for f in finishes])

    def _calls(self, items: list[_Queued]) -> list[list[_Queued]]:
        """``items`` as script calls: one request stream each, at most ``max_batch`` and
        ``max_call_bytes`` of records each (at least one record)."""
        calls: list[list[_Queued]] = []
        open_call: dict[str, tuple[list[_Queued], int]] = {}
        for item in items:
            size = len(item.encoded["data"])
            call, used = open_call.get(item.finish.stream, (None, 0))
            if call is None or used + size > self.max_call_bytes or len(call) >= self.max_batch:
                call, used = [], 0
                calls.append(call)
            call.append(item)
            open_call[item.finish.stream] = (call, used + size)
        return calls

    async def _flush(self, batch: list[tuple[list[_Queued], asyncio.Future]]) -> None:
        calls = self._calls([item for group, _ in batch for item in group])
        try:
            replies = await self._execute(calls)
        except Exception as exc:  # connection lost, ...: every caller retries its own finish
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        self.flushes += 1
        await leave_demoted_primary(self.scripts.redis, [x.decode() if isinstance(x, bytes) else x
                                                 for reply in replies for x in reply if isinstance(x, (bytes, str))])
        for items, reply in zip(calls, replies):
            for item, outcome in zip(items, reply):
                # (a refusal of this item's reply stream, or 1 published / 2 published by an earlier
                # try whose reply was lost / 0 fenced)
                item.outcome = refusal(outcome, item.finish.reply_key) or ownership_refusal(outcome) \
                    or bool(int(outcome))
                if item.outcome is True and int(outcome) == 2:
                    self.found_published += 1
                    log.info("entry %s: a retried finish found its record published by the first try "
                             "(whose reply was lost)", item.finish.entry_id,
                             extra={"request_id": item.finish.record.request_id,
                                    "entry_id": item.finish.entry_id})
        for group, fut in batch:
            if not fut.done():
                fut.set_result([item.outcome for item in group])

    async def _execute(self, calls: list[list[_Queued]]) -> list:
        """All of ``calls`` in one round trip (Redis serves other clients between them)."""
        async def attempt() -> list:
            async with self.scripts.redis.pipeline(transaction=False) as pipe:
                for items in calls:
                    self.scripts.finish_many_in(pipe, requests_key=items[0].finish.stream, group=WORKERS_GROUP,
                                                consumer=self.worker, worker=self.worker,
                                                items=[(i.finish.entry_id, i.finish.reply_key, i.finish.rid_key,
                                                        i.encoded, i.finish.cap, i.finish.partial_key, i.summary)
                                                       for i in items])
                return call_replies(await self.durability.execute(pipe),
                                    [finish_refused(len(items)) for items in calls])

        return await with_library(self.scripts.redis, attempt)
