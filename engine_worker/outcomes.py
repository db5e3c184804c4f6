"""How an entry leaves the worker: a fenced finish, a dead letter, or a hand-back to the fleet.

Every record is published by the fenced finish script, so a worker that lost its lease
(paused, cut off, reclaimed by another) cannot publish.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis

from redroll.shared.codec import ValidationError
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.scripts import DeadLetter
from redroll.shared.streams import text
from redroll.shared.types import CompletionRecord, GenerationRequest, RecordStatus

from .context import WorkerContext
from .flights import InFlight

log = logging.getLogger("redroll.worker")


class Outcomes:
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx

    async def finish(self, flight: InFlight, request: GenerationRequest, record: CompletionRecord) -> None:
        ctx = self.ctx
        part = ctx.part_of[flight.stream]
        reply_key = request.reply_to or part.results
        cap = ctx.settings.results_max_len if reply_key == part.results else 0
        flight.publishing = True
        rid_key = part.rid(request.request_id)

        def publish() -> Any:
            return ctx.publisher.finish(stream=flight.stream, entry_id=flight.entry_id, reply_key=reply_key,
                                        rid_key=rid_key, record=record, cap=cap)

        try:
            published = await publish()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            published = await self.retrying(publish)  # a short outage: retried while the lease holds
        stats = ctx.stats
        if published:
            stats.published += 1
            stats.by_status[record.status.value] = stats.by_status.get(record.status.value, 0) + 1
            if ctx.metrics is not None:
                ctx.metrics.observe(record.meta_info.get("queue_ms"), record.meta_info.get("engine_ms"))
            if flight.deliveries > 1:
                await ctx.redis.hdel(ctx.keys.errors, flight.key)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("request %s %s", request.request_id, record.status.value, extra=flight.context())
        else:
            stats.fenced += 1
            log.warning("request %s: lease lost (entry %s now owned elsewhere); output dropped",
                        request.request_id, flight.entry_id, extra=flight.context())

    async def dead_letter(self, flight: InFlight, fields: dict, reason: str, *,
                          error: ValidationError | None = None, request: GenerationRequest | None = None) -> None:
        ctx = self.ctx
        part = ctx.part_of[flight.stream]
        request_id = request.request_id if request else (error.request_id if error else None)
        reply_to = request.reply_to if request else (error.reply_to if error else None)
        if request_id is not None and reply_to is None:
            reply_to = part.results
        if reply_to is not None and not part.is_reply_key(reply_to):
            reply_to = None  # never write outside the pipeline's own streams
        record = None
        if request_id is not None and reply_to is not None:
            record = CompletionRecord.failed(request, request_id=request_id, status=RecordStatus.ERROR,
                                             error=reason, worker=ctx.name,
                                             n=request.n if request else 1,
                                             meta_info={"worker": ctx.name, "attempt": flight.deliveries})
        flight.publishing = True
        letter = DeadLetter(stream=flight.stream, entry_id=flight.entry_id, reason=reason, source="worker",
                            fields=fields, deliveries=flight.deliveries, delete_entry=True,
                            reply_to=reply_to if record else None, error_record=record,
                            rid_key=part.rid(request_id) if request_id else None)
        done = await self.retrying(lambda: ctx.batcher.call(lambda pipe: ctx.scripts.dead_letter_in(
            pipe, dead_key=part.dead, group=WORKERS_GROUP, consumer=ctx.name, letter=letter)))
        if int(done) == 1:
            ctx.stats.dead_lettered += 1
            if flight.deliveries > 1:
                await ctx.redis.hdel(ctx.keys.errors, flight.key)
            log.warning("request %s (entry %s) dead-lettered: %s", request_id or "?", flight.entry_id, reason,
                        extra={"request_id": request_id, "entry_id": flight.entry_id})
        else:
            ctx.stats.fenced += 1

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
        try:
            lost = await ctx.scripts.renew(flight.stream, WORKERS_GROUP, ctx.name, [flight.entry_id],
                                           idle_ms=ctx.settings.claim_idle_ms)
            if not lost:
                ctx.stats.handed_back += 1
        except redis.RedisError as exc:
            log.warning("hand-back of %s failed (%s); it will be reclaimed after claim_idle", flight.entry_id, exc)

    async def hand_back_all(self, flights: list[InFlight], note: str) -> int:
        """Give many entries back at once, each marked as handed back on purpose (``note``), so
        whoever takes them does not treat them as suspects of killing a worker."""
        ctx = self.ctx
        if not flights:
            return 0
        await ctx.redis.hset(ctx.keys.errors, mapping={f.key: note for f in flights})
        handed = 0
        for stream in ctx.request_streams:
            ids = [f.entry_id for f in flights if f.stream == stream]
            lost = await ctx.scripts.renew(stream, WORKERS_GROUP, ctx.name, ids, idle_ms=ctx.settings.claim_idle_ms)
            handed += len(ids) - len(lost)
        ctx.stats.handed_back += handed
        return handed

    @staticmethod
    async def retrying(call: Any, attempts: int = 8) -> Any:
        """Retry a Redis call through short outages while the lease is still ours."""
        delay = 0.1
        for i in range(attempts):
            try:
                return await call()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                if i == attempts - 1:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
