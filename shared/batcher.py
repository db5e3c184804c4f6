"""Coalesce many small per-request Redis calls into one pipeline round trip.

Hundreds of request tasks each finishing (one Lua call) or checking an abort (one ZMSCORE) would
otherwise need hundreds of round trips and connections. Each task queues its command and awaits
its own reply; a single flusher sends whatever is queued as one non-transactional pipeline as
soon as the event loop gets to it, so batching adds no waiting at light load.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from redis.asyncio import Redis

QueueFn = Callable[[Any], None]
"""Queues exactly one command on the pipeline it is given."""


class CommandBatcher:
    def __init__(self, redis: Redis, max_batch: int = 512):
        self.redis = redis
        self.max_batch = max_batch
        self._queue: list[tuple[QueueFn, asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.commands = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="redis-batcher")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for _, fut in self._queue:
            if not fut.done():
                fut.set_exception(ConnectionError("batcher closed"))
        self._queue.clear()

    async def call(self, queue_fn: QueueFn) -> Any:
        """Queue one command and await its reply (exceptions are raised here, per command)."""
        if self._task is None or self._task.done():
            self.start()
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((queue_fn, fut))
        self._wakeup.set()
        return await fut

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
                await self._flush(batch)

    async def _flush(self, batch: list[tuple[QueueFn, asyncio.Future]]) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for queue_fn, _ in batch:
                    queue_fn(pipe)
                replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # the whole round trip failed (connection lost, ...)
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        self.batches += 1
        self.commands += len(batch)
        for (_, fut), reply in zip(batch, replies):
            if fut.done():
                continue
            if isinstance(reply, Exception):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)
