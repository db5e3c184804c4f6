"""Keyed calls: requests whose records stay readable by any process for a window, so the same
call made again (a gateway's retry after a dead replica, with the same ``Idempotency-Key``) gets
the same records and generates nothing twice.

A keyed call's requests reply to a stream of their own, ``{ns}:reply:<call name>``, created with
the call (its first entry, ``fp``, fingerprints what made it) and expiring a window later. That
stream is where the records stay (read with ``XREAD``, never acked away: every process can read
them while the window lasts), unlike a producer's own reply stream, which its reader acks and
empties as it applies each record.

The submit is :class:`~redroll.producer.sending.SubmitCalls`, the producer's own, made inside one
optimistic transaction (``WATCH`` the call's stream, read it, ``MULTI``, submit what has no record
yet, ``EXEC``): a record that lands meanwhile aborts it, and the call reads again. Each request's
submit token is made from its request_id, so a request still queued or running is not queued
twice: the submit function answers it was taken already. Together: a request runs once per
window, whichever process the retries reach.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis
from redis.asyncio import Redis

from redroll.producer.sending import SubmitCalls
from redroll.shared.codec import ValidationError, decode_record, encode_request
from redroll.shared.connection.durability import Durability
from redroll.shared.errors import RedrollError
from redroll.shared.scripts import Scripts, with_library
from redroll.shared.settings import Settings
from redroll.shared.streams import text
from redroll.shared.types import CompletionRecord, GenerationRequest


class KeyReusedError(RedrollError, ValueError):
    """A keyed call's name was used, within its window, by a call with other contents."""


class KeyedCalls:
    """Keyed calls on ``redis_client`` (a producer's connection: :meth:`Producer.keyed_calls`),
    their records awaited on ``wait_client``: a client of its own, since each waiting call blocks
    one of its connections in ``XREAD`` (size its pool to the calls that may wait), and the
    producer's pool must stay free for submits and its reply reader."""

    def __init__(self, settings: Settings, redis_client: Redis, scripts: Scripts, wait_client: Redis,
                 window_s: int):
        self.settings, self.redis, self.wait_client, self.scripts = settings, redis_client, wait_client, scripts
        self.window_s = window_s
        self.durability = Durability.of(settings)

    def reply_stream(self, requests: list[GenerationRequest], name: str) -> str:
        return self.settings.keys_for(requests[0]).reply(name)

    async def run(self, requests: list[GenerationRequest], name: str, timeout: float,
                  fingerprint: str) -> list[CompletionRecord]:
        """Each request's record, in order (:meth:`start`, then :meth:`KeyedCall.all`)."""
        call = await self.start(requests, name, fingerprint)
        try:
            return await call.all(timeout)
        finally:
            await call.close()

    async def start(self, requests: list[GenerationRequest], name: str, fingerprint: str) -> "KeyedCall":
        """Submit what of the call was not submitted yet and hand out the call: a record awaitable
        per request (a streamed call reads its chunks meanwhile); close it. A call whose stream says
        another ``fingerprint`` made it raises :class:`KeyReusedError` before anything is submitted;
        a request Redis refused raises its submit's error (``StreamRefusedError``,
        ``DuplicateRequestError``)."""
        stream = self.reply_stream(requests, name)
        for req in requests:
            req.reply_to = stream
        # (the token prefix keyed calls have always had: a call made before an upgrade is still known)
        items = [(req, encode_request(req, self.settings.limits)["data"], f"gw:{req.request_id}")
                 for req in requests]
        found, last_id = await with_library(self.redis, lambda: self._submit_missing(stream, items, fingerprint))
        return KeyedCall(self.wait_client, stream, [req.request_id for req in requests], found, last_id)

    async def _submit_missing(self, stream: str, items: list, fingerprint: str
                              ) -> tuple[dict[str, CompletionRecord], str]:
        while True:
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(stream)
                    entries = await pipe.xrange(stream)
                    found: dict[str, CompletionRecord] = {}
                    for _, fields in entries:
                        _take(found, fields)
                    made_by = next((text(f[b"fp"]) for _, f in entries if b"fp" in f), None)
                    if made_by is not None and made_by != fingerprint:
                        await pipe.reset()
                        raise KeyReusedError(f"{stream} was made by another call within the window")
                    last_id = text(entries[-1][0]) if entries else "0-0"
                    todo = [item for item in items if item[0].request_id not in found]
                    if not todo:  # (every record is here: nothing to submit, the window is not extended)
                        await pipe.reset()
                        return found, last_id
                    pipe.multi()
                    if made_by is None:  # (the call's first entry: what made it; XADD creates the stream)
                        pipe.xadd(stream, {"fp": fingerprint})
                    pipe.expire(stream, self.window_s)
                    head = 2 if made_by is None else 1
                    calls = SubmitCalls(self.scripts, self.settings, todo)
                    calls.queue(pipe)
                    replies = await pipe.execute(raise_on_error=False)
                except redis.WatchError:
                    continue  # (a record landed: read again)
            # (a missing library raises here, nothing submitted: with_library loads it and this runs again)
            for (req, _, _), reply in zip(todo, calls.replies(replies[head:])):
                Scripts.submit_outcome(req.request_id, reply)
            await self._replicated(stream)
            return found, last_id

    async def _replicated(self, stream: str) -> None:
        """With ``wait_replicas`` / ``wait_aof``: return once replicas have the call's submit. The
        submit's MULTI ran on a connection that WATCH held, which redis-py hands back to its pool
        at the EXEC, so the WAIT follows a write of its own (the call stream's expiry set again)
        sent after the EXEC answered: replicas that acknowledged that write have everything
        written before it. A shortfall raises ReplicasBehindError (a connection error: a retry
        with the same name finds the call and submits nothing twice)."""
        if not self.durability.waits:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.expire(stream, self.window_s)
            await self.durability.execute(pipe)


