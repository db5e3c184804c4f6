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
import logging
from typing import Any, Callable

from redis.asyncio import Redis

from redroll.consumer.batch import APPLY_BYTES, BatchApplier, ConsumerStats, Item
from redroll.consumer.handlers import Handler, HandlerRegistry
from redroll.observability.tracing import tracer
from redroll.ops.backlog import group_backlog, requests_left
from redroll.ops.retention import trim_acked
from redroll.shared.connection import connect, open_connections, reach, read_groups
from redroll.shared.connection.durability import Durability
from redroll.shared.events import EventLog
from redroll.shared.keys import Keys
from redroll.shared.scripts import Scripts
from redroll.shared.settings import Settings
from redroll.shared.streams import (
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
        self._redis = redis_client
        self._owns_redis = redis_client is None
        self._stopping = asyncio.Event()
        self._cursors = {s: "0-0" for s in self.streams}
        self._applier: BatchApplier | None = None

    @property
    def blocked(self) -> str | None:
        """What Redis answered while it refuses this consumer's acks (None when it accepts them)."""
        return self._applier.blocked if self._applier is not None else None

    @property
    def applier(self) -> "BatchApplier":
        assert self._applier is not None, "consumer not started"
        return self._applier

    async def process(self, items: list[Item], stream: str | None = None,
                      checked: Callable[[], None] | None = None) -> None:
        """Apply one batch of ``stream`` (default: the first stream): see :meth:`BatchApplier.process`."""
        await self.applier.process(items, stream or self.stream, checked)

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
        self._applier = BatchApplier(
            redis_client=self.redis, scripts=self.scripts, settings=self.settings, durability=self.durability,
            group=self.group, name=self.name, registry=self.registry, stats=self.stats, part_of=self._part_of,
            streams=self.streams, apply_bytes=self.apply_bytes, keep_unhandled=self.burst, tracer=tracer(),
            metrics=self.metrics, on_applied=self.on_applied)
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
                    await self.process([Item(i, f, 1) for i, f in entries], stream, checked=read_next)
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
        items = [Item(i, f, int(p[0]["times_delivered"]) if p else 1) for (i, f), p in zip(entries, pend)]
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
        unhandled = self.applier.unhandled_entries[stream]
        if pending > len(unhandled):
            return False
        held = await self.redis.xpending_range(stream, self.group, min="-", max="+", count=pending + 1)
        return all(text(p["message_id"]) in unhandled for p in held)

    async def _trim_loop(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(self.trim_interval_s)
            for stream in self.streams:
                self.stats.trimmed += await trim_acked(self.redis, stream)
