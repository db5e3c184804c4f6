"""Idempotent calls: the same ``Idempotency-Key``, on any replica, gets the same completion and
generates nothing twice, for the window (``--idempotency-window``).

A keyed call's requests are named from the key (``i-<hash>-<i>``) and reply to a stream of their
own, ``{ns}:reply:i-<hash>``, created with the call (its first entry, ``fp``, fingerprints the body
that made it) and expiring a window later. That stream is where the records stay: every replica can read it, so a retry attaches to a call that is still
running on a replica that died, or reads the records of one that finished.

The submit is one optimistic transaction (``WATCH`` the reply stream, read it, ``MULTI``, submit
what has no record yet, ``EXEC``): a record that lands meanwhile aborts it, and the call reads again.
Each request's submit token is made from its request_id, so a request still queued or running is
not queued twice: the submit script answers it was taken already. Together: a request runs once
per window, whichever replica the retries reach.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import redis
from redis.asyncio import Redis

from redroll.producer.request import request_stream
from redroll.shared.codec import ValidationError, decode_record, encode_request
from redroll.shared.connection.durability import Durability
from redroll.shared.keys import Keys
from redroll.shared.refusals import StreamRefusedError
from redroll.shared.scripts import DuplicateRequestError, Scripts, call_replies, submit_refused, with_library
from redroll.shared.settings import Settings
from redroll.shared.streams import text
from redroll.shared.types import CompletionRecord, GenerationRequest
from redroll.web.gateway.protocol import GatewayError


def call_name(idempotency_key: str, scope: str) -> str:
    """The call's name from its key, scoped by who sent it (one API key's calls never meet another's)."""
    digest = hashlib.sha256(f"{scope}\0{idempotency_key}".encode()).hexdigest()[:40]
    return f"i-{digest}"


def fingerprint(raw_body: bytes) -> str:
    """What tells a retry (the same body) from a new call reusing a key."""
    return hashlib.sha256(raw_body).hexdigest()[:16]