class KeyedCall:
    """A submitted keyed call: one future per request, resolved with its record as it lands on
    the call's reply stream (read by one task, started with the first :meth:`record`, on a
    connection of ``wait_client``). :meth:`close` ends the reading; the requests go on."""

    def __init__(self, wait_client: Redis, stream: str, request_ids: list[str], found: dict[str, CompletionRecord],
                 last_id: str):
        self.wait_client = wait_client
        self.stream = stream
        self.request_ids = request_ids
        self._last_id = last_id
        loop = asyncio.get_running_loop()
        self._futures: dict[str, asyncio.Future[CompletionRecord]] = {rid: loop.create_future() for rid in request_ids}
        self._resolve(found)
        self._reader: asyncio.Task | None = None

    def record(self, request_id: str) -> "asyncio.Future[CompletionRecord]":
        """The future of ``request_id``'s record."""
        if self._reader is None and not all(f.done() for f in self._futures.values()):
            self._reader = asyncio.create_task(self._read(), name=f"keyed-call-{self.stream}")
        return self._futures[request_id]

    async def all(self, timeout: float) -> list[CompletionRecord]:
        """Every record, in order, within ``timeout`` seconds (else :class:`TimeoutError`: the call goes on)."""
        futures = [self.record(rid) for rid in self.request_ids]
        try:
            return list(await asyncio.wait_for(asyncio.gather(*map(asyncio.shield, futures)), timeout))
        except asyncio.TimeoutError:
            raise TimeoutError(f"no record within {timeout:.0f} s; the call goes on") from None

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for future in self._futures.values():
            if not future.done():
                future.cancel()

    def _resolve(self, found: dict[str, CompletionRecord]) -> None:
        for rid, rec in found.items():
            future = self._futures.get(rid)
            if future is not None and not future.done():
                future.set_result(rec)

    async def _read(self) -> None:
        try:
            while not all(f.done() for f in self._futures.values()):
                reply = await self.wait_client.xread({self.stream: self._last_id}, block=5000)
                found: dict[str, CompletionRecord] = {}
                for _, entries in reply or ():
                    for entry_id, fields in entries:
                        self._last_id = text(entry_id)
                        _take(found, fields)
                self._resolve(found)
        except Exception as exc:  # (Redis unreachable past the client's retries: every waiter learns it)
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(exc)
                    future.exception()  # (retrieved: a call that stopped waiting logs nothing)




def _take(found: dict[str, CompletionRecord], fields: Any) -> None:
    try:
        rec = decode_record(fields)
    except ValidationError:
        return  # (not a record of this call: nothing else writes here)
    found.setdefault(rec.request_id, rec)
