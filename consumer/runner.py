"""The consumer-group runner: apply callbacks to records, at least once, skipping duplicates.

Ack after the callback returns; a failed callback's entry is handed back and retried (by this
or another consumer) until ``max_deliveries``, then dead-lettered. Entries left pending by a
dead consumer are reclaimed after ``claim_idle``. Request_ids the group already applied are
remembered in expiring time buckets (``{ns}:applied:<group>:<bucket>``) and skipped.

When Redis refuses the markers (out of memory, a read-only replica), the callbacks of that batch
have run: the runner keeps their acks, stops reading, keeps the entries leased (so nobody runs
them again) and retries until Redis accepts them. A dead letter the dead stream refuses stays
pending and is tried again after ``claim_idle``.
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

from redroll.consumer.handlers import Handler, HandlerRegistry
from redroll.observability.tracing import callback_span, traced, tracer
from redroll.ops.backlog import group_backlog, requests_left
from redroll.ops.retention import trim_acked
from redroll.shared.codec import ValidationError, decode_record
from redroll.shared.connection import connect, open_connections, reach, read_groups
from redroll.shared.connection.durability import Durability
from redroll.shared.events import EventLog
from redroll.shared.keys import Keys
from redroll.shared.refusals import is_refusal
from redroll.shared.scripts import DeadLetter, Scripts
from redroll.shared.settings import Settings
from redroll.shared.streams import (
    READ_BYTES,
    data_size,
    drop_read,
    ensure_group,
    read_count,
    read_group,
    run_resilient,
    text,
    unique_consumer_name,
)
from redroll.shared.types import CompletionRecord

log = logging.getLogger("redroll.consumer")

APPLY_BYTES = READ_BYTES
"""Record data per read (see ``shared.streams.read_count``) and per applied chunk of a batch (at
least one record): a batch is decoded, applied and acked a chunk at a time, so that a batch of
large records is never all decoded and alive at once."""


@dataclass
class ConsumerStats:
    applied: int = 0
    duplicates_skipped: int = 0
    failures: int = 0
    dead_lettered: int = 0
    reclaimed: int = 0
    trimmed: int = 0
    refusals: int = 0
    """Times Redis refused this consumer's markers or dead letters (out of memory, ...)."""
    unhandled: int = 0
    """Deliveries of records this consumer has no handler for (left pending, see ConsumerRunner)."""


@dataclass
class _Item:
    entry_id: str
    fields: dict
    deliveries: int
    record: CompletionRecord | None = None


