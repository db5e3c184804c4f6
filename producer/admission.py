"""Backpressure for a producer's submits: nothing is dropped, a submit waits for room.

``max_inflight``: at most this many requests outstanding. ``max_staleness`` with ``batch_size``:
AReaL's capacity rule, at most ``(max_staleness + weight_version + 1) * batch_size`` requests
admitted in all (those that brought no sample are given back), so no sample is generated more
than ``max_staleness`` versions behind the trainer.
"""

from __future__ import annotations

import asyncio
from typing import Callable


class Admission:
    def __init__(self, max_inflight: int | None = None, max_staleness: int | None = None,
                 batch_size: int | None = None):
        if max_staleness is not None and not batch_size:
            raise ValueError("max_staleness needs batch_size (AReaL's capacity rule)")
        if max_inflight is not None and max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        self.max_inflight = max_inflight
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.weight_version = 0
        """The trainer's current weight version (the staleness bound moves with it)."""
        self.admitted = 0
        """Requests admitted so far, less those given back."""
        self._room = asyncio.Condition()
        self._closed = False

    @property
    def bounded(self) -> bool:
        return self.max_inflight is not None or self.max_staleness is not None

    def room(self, outstanding: int) -> int:
        room = 1 << 30
        if self.max_inflight is not None:
            room = min(room, self.max_inflight - outstanding)
        if self.max_staleness is not None and self.batch_size:
            room = min(room, (self.max_staleness + self.weight_version + 1) * self.batch_size - self.admitted)
        return room

    async def wait_for_room(self, outstanding: Callable[[], int]) -> int:
        """How many requests may be submitted now (at least 1), once there is room (or it closed)."""
        async with self._room:
            await self._room.wait_for(lambda: self.room(outstanding()) > 0 or self._closed)
            return max(1, self.room(outstanding()))

    async def notify(self) -> None:
        async with self._room:
            self._room.notify_all()

    def admit(self, n: int) -> None:
        self.admitted += n

    def give_back(self, n: int) -> None:
        self.admitted -= n

    def set_weight_version(self, version: int) -> None:
        self.weight_version = int(version)
        asyncio.get_running_loop().create_task(self.notify())

    async def close(self) -> None:
        self._closed = True
        await self.notify()
