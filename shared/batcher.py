"""Coalesce many small per-request Redis calls into one pipeline round trip.

Hundreds of request tasks each finishing (one Lua call) or dead-lettering would otherwise need
hundreds of round trips and connections. Each task queues its item and awaits its own reply; a
single flusher sends whatever is queued as one batch as soon as the event loop gets to it, so
batching adds no waiting at light load. :class:`Coalescer` is that queue and flusher;
:class:`CommandBatcher` sends arbitrary commands with it, ``redroll.engine_worker.publisher.Publisher``
the fenced finishes.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Generic, TypeVar

import redis
from redis.asyncio import Redis

T = TypeVar("T")

QueueFn = Callable[[Any], None]
"""Queues exactly one command on the pipeline it is given."""


class Coalescer(Generic[T]):
    """Items queued by many tasks, flushed in batches of at most ``max_batch`` by one task."""

    def __init__(self, max_batch: int):
        self.max_batch = max_batch
        self._queue: list[tuple[T, asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=type(self).__name__)

    def _enqueue(self, item: T) -> asyncio.Future:
        """Queue ``item``; the future gets its reply (or exception) once its batch is flushed."""
        self.start()
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((item, fut))
        self._wakeup.set()
        return fut

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for _, fut in self._queue:
            if not fut.done():
                fut.set_exception(redis.ConnectionError(f"{type(self).__name__} closed"))
        self._queue.clear()

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
                await self._flush(batch)

    async def _flush(self, batch: list[tuple[T, asyncio.Future]]) -> None:
        """Send ``batch`` and settle every future in it (a failed round trip fails them all)."""
        raise NotImplementedError


class CommandBatcher(Coalescer[QueueFn]):
    def __init__(self, redis: Redis, max_batch: int = 512):
        super().__init__(max_batch)
        self.redis = redis
        self.batches = 0
        self.commands = 0

    async def call(self, queue_fn: QueueFn) -> Any:
        """Queue one command and await its reply (exceptions are raised here, per command)."""
        return await self._enqueue(queue_fn)

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
