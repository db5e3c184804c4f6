"""One batch of a consumer: decode, dead-letter what cannot be applied, leave what has no handler
here, skip what the group applied before, run the handlers, mark and ack what they applied.

:class:`BatchApplier` is built by :class:`~redroll.consumer.runner.ConsumerRunner` when it starts
(the runner reads and reclaims; this applies) and owns what a batch leaves behind: the last error
of each entry whose callback failed, the entries left pending for want of a handler, and whether
Redis refuses the acks now (``blocked``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import redis
from redis.asyncio import Redis

from redroll.consumer.handlers import HandlerRegistry
from redroll.observability.tracing import callback_span, traced
from redroll.shared.codec import ValidationError, decode_record
from redroll.shared.connection.durability import Durability
from redroll.shared.keys import Keys
from redroll.shared.refusals import is_refusal
from redroll.shared.scripts import DeadLetter, Scripts
from redroll.shared.settings import Settings
from redroll.shared.streams import READ_BYTES, data_size, text
from redroll.shared.types import CompletionRecord

log = logging.getLogger("redroll.consumer")

APPLY_BYTES = READ_BYTES
"""Record data per read (see ``shared.streams.read_count``) and per applied chunk of a batch (at
least one record): a batch is decoded, applied and acked a chunk at a time, so that a batch of
large records is never all decoded and alive at once."""


@dataclass
class ConsumerStats:
    """What this consumer did since it started (``redroll consume``'s metrics read them)."""

    applied: int = 0
    """Records its handlers applied."""
    duplicates_skipped: int = 0
    """Records already applied by the group (a redelivery, a second record of a request_id)."""
    failures: int = 0
    """Handler calls that raised (the record stays pending and is delivered again)."""
    dead_lettered: int = 0
    """Records given up after ``max_deliveries`` failed applications."""
    reclaimed: int = 0
    """Records taken over from a consumer that stopped renewing them."""
    trimmed: int = 0
    """Records deleted from the stream once every group applied them."""
    refusals: int = 0
    """Times Redis refused this consumer's markers or dead letters (out of memory, ...)."""
    unhandled: int = 0
    """Deliveries of records this consumer has no handler for (left pending, see ConsumerRunner)."""


@dataclass
class Item:
    entry_id: str
    fields: dict
    deliveries: int
    record: CompletionRecord | None = None




class BatchApplier:
    def __init__(self, *, redis_client: Redis, scripts: Scripts, settings: Settings, durability: Durability,
                 group: str, name: str, registry: HandlerRegistry, stats: ConsumerStats, part_of: dict[str, Keys],
                 streams: list[str], apply_bytes: int = APPLY_BYTES, keep_unhandled: bool = False,
                 tracer: Any = None, metrics: Any = None,
                 on_applied: Callable[[list[CompletionRecord]], None] | None = None):
        self.redis = redis_client
        self.scripts = scripts
        self.settings = settings
        self.durability = durability
        self.group = group
        self.name = name
        self.registry = registry
        self.stats = stats
        self._part_of = part_of
        self.apply_bytes = apply_bytes
        self.keep_unhandled = keep_unhandled
        """Burst mode: keep the entries left for want of a handler (its stop does not wait for them)."""
        self._tracer = tracer
        self.metrics = metrics
        self.on_applied = on_applied
        self._last_errors: dict[str, str] = {}
        self._unhandled_names: set[str | None] = set()
        self.unhandled_entries: dict[str, set[str]] = {s: set() for s in streams}
        """Entries left pending for want of a handler (kept with ``keep_unhandled``)."""
        self.blocked: str | None = None
        """What Redis answered while it refuses this consumer's acks (None when it accepts them)."""

    async def process(self, items: list[Item], stream: str, checked: Callable[[], None] | None = None) -> None:
        """Apply one batch of ``stream``, in chunks of at most
        ``apply_bytes`` of record data: each chunk's records are decoded, applied, acked and let go
        before the next chunk is decoded, so a batch of large records is never all alive at once.
        ``checked()`` is called after each chunk's markers check, before its callbacks run."""
        chunk: list[Item] = []
        size = 0
        for item in items:
            n = data_size(item.fields)
            if chunk and size + n > self.apply_bytes:
                await self._process_chunk(chunk, stream, checked)
                chunk, size = [], 0
            chunk.append(item)
            size += n
        if chunk:
            await self._process_chunk(chunk, stream, checked)

    async def _process_chunk(self, items: list[Item], stream: str, checked: Callable[[], None] | None) -> None:
        try:
            await self._apply_chunk(items, stream, checked)
        finally:
            for item in items:
                item.record = None  # (the decoded records are the bulk of a batch's memory)

    async def _apply_chunk(self, items: list[Item], stream: str, checked: Callable[[], None] | None = None) -> None:
        """Dead-letter what cannot be applied, leave what has no handler here, skip duplicates, ack
        what succeeded."""
        part = self._part_of[stream]
        runnable: list[Item] = []
        for item in items:
            try:
                item.record = decode_record(item.fields)
            except ValidationError as exc:
                await self._dead_letter(item, exc.reason, stream)
                continue
            handler = self.registry.resolve(item.record)
            if item.deliveries > self.settings.max_deliveries:
                await self._dead_letter(item, self._out_of_deliveries(item, stream, handler is None), stream)
                continue
            if handler is None:
                if self.keep_unhandled:  # (only a burst stop asks: a long-running consumer keeps no list)
                    self.unhandled_entries[stream].add(item.entry_id)
                self._leave_unhandled(item.record)
                continue
            runnable.append(item)
        if not runnable:
            return
        already = await self._applied_already(part, [i.record.dedup_id for i in runnable])  # type: ignore[union-attr]
        if checked is not None:
            checked()
        # Skip ids the group applied before and copies of one record within this batch (a replayed
        # record read together with its original): only the first copy of each request_id runs.
        to_apply: list[Item] = []
        skipped: list[Item] = []
        for i in runnable:
            rid = i.record.dedup_id  # type: ignore[union-attr]
            if rid in already:
                skipped.append(i)
            else:
                already.add(rid)
                to_apply.append(i)
        self.stats.duplicates_skipped += len(skipped)
        results = await self._apply_all(to_apply)
        succeeded = [i for i, r in zip(to_apply, results) if r is None]
        failed = [(i, r) for i, r in zip(to_apply, results) if r is not None]
        await self._ack_until_accepted(part, stream, succeeded, skipped)
        for item, exc in failed:
            self.stats.failures += 1
            self._last_errors[f"{stream}/{item.entry_id}"] = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("callback for request %s failed (delivery %d): %s", item.record.request_id,  # type: ignore[union-attr]
                        item.deliveries, exc)
        if failed:
            # Hand back at once: the next reclaim pass retries it (and counts the delivery).
            await self.scripts.renew(stream, self.group, self.name, [i.entry_id for i, _ in failed],
                                     idle_ms=self.settings.claim_idle_ms)

    def _out_of_deliveries(self, item: Item, stream: str, unhandled: bool) -> str:
        """The dead letter's reason for a record delivered more than ``max_deliveries`` times."""
        passes = f"delivered {item.deliveries} times (max_deliveries={self.settings.max_deliveries})"
        if unhandled:
            name = item.record.callback  # type: ignore[union-attr]
            what = f"no handler registered under {name!r}" if name is not None else "no callback and no default handler"
            return (f"{what} in group {self.group}: {passes}; start a consumer with the handler, then "
                    "'redroll dead requeue' it")
        last = self._last_errors.pop(f"{stream}/{item.entry_id}", None)
        return f"callback failed: {passes}" + (f"; last error: {last}" if last else "")

    def _leave_unhandled(self, record: CompletionRecord) -> None:
        """Leave a record this consumer has no handler for pending in the group (see the class)."""
        self.stats.unhandled += 1
        name = record.callback
        if name not in self._unhandled_names:
            self._unhandled_names.add(name)
            log.warning("consumer %s (group %s): %s; such records (the first: %s) are left pending in the group "
                        "for a consumer that has the handler", self.name, self.group,
                        f"no handler registered under {name!r}" if name is not None
                        else "records name no callback and this consumer has no default_handler",
                        record.request_id)

    async def _apply_all(self, items: list[Item]) -> list[BaseException | None]:
        """Run the handlers: sync ones inline, async ones concurrently. One result per item:
        None when it succeeded, else its exception."""
        results: list[BaseException | None] = [None] * len(items)
        pending: list[tuple[int, Any]] = []
        for n, item in enumerate(items):
            fn = self.registry.resolve(item.record)  # type: ignore[arg-type]
            started = time.perf_counter()
            traced_by = self._tracer if self._tracer is not None and item.record.traceparent else None  # type: ignore[union-attr]
            try:
                if traced_by is not None and inspect.iscoroutinefunction(fn):  # (its span: while it is awaited)
                    res = traced(traced_by, item.record, self.group, fn(item.record))  # type: ignore[misc]
                elif traced_by is not None:
                    with callback_span(traced_by, item.record, self.group):
                        res = fn(item.record)  # type: ignore[misc]
                else:
                    res = fn(item.record)  # type: ignore[misc]
            except (Exception, asyncio.CancelledError) as exc:  # (a sync call is never this task's cancel)
                results[n] = exc
                continue
            if inspect.isawaitable(res):
                pending.append((n, self._timed(res)))
            elif self.metrics is not None:
                self.metrics.observe(time.perf_counter() - started)
        if pending:
            outcomes = await asyncio.gather(*(aw for _, aw in pending), return_exceptions=True)
            for (n, _), outcome in zip(pending, outcomes):
                # A handler that ended in CancelledError (it awaited something cancelled) did not
                # complete: a failure, retried. (This task's own cancellation raises from gather.)
                if isinstance(outcome, BaseException):
                    results[n] = outcome
        return results

    async def _timed(self, awaitable: Any) -> None:
        started = time.perf_counter()
        try:
            await awaitable
        finally:
            if self.metrics is not None:
                self.metrics.observe(time.perf_counter() - started)

    async def _applied_already(self, part: Keys, request_ids: list[str]) -> set[str]:
        buckets = part.applied_buckets(self.group, self.settings.dedup_window_s)
        async with self.redis.pipeline(transaction=False) as pipe:
            for b in buckets:
                pipe.smismember(b, request_ids)
            replies = await pipe.execute()
        seen: set[str] = set()
        for flags in replies:
            seen.update(rid for rid, f in zip(request_ids, flags) if int(f))
        return seen

    async def _ack_until_accepted(self, part: Keys, stream: str, applied: list[Item], skipped: list[Item]) -> None:
        """Mark and ack a batch whose callbacks ran. Refused (out of memory, a replica) or cut off,
        it is retried, with the entries kept leased meanwhile: the callbacks must not run again."""
        # The entries have been idle since they were read, the callbacks' time included: renewed at
        # the first refusal, then every claim_idle / 3, so that no reclaim takes them meanwhile.
        delay, renewed = 0.1, float("-inf")
        while True:
            try:
                await self._ack(part, stream, applied, skipped)
                break
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.warning("consumer %s: acks not sent (%s); retrying", self.name, exc)
            except redis.ResponseError as exc:
                if not is_refusal(exc):
                    raise
                self.stats.refusals += 1
                if self.blocked is None:
                    log.error("consumer %s: Redis refuses the applied markers (%s): holding %d ack(s) and "
                              "reading nothing until it accepts them", self.name, exc, len(applied) + len(skipped))
                self.blocked = str(exc)
            if time.monotonic() - renewed > self.settings.claim_idle_ms / 3000.0:
                renewed = time.monotonic()
                try:
                    await self.scripts.renew(stream, self.group, self.name, [i.entry_id for i in applied + skipped])
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    pass
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        if self.blocked is not None:
            log.info("consumer %s: Redis accepts the markers again", self.name)
            self.blocked = None

    async def _ack(self, part: Keys, stream: str, applied: list[Item], skipped: list[Item]) -> None:
        """Mark applied ids and ack, in one transaction (the markers share the stream's hash tag)."""
        if not applied and not skipped:
            return
        window = self.settings.dedup_window_s
        now = time.time()
        bucket_key = part.applied(self.group, int(now // window))
        expire_at = (int(now // window) + 2) * window

        def fill(pipe: Any) -> None:
            if applied:
                pipe.sadd(bucket_key, *[i.record.dedup_id for i in applied])  # type: ignore[union-attr]
                pipe.expireat(bucket_key, int(expire_at))
            pipe.xack(stream, self.group, *[i.entry_id for i in applied + skipped])

        # (with wait_replicas, acknowledged once the replicas have it: see redroll.shared.connection.durability)
        await self.durability.transaction(self.redis, fill)
        self.stats.applied += len(applied)
        for i in applied:
            self._last_errors.pop(f"{stream}/{i.entry_id}", None)
        if self.on_applied is not None:
            self.on_applied([i.record for i in applied + skipped])  # type: ignore[misc]

    async def _dead_letter(self, item: Item, reason: str, stream: str) -> None:
        letter = DeadLetter(stream=stream, entry_id=item.entry_id, reason=reason,
                            source=f"consumer:{self.group}", fields=item.fields, deliveries=item.deliveries,
                            delete_entry=False)
        outcome = await self.scripts.dead_letter(dead_key=self._part_of[stream].dead, group=self.group,
                                                 consumer=self.name, letter=letter)
        rid = item.record.request_id if item.record else text(item.fields.get(b"rid", b"?"))
        if outcome.done:
            self.stats.dead_lettered += 1
            log.warning("record %s (entry %s) dead-lettered: %s", rid, item.entry_id, reason)
        elif outcome.refused is not None:
            # Nothing was written; it stays pending here and is tried again after claim_idle.
            self.stats.refusals += 1
            log.error("record %s (entry %s): the dead stream refused its letter (%s); retried after claim_idle",
                      rid, item.entry_id, outcome.refused)