class ConsumerRunner:
    """Apply ``handlers[record.callback]`` (or ``default_handler`` to records that name no
    callback) to each record of ``stream`` (default: the results streams), in consumer group ``group``.

    A record whose callback this consumer has no handler for (a name it was not given, or no
    callback while it has no ``default_handler``) is neither applied nor acked: it is left
    pending in the group, for a consumer of the group that has the handler (which takes it over
    after ``claim_idle``), or for this one once it is restarted with it. Retention
    (``trim_acked``) keeps it, since this group has not acked it. Each such name is logged once
    (a warning) and every delivery is counted in ``stats.unhandled``. Each take-over raises its
    delivery count: past ``max_deliveries`` it is dead-lettered (the reason names the callback),
    where it stays visible (``redroll dead list``) until ``redroll dead requeue`` brings it back
    once the handler is deployed. A record is never lost to a missing handler, and never
    re-delivered forever.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        group: str,
        handlers: dict[str, Handler] | None = None,
        default_handler: Handler | None = None,
        stream: str | None = None,
        name: str | None = None,
        redis_client: Redis | None = None,
        batch: int = 128,
        block_ms: int = 1000,
        trim_interval_s: float = 5.0,
        reclaim_interval_s: float | None = None,
        apply_bytes: int = APPLY_BYTES,
        burst: bool = False,
        on_applied: Callable[[list[CompletionRecord]], None] | None = None,
    ):
        """``burst``: stop once nothing is left for this group on its streams (nothing unread, nothing
        pending but the records it has no handler for) and, on the results streams (no ``stream``
        given), nothing is queued or claimed in the request streams either: no record is still to come.

        ``on_applied(records)``: called with the records of each batch once acked, those applied now
        and those the group had applied before (skipped as duplicates)."""
        self.settings = settings
        self.durability = Durability.of(settings)
        self.keys: Keys = settings.keys
        self.group = group
        parts = settings.partition_keys
        # One results stream per partition, or the one stream asked for (e.g. a reply stream).
        self.streams = [stream] if stream else [part.results for part in parts]
        self.stream = self.streams[0]
        self._part_of = {s: next((p for p in parts if s.startswith(p.tag)), self.keys) for s in self.streams}
        self.registry = HandlerRegistry(handlers, default_handler)
        self.name = name or unique_consumer_name(f"consumer-{group}")
        self.batch = batch
        self.apply_bytes = apply_bytes
        self._count = batch
        """Entries the next read asks for: ``batch``, fewer after large records (``read_count``)."""
        self.block_ms = block_ms
        self.trim_interval_s = trim_interval_s
        self.reclaim_interval_s = reclaim_interval_s or max(0.05, min(settings.claim_idle_ms / 2000.0, 5.0))
        self.burst = burst
        self.on_applied = on_applied
        self.stats = ConsumerStats()
        self.metrics: Any = None
        """A :class:`redroll.observability.metrics.ConsumerMetrics` when metrics are served."""
        self._tracer: Any = None
        self._redis = redis_client
        self._owns_redis = redis_client is None
        self._stopping = asyncio.Event()
        self._cursors = {s: "0-0" for s in self.streams}
        self._last_errors: dict[str, str] = {}
        self._unhandled_names: set[str | None] = set()
        self._unhandled_entries: dict[str, set[str]] = {s: set() for s in self.streams}
        """Entries left pending for want of a handler, kept in burst mode (its stop does not wait
        for them)."""
        self.blocked: str | None = None
        """What Redis answered while it refuses this consumer's acks (None when it accepts them)."""

    @property
    def redis(self) -> Redis:
        assert self._redis is not None, "consumer not started"
        return self._redis

    def register(self, name: str, fn: Handler) -> None:
        self.registry.register(name, fn)

    def request_stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        if self._redis is None:
            self._redis = connect(self.settings)
        self.scripts = Scripts(self.redis, EventLog.from_settings(self.settings))
        self._tracer = tracer()
        await reach(self.redis, self.settings)
        await self._ensure_groups()
        await open_connections(self.redis, 4)  # (a blocking read, a batch's markers and acks, reclaim, trim)
        log.info("consumer %s on %s group %s: handlers %s", self.name, ", ".join(self.streams), self.group,
                 self.registry.names())
        readers = [self._read_loop_for(g) for g in read_groups(self.redis, self.streams)]
        loops = (*readers, self._reclaim_loop, self._trim_loop, *([self._burst_loop] if self.burst else []))
        tasks = [asyncio.create_task(self._guard(fn)) for fn in loops]
        n_readers = len(readers)
        try:
            await self._stopping.wait()
        finally:
            # The read loops finish their current batch (acks included) before they stop.
            await asyncio.wait(tasks[:n_readers], timeout=self.settings.drain_timeout_s)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._owns_redis:
                await self.redis.aclose()
            log.info("consumer %s stopped: %s", self.name, self.stats)

    async def _guard(self, loop_fn: Any) -> None:
        await run_resilient(loop_fn, stopping=self._stopping, log=log,
                            recreate_groups=self._ensure_groups)

    async def _ensure_groups(self) -> None:
        for stream in self.streams:
            await ensure_group(self.redis, stream, self.group)

    # ------------------------------------------------------------------ loops

    def _read_loop_for(self, streams: list[str]) -> Any:
        async def read_loop() -> None:
            await self._read_loop(streams)
        return read_loop

    async def _read_loop(self, streams: list[str]) -> None:
        """Read a batch, ask for the next one once the batch's markers are checked, then apply the
        batch: Redis builds and sends the next reply while this process runs the callbacks and acks,
        instead of while it waits (about 0.12 ms of Redis a 393 kB record). Asked for before the
        check, the next read went out beside it and delayed the check's reply, which every callback
        waits for (0.1–0.17 ms at 200 records/s). What a read delivered is always applied, also
        after a stop; no read is asked for once stopping."""
        reading: asyncio.Task | None = asyncio.ensure_future(self._read(streams))

        def read_next() -> None:
            nonlocal reading
            if reading is None and not self._stopping.is_set():
                reading = asyncio.ensure_future(self._read(streams))

        try:
            while reading is not None:
                resp = await reading
                reading = None
                for _stream, entries in resp:
                    self._count = read_count(entries, self.batch, self.apply_bytes)
                for stream, entries in resp:
                    await self.process([_Item(i, f, 1) for i, f in entries], stream, checked=read_next)
                read_next()  # (a batch whose markers were not checked: nothing in it could run)
        finally:
            drop_read(reading)  # (an error: what it read stays pending here, reclaimed after claim_idle)

    async def _read(self, streams: list[str]) -> list[tuple[str, list[tuple[str, dict]]]]:
        return await read_group(self.redis, self.group, self.name, streams, count=self._count, block=self.block_ms)

    async def _reclaim_loop(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(self.reclaim_interval_s)
            if self.blocked is not None:
                continue  # (what is held is ours and leased; nothing new can be finished now)
            for stream in self.streams:
                await self._reclaim(stream)

    async def _reclaim(self, stream: str) -> None:
        next_cursor, entries, *_ = await self.redis.xautoclaim(
            stream, self.group, self.name, self.settings.claim_idle_ms,
            start_id=self._cursors[stream], count=self._count)
        self._cursors[stream] = text(next_cursor)
        entries = [(text(i), f) for i, f in entries if f]
        if not entries:
            return
        self._count = read_count(entries, self.batch, self.apply_bytes)
        async with self.redis.pipeline(transaction=False) as pipe:
            for i, _ in entries:
                pipe.xpending_range(stream, self.group, min=i, max=i, count=1)
            pend = await pipe.execute()
        items = [_Item(i, f, int(p[0]["times_delivered"]) if p else 1) for (i, f), p in zip(entries, pend)]
        self.stats.reclaimed += len(items)
        await self.process(items, stream)

    async def _burst_loop(self) -> None:
        """Burst mode: request a stop once :meth:`idle`."""
        interval = min(max(self.block_ms / 1000.0, 0.05), 1.0)
        while not self._stopping.is_set():
            if await self.idle():
                log.info("consumer %s (burst): nothing left for group %s; stopping", self.name, self.group)
                self.request_stop()
                return
            try:
                await asyncio.wait_for(self._stopping.wait(), interval)
            except asyncio.TimeoutError:
                pass

    async def idle(self) -> bool:
        """Nothing is left for this group on its streams but the records it has no handler for (those
        it met in burst mode: otherwise they count as left), and (consuming the results streams) no
        request is queued or claimed in the request streams: the request streams' lengths (all the
        consumer's ACL user may ask of them), then this group's pending count and lag (see
        :mod:`redroll.ops.backlog`)."""
        if self.streams == [part.results for part in self.settings.partition_keys]:
            if await requests_left(self.redis, self.settings.partition_keys):
                return False
        for stream in self.streams:
            left = await group_backlog(self.redis, [stream], self.group)
            if left.undelivered or (left.pending and not await self._only_unhandled_pending(stream, left.pending)):
                return False
        return True

    async def _only_unhandled_pending(self, stream: str, pending: int) -> bool:
        unhandled = self._unhandled_entries[stream]
        if pending > len(unhandled):
            return False
        held = await self.redis.xpending_range(stream, self.group, min="-", max="+", count=pending + 1)
        return all(text(p["message_id"]) in unhandled for p in held)

    async def _trim_loop(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(self.trim_interval_s)
            for stream in self.streams:
                self.stats.trimmed += await trim_acked(self.redis, stream)

    # ------------------------------------------------------------------ one batch

    async def process(self, items: list[_Item], stream: str | None = None,
                      checked: Callable[[], None] | None = None) -> None:
        """Apply one batch of ``stream`` (default: the first stream), in chunks of at most
        ``apply_bytes`` of record data: each chunk's records are decoded, applied, acked and let go
        before the next chunk is decoded, so a batch of large records is never all alive at once.
        ``checked()`` is called after each chunk's markers check, before its callbacks run."""
        stream = stream or self.stream
        chunk: list[_Item] = []
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

    async def _process_chunk(self, items: list[_Item], stream: str, checked: Callable[[], None] | None) -> None:
        try:
            await self._apply_chunk(items, stream, checked)
        finally:
            for item in items:
                item.record = None  # (the decoded records are the bulk of a batch's memory)

    async def _apply_chunk(self, items: list[_Item], stream: str, checked: Callable[[], None] | None = None) -> None:
        """Dead-letter what cannot be applied, leave what has no handler here, skip duplicates, ack
        what succeeded."""
        part = self._part_of[stream]
        runnable: list[_Item] = []
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
                if self.burst:  # (only a burst stop asks: a long-running consumer keeps no list)
                    self._unhandled_entries[stream].add(item.entry_id)
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
        to_apply: list[_Item] = []
        skipped: list[_Item] = []
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

    def _out_of_deliveries(self, item: _Item, stream: str, unhandled: bool) -> str:
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

    async def _apply_all(self, items: list[_Item]) -> list[BaseException | None]:
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

    async def _ack_until_accepted(self, part: Keys, stream: str, applied: list[_Item], skipped: list[_Item]) -> None:
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

    async def _ack(self, part: Keys, stream: str, applied: list[_Item], skipped: list[_Item]) -> None:
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

    async def _dead_letter(self, item: _Item, reason: str, stream: str) -> None:
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
