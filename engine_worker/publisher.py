"""Coalesce the fenced finishes of concurrent requests: one ``finish_many`` script call per
request stream per round trip, sent as soon as the event loop gets to it (no added wait)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import redis
from redis.asyncio import Redis

from shared.keys import WORKERS_GROUP
from shared.scripts import Scripts
from shared.types import CompletionRecord


@dataclass
class _Finish:
    stream: str
    entry_id: str
    reply_key: str
    rid_key: str
    record: CompletionRecord
    cap: int
    future: asyncio.Future


class Publisher:
    def __init__(self, redis_client: Redis, scripts: Scripts, consumer: str, worker: str, max_batch: int = 256):
        self.redis = redis_client
        self.scripts = scripts
        self.consumer = consumer
        self.worker = worker
        self.max_batch = max_batch
        self._queue: list[_Finish] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.flushes = 0

    async def finish(self, *, stream: str, entry_id: str, reply_key: str, rid_key: str,
                     record: CompletionRecord, cap: int) -> bool:
        """Publish ``record`` if this worker still owns the entry (True), else drop it (False)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="publisher")
        fut = asyncio.get_running_loop().create_future()
        self._queue.append(_Finish(stream, entry_id, reply_key, rid_key, record, cap, fut))
        self._wakeup.set()
        return bool(await fut)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(redis.ConnectionError("publisher closed"))
        self._queue.clear()

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
                await self._flush(batch)

    async def _flush(self, batch: list[_Finish]) -> None:
        by_stream: dict[str, list[_Finish]] = {}
        for item in batch:
            by_stream.setdefault(item.stream, []).append(item)
        try:
            replies = await self._execute(by_stream)
        except Exception as exc:  # connection lost, ...: every caller retries its own finish
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        self.flushes += 1
        for items, reply in zip(by_stream.values(), replies):
            for item, published in zip(items, reply):
                if not item.future.done():
                    item.future.set_result(int(published))

    async def _execute(self, by_stream: dict[str, list[_Finish]]) -> list:
        for attempt in (1, 2):
            async with self.redis.pipeline(transaction=False) as pipe:
                for stream, items in by_stream.items():
                    self.scripts.finish_many_in(pipe, requests_key=stream, group=WORKERS_GROUP,
                                                consumer=self.consumer, worker=self.worker,
                                                items=[(i.entry_id, i.reply_key, i.rid_key, i.record, i.cap)
                                                       for i in items])
                try:
                    return await pipe.execute()
                except redis.exceptions.NoScriptError:
                    if attempt == 2:
                        raise
                    await self.scripts.load_all()  # the server restarted and lost its script cache
        raise AssertionError("unreachable")
