"""Coalesce the fenced finishes of concurrent requests: one ``finish_many`` script call per
request stream per round trip, sent as soon as the event loop gets to it (no added wait).

A script call carries at most ``max_call_bytes`` of records (at least one record), and a round
trip as many calls as its batch needs: Redis runs a script call whole, so one call with dozens of
large records (n × thousands of tokens with logprobs) would hold every other client of that server,
producers, consumers and the rest of the fleet, for as long as storing all of them takes (3–8 ms
a MB on this project's machine). Between calls, Redis serves the others."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import redis
from redis.asyncio import Redis

from redroll.shared.batcher import Coalescer
from redroll.shared.codec import encode_record
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.scripts import Scripts, refusal
from redroll.shared.types import CompletionRecord


@dataclass
class _Finish:
    stream: str
    entry_id: str
    reply_key: str
    rid_key: str
    encoded: dict
    """The record's stream fields (``encode_record``)."""
    cap: int
    partial_key: str | None = None


class Publisher(Coalescer[_Finish]):
    def __init__(self, redis_client: Redis, scripts: Scripts, consumer: str, worker: str, max_batch: int = 256,
                 max_call_bytes: int = 1 << 20):
        super().__init__(max_batch)
        self.redis = redis_client
        self.scripts = scripts
        self.consumer = consumer
        self.worker = worker
        self.max_call_bytes = max_call_bytes
        self.flushes = 0

    async def finish(self, *, stream: str, entry_id: str, reply_key: str, rid_key: str,
                     record: CompletionRecord, cap: int, partial_key: str | None = None) -> bool:
        """Publish ``record`` if this worker still owns the entry (True), else drop it (False).

        Raises :class:`redroll.shared.refusals.StreamRefusedError` when the reply stream refused
        the record: nothing of it was written, and the entry is still this worker's."""
        return bool(await self._enqueue(_Finish(stream, entry_id, reply_key, rid_key, encode_record(record), cap,
                                                partial_key)))

    def _calls(self, batch: list[tuple[_Finish, asyncio.Future]]) -> list[list[tuple[_Finish, asyncio.Future]]]:
        """``batch`` as script calls: one request stream each, at most ``max_call_bytes`` of records
        each (at least one record)."""
        calls: list[list[tuple[_Finish, asyncio.Future]]] = []
        open_call: dict[str, tuple[list[tuple[_Finish, asyncio.Future]], int]] = {}
        for item in batch:
            size = len(item[0].encoded["data"])
            call, used = open_call.get(item[0].stream, (None, 0))
            if call is None or used + size > self.max_call_bytes:
                call, used = [], 0
                calls.append(call)
            call.append(item)
            open_call[item[0].stream] = (call, used + size)
        return calls

    async def _flush(self, batch: list[tuple[_Finish, asyncio.Future]]) -> None:
        calls = self._calls(batch)
        try:
            replies = await self._execute(calls)
        except Exception as exc:  # connection lost, ...: every caller retries its own finish
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        self.flushes += 1
        for items, reply in zip(calls, replies):
            for (item, fut), outcome in zip(items, reply):
                if fut.done():
                    continue
                error = refusal(outcome, item.reply_key)  # this item's reply stream refused it
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(int(outcome))

    async def _execute(self, calls: list[list[tuple[_Finish, asyncio.Future]]]) -> list:
        """All of ``calls`` in one round trip (Redis serves other clients between them)."""
        for attempt in (1, 2):
            async with self.redis.pipeline(transaction=False) as pipe:
                for items in calls:
                    self.scripts.finish_many_in(pipe, requests_key=items[0][0].stream, group=WORKERS_GROUP,
                                                consumer=self.consumer, worker=self.worker,
                                                items=[(i.entry_id, i.reply_key, i.rid_key, i.encoded, i.cap,
                                                        i.partial_key) for i, _ in items])
                try:
                    return await pipe.execute()
                except redis.exceptions.NoScriptError:
                    if attempt == 2:
                        raise
                    await self.scripts.load_all()  # the server restarted and lost its script cache
        raise AssertionError("unreachable")