class KeyedCalls:
    """Submit keyed calls on ``redis_client`` (the gateway's producer's connection) and await their
    records on ``wait_client``: a client of its own, since each waiting call blocks one of its
    connections in ``XREAD`` (size its pool to the calls that may wait: ``--max-backlog``), and
    the producer's pool must stay free for submits and its reply reader."""

    def __init__(self, settings: Settings, redis_client: Redis, wait_client: Redis, window_s: int):
        self.settings = settings
        self.redis = redis_client
        self.wait_client = wait_client
        self.scripts = Scripts(redis_client)
        self.window_s = window_s
        self.durability = Durability.of(settings)

    def reply_stream(self, requests: list[GenerationRequest], name: str) -> str:
        return self.settings.keys_for(requests[0]).reply(name)

    async def run(self, requests: list[GenerationRequest], name: str, timeout: float,
                  body_fingerprint: str) -> list[CompletionRecord]:
        """Each request's record, in order: read from the call's reply stream, or awaited there
        after submitting what was not submitted yet. A call whose stream says another body made it
        is refused (422) before anything is submitted."""
        call = await self.start(requests, name, body_fingerprint)
        try:
            return await call.all(timeout)
        finally:
            await call.close()

    async def start(self, requests: list[GenerationRequest], name: str, body_fingerprint: str) -> "KeyedCall":
        """Submit what of the call was not submitted yet (as :meth:`run`), and hand out the call:
        a record awaitable per request (a streamed call reads its chunks meanwhile). Close it."""
        stream = self.reply_stream(requests, name)
        part = self.settings.keys_for(requests[0])
        for req in requests:
            req.reply_to = stream
        datas = {req.request_id: encode_request(req, self.settings.limits)["data"] for req in requests}
        found, last_id = await with_library(
            self.redis, lambda: self._submit_missing(stream, part, requests, datas, body_fingerprint))
        return KeyedCall(self.wait_client, stream, [req.request_id for req in requests], found, last_id)

    async def _submit_missing(self, stream: str, part: Keys, requests: list[GenerationRequest],
                              datas: dict[str, bytes], body_fingerprint: str) -> tuple[dict[str, CompletionRecord], str]:
        while True:
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(stream)
                    entries = await pipe.xrange(stream)
                    found: dict[str, CompletionRecord] = {}
                    for _, fields in entries:
                        _take(found, fields)
                    made_by = next((text(f[b"fp"]) for _, f in entries if b"fp" in f), None)
                    if made_by is not None and made_by != body_fingerprint:
                        await pipe.reset()
                        raise GatewayError(422, "this Idempotency-Key was used for a different body within the window",
                                           param="Idempotency-Key", code="idempotency_key_reused")
                    last_id = text(entries[-1][0]) if entries else "0-0"
                    todo = [req for req in requests if req.request_id not in found]
                    if not todo:  # (every record is here: nothing to submit, the window is not extended)
                        await pipe.reset()
                        return found, last_id
                    pipe.multi()
                    if made_by is None:  # (the call's first entry: which body made it; XADD creates the stream)
                        pipe.xadd(stream, {"fp": body_fingerprint})
                    pipe.expire(stream, self.window_s)
                    head = 2 if made_by is None else 1
                    by_stream: dict[str, list[GenerationRequest]] = {}
                    for req in todo:
                        by_stream.setdefault(request_stream(part, req), []).append(req)
                    for requests_key, reqs in by_stream.items():
                        self.scripts.submit_many_in(pipe, requests_key=requests_key, rid_ttl_s=self.settings.rid_ttl_s,
                                                    items=[
                            (part.rid(req.request_id), f"gw:{req.request_id}", req.request_id, stream,
                             datas[req.request_id], req.lane_key if part.lanes else req.affinity_key)
                            for req in reqs])
                    replies = await pipe.execute(raise_on_error=False)
                except redis.WatchError:
                    continue  # (a record landed: read again)
            calls = list(by_stream)
            # (a missing library raises here, nothing submitted: with_library loads it and this runs again)
            replies = [*replies[:head], *call_replies(replies[head:], [submit_refused(key, len(by_stream[key]))
                                                                       for key in calls])]
            for req, reply in zip([r for reqs in by_stream.values() for r in reqs],
                                  [item for rs in replies[head:] for item in rs]):
                try:
                    Scripts.submit_outcome(req.request_id, reply)
                except StreamRefusedError as exc:
                    raise GatewayError(503, f"Redis refused the request: {exc}", kind="server_error",
                                       code="unavailable", headers={"Retry-After": "1"}) from None
                except DuplicateRequestError:
                    raise GatewayError(409, f"request {req.request_id!r} is held by a submit that is not this "
                                            "gateway's", code="conflict") from None
            await self._replicated(stream)
            return found, last_id

    async def _replicated(self, stream: str) -> None:
        """With ``wait_replicas`` / ``wait_aof``: return once replicas have the call's submit. The
        submit's MULTI ran on a connection that WATCH held, which redis-py hands back to its pool
        at the EXEC, so the WAIT follows a write of its own (the call stream's expiry set again)
        sent after the EXEC answered: replicas that acknowledged that write have everything
        written before it. A shortfall raises ReplicasBehindError (a connection error: a 503, and
        the client's retry with the same key finds the call and submits nothing twice)."""
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
        """Every record, in order, within ``timeout`` seconds (else 504: the call goes on)."""
        futures = [self.record(rid) for rid in self.request_ids]
        try:
            return list(await asyncio.wait_for(asyncio.gather(*map(asyncio.shield, futures)), timeout))
        except asyncio.TimeoutError:
            raise timed_out(timeout) from None

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


def timed_out(timeout: float) -> GatewayError:
    return GatewayError(504, f"no record within {timeout:.0f} s; the call goes on: retry with the same "
                             "Idempotency-Key to get its completion", kind="timeout", code="timeout")


def _take(found: dict[str, CompletionRecord], fields: Any) -> None:
    try:
        rec = decode_record(fields)
    except ValidationError:
        return  # (not a record of this call: nothing else writes here)
    found.setdefault(rec.request_id, rec)
