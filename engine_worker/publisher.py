"""Coalesce the fenced finishes of concurrent requests: one ``finish_many`` script call per
request stream per round trip, sent as soon as the event loop gets to it (no added wait)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import redis
from redis.asyncio import Redis

from redroll.shared.batcher import Coalescer
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.scripts import Scripts, refusal
from redroll.shared.types import CompletionRecord


@dataclass
class _Finish:
    stream: str
    entry_id: str
    reply_key: str
    rid_key: str
    record: CompletionRecord
    cap: int
    partial_key: str | None = None


class Publisher(Coalescer[_Finish]):
    def __init__(self, redis_client: Redis, scripts: Scripts, consumer: str, worker: str, max_batch: int = 256):
        super().__init__(max_batch)
        self.redis = redis_client
        self.scripts = scripts
        self.consumer = consumer
        self.worker = worker
        self.flushes = 0

    async def finish(self, *, stream: str, entry_id: str, reply_key: str, rid_key: str,
                     record: CompletionRecord, cap: int, partial_key: str | None = None) -> bool:
        """Publish ``record`` if this worker still owns the entry (True), else drop it (False).

        Raises :class:`redroll.shared.refusals.StreamRefusedError` when the reply stream refused
        the record: nothing of it was written, and the entry is still this worker's."""
        return bool(await self._enqueue(_Finish(stream, entry_id, reply_key, rid_key, record, cap, partial_key)))

    async def _flush(self, batch: list[tuple[_Finish, asyncio.Future]]) -> None:
        by_stream: dict[str, list[tuple[_Finish, asyncio.Future]]] = {}
        for item in batch:
            by_stream.setdefault(item[0].stream, []).append(item)
        try:
            replies = await self._execute(by_stream)
        except Exception as exc:  # connection lost, ...: every caller retries its own finish
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        self.flushes += 1
        for items, reply in zip(by_stream.values(), replies):
            for (item, fut), outcome in zip(items, reply):
                if fut.done():
                    continue
                error = refusal(outcome, item.reply_key)  # this item's reply stream refused it
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(int(outcome))

    async def _execute(self, by_stream: dict[str, list[tuple[_Finish, asyncio.Future]]]) -> list:
        for attempt in (1, 2):
            async with self.redis.pipeline(transaction=False) as pipe:
                for stream, items in by_stream.items():
                    self.scripts.finish_many_in(pipe, requests_key=stream, group=WORKERS_GROUP,
                                                consumer=self.consumer, worker=self.worker,
                                                items=[(i.entry_id, i.reply_key, i.rid_key, i.record, i.cap,
                                                        i.partial_key) for i, _ in items])
                try:
                    return await pipe.execute()
                except redis.exceptions.NoScriptError:
                    if attempt == 2:
                        raise
                    await self.scripts.load_all()  # the server restarted and lost its script cache
        raise AssertionError("unreachable")
