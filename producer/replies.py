"""The producer's reply reader: read its reply streams, hand each record to its waiter, ack.

One :class:`ReplyReader` per producer reads that producer's reply streams (through consumer group
``producer``, consumer = the producer's name) and gives each record to
:class:`~redroll.producer.pending.PendingRequests`, the one owner of the requests' state; it acks
what was applied (with the finished marks the finish left, ``ack_replies``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import redis
from redis.asyncio import Redis

from redroll.producer.pending import Ack, PendingRequests
from redroll.shared.codec import ValidationError, decode_record
from redroll.shared.errors import RedrollError
from redroll.shared.keys import PRODUCER_GROUP, Keys
from redroll.shared.scripts import DeadLetter, Scripts
from redroll.shared.settings import Settings
from redroll.shared.streams import drop_read, ensure_group, is_unblocked, read_count, read_group, text
from redroll.shared.types import CompletionRecord

log = logging.getLogger("redroll.producer")


class BeforeAckError(RedrollError, RuntimeError):
    """The producer's ``before_ack`` raised (its error is the cause): the records it was to make
    last were applied here, and their reply entries were not acked."""


class ReplyReader:
    """Reads one producer's reply streams into its :class:`PendingRequests` (see the module).

    ``before_ack()`` runs before the reply entries of applied records are acked (see
    :class:`~redroll.producer.client.Producer`); ``after_ack()`` after each batch acked (the
    producer's backpressure wakes a submit waiting for room)."""

    def __init__(self, *, redis_client: Redis, scripts: Scripts, settings: Settings, name: str,
                 reply_streams: list[str], parts: list[Keys], pending: PendingRequests, read_count: int,
                 block_ms: int, before_ack: Callable[[], None] | None = None,
                 after_ack: Callable[[], Awaitable[None]] | None = None):
        self.redis, self.scripts, self.settings, self.name = redis_client, scripts, settings, name
        self.reply_streams, self.parts, self.pending = reply_streams, parts, pending
        self.read_count, self.block_ms = read_count, block_ms
        self._before_ack, self._after_ack = before_ack, after_ack
        self.closed = False
        self._last_expire = 0.0

    async def read_what_came(self, streams: list[str]) -> None:
        """Deliver every record on ``streams`` now, without waiting for more: this name's pending
        entries (a restart resumes them), then the new ones. ``start`` returns after it, so a
        record that came before the first submit is held (a restarted producer with
        ``tokens_from_ids`` resolves a submit of its request from it, and does not send it again)."""
        count = self.read_count  # (fewer once records are large: see read_count)
        for stream in streams:
            last_id = "0"
            while last_id != ">":
                batch, last_id = await self._read_page(stream, last_id, count)
                count = read_count([e for _s, e in batch], self.read_count) if batch else count
                await self._deliver(batch)
        while True:
            asked = count
            batch = [(s, e) for s, es in await read_group(self.redis, PRODUCER_GROUP, self.name, streams,
                                                          count=asked) for e in es]
            count = read_count([e for _s, e in batch], self.read_count) if batch else count
            await self._deliver(batch)
            if len(batch) < asked:
                return

    async def _read_page(self, stream: str, last_id: str, count: int) -> tuple[list, str]:
        """A page of this name's pending entries on ``stream`` after ``last_id``: the entries, and
        where the next page starts (``>`` once none are left)."""
        resp = await self.redis.xreadgroup(PRODUCER_GROUP, self.name, {stream: last_id}, count=count)
        entries = [e for _s, es in (resp or []) for e in es]
        return [(stream, e) for e in entries], ">" if len(entries) < count else text(entries[-1][0])

    async def read_loop(self, streams: list[str]) -> None:
        # New entries: our own pending ones were read before start returned (_read_what_came); they
        # are paged again ("0") after a connection error, a read that lost its reply, or a
        # before_ack that raised.
        last_ids = {stream: ">" for stream in streams}
        delay = 0.1
        recheck_s = min(self.settings.claim_idle_ms / 1000, 5.0)
        next_check = time.monotonic() + recheck_s
        count = self.read_count  # (fewer after large records: see read_count)
        # The next new-entries read, asked for before a batch is delivered (Redis builds its reply
        # meanwhile). None while paging, and none once the lost-reads check is due: the check counts
        # this reader's pending entries, which an outstanding read adds to.
        ahead: asyncio.Task | None = None
        try:
            while not self.closed:
                try:
                    paging = {s: i for s, i in last_ids.items() if i != ">"}
                    if not paging and ahead is None and time.monotonic() >= next_check:
                        next_check = time.monotonic() + recheck_s
                        if await self._lost_reads(streams):
                            last_ids = {stream: "0" for stream in streams}
                            continue
                    if paging:
                        stream, last_id = next(iter(paging.items()))
                        batch, last_ids[stream] = await self._read_page(stream, last_id, count)
                    else:
                        reading, ahead = ahead or self._read_new(streams, count), None
                        batch = [(s, e) for s, es in await reading for e in es]
                    if batch:
                        count = read_count([e for _s, e in batch], self.read_count)
                    if not paging and not self.closed and time.monotonic() < next_check:
                        ahead = self._read_new(streams, count)
                    await self._deliver(batch)
                    await self._refresh_ttl()
                    delay = 0.1
                except asyncio.CancelledError:
                    raise
                except BeforeAckError as exc:
                    ahead = drop_read(ahead)
                    log.error("reply reader: %s; trying again in %.1fs", exc, delay)
                    last_ids = {stream: "0" for stream in streams}  # (their acks come when they are read again)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
                except redis.ResponseError as exc:  # (a read asked for ahead stays: the next turn awaits it)
                    if "NOGROUP" in str(exc):
                        for stream in streams:
                            await ensure_group(self.redis, stream, PRODUCER_GROUP)
                        continue
                    if is_unblocked(exc):
                        continue
                    log.exception("reply reader failed")
                    await asyncio.sleep(delay)
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    ahead = drop_read(ahead)
                    log.warning("reply reader: redis unavailable (%s); retrying in %.1fs", exc, delay)
                    # A read the server ran before the connection dropped left its entries pending here,
                    # with no reply to deliver them: page this reader's own pending entries again.
                    last_ids = {stream: "0" for stream in streams}
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
                except Exception as exc:
                    # Anything else (a cluster client giving up mid-failover: "TTL exhausted", a bug)
                    # must not end the reader for good: its waiters would wait forever.
                    ahead = drop_read(ahead)
                    log.exception("reply reader: %s; reading again in %.1fs", type(exc).__name__, delay)
                    last_ids = {stream: "0" for stream in streams}
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
        finally:
            drop_read(ahead)

    def _read_new(self, streams: list[str], count: int) -> asyncio.Task:
        return asyncio.ensure_future(read_group(self.redis, PRODUCER_GROUP, self.name, streams, count=count,
                                                block=self.block_ms))

    async def _lost_reads(self, streams: list[str]) -> bool:
        """True when this reader has entries pending that it neither holds for :meth:`unclaimed`
        nor knows about: a read the server ran whose reply never came back. The client retries a
        read on a dropped connection by itself (the cluster client after a failover too), so the
        retried read (``>``) finds nothing new and no error tells the loop to page them again."""
        held = self.pending.counts()
        for stream in streams:
            summary = await self.redis.xpending(stream, PRODUCER_GROUP)
            mine = sum(c["pending"] for c in summary.get("consumers") or () if text(c["name"]) == self.name)
            if mine > held.get(stream, 0):
                log.warning("reply reader: %d record(s) on %s were read without a reply; reading them again",
                            mine - held.get(stream, 0), stream)
                return True
        return False

    async def _deliver(self, entries: list) -> None:
        done: list[Ack] = []
        for stream, (raw_id, fields) in entries:
            entry_id = (stream, text(raw_id))
            if not fields:
                done.append((entry_id, ""))
                continue
            try:
                record = decode_record(fields)
            except ValidationError as exc:
                await self._dead_letter(entry_id, fields, exc.reason)
                continue
            if await self.pending.resolve(record, entry_id):
                done.append((entry_id, record.request_id))
        await self.ack(self.pending.hold_acks(done))

    async def resolve_notice(self, record: CompletionRecord) -> None:
        """A dead letter says this request's record could not reach its reply stream."""
        if record.request_id in self.pending:
            log.warning("request %s was dead-lettered and its reply stream refused the error record (%s)",
                        record.request_id, record.meta_info.get("reply_error"))
            await self.pending.resolve(record)
            if self._after_ack is not None:
                await self._after_ack()

    async def ack_now(self, entries: list[Ack]) -> None:
        """:meth:`ack`, with a ``before_ack`` that raises logged (the entries stay pending here: the
        reader reads them again, and acks them)."""
        try:
            await self.ack(entries)
        except BeforeAckError as exc:
            log.error("%s", exc)

    async def ack(self, entries: list[Ack]) -> None:
        """Ack and delete the entries of applied records, given as ((stream, entry id), request_id),
        taking the finished marks they leave in the ownership hash with them: one call per reply
        stream (``Scripts.ack_replies_in``)."""
        if entries and self._before_ack is not None:
            try:
                self._before_ack()
            except Exception as exc:
                raise BeforeAckError(f"before_ack raised {exc!r}: {len(entries)} reply entries left unacked") from exc
        by_stream: dict[str, list[tuple[str, str]]] = {}
        for (stream, entry_id), request_id in entries:
            by_stream.setdefault(stream, []).append((entry_id, request_id))
        for stream, pairs in by_stream.items():
            await self.scripts.ack_replies_in(self.redis, stream=stream, group=PRODUCER_GROUP, entries=pairs)
        if entries and self._after_ack is not None:
            await self._after_ack()

    async def _dead_letter(self, entry: tuple[str, str], fields: dict, reason: str) -> None:
        stream, entry_id = entry
        part = self.parts[self.reply_streams.index(stream)]
        letter = DeadLetter(stream=stream, entry_id=entry_id, reason=reason, source="producer",
                            fields=fields, delete_entry=True)
        outcome = await self.scripts.dead_letter(dead_key=part.dead, group=PRODUCER_GROUP, consumer=self.name,
                                                 letter=letter)
        if outcome.refused is not None:
            log.error("undecodable record %s on %s: the dead stream refused its letter (%s); it stays pending "
                      "here and is tried again", entry_id, stream, outcome.refused)
        else:
            log.warning("undecodable record %s on %s dead-lettered: %s", entry_id, stream, reason)

    async def _refresh_ttl(self) -> None:
        now = time.monotonic()
        if now - self._last_expire > min(60.0, self.settings.reply_ttl_s / 4):
            self._last_expire = now
            for stream in self.reply_streams:
                await self.redis.expire(stream, self.settings.reply_ttl_s)
