"""The ``delivered`` events of the per-request event log (shared/events.py): what a worker takes
back (XCLAIM: a dead worker's entries, hand-backs), one pipelined write per reclaim, sent beside
the work, never waited for by the reclaim loop. (First deliveries, by a claim read, are not
logged: redroll/ops/trace.py finds their worker from what ended them.)"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redroll.shared.events import Delivery, EventLog, add_events, delivery_events

log = logging.getLogger("redroll.worker")


class DeliveryLog:
    """Appends what claims delivered to the requests' event logs; one write in flight at a time
    (what claims bring meanwhile goes out with the next)."""

    def __init__(self, redis: Any, events: EventLog | None, worker: str):
        self.redis = redis
        self.events = events
        self.worker = worker
        self._pending: list[tuple[str, dict]] = []
        self._task: asyncio.Task | None = None

    def note(self, deliveries: list[Delivery]) -> None:
        if self.events is None or not deliveries:
            return
        self._pending += delivery_events(deliveries, self.worker)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._write())

    async def _write(self) -> None:
        assert self.events is not None
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    add_events(pipe, self.events, batch)
                    await pipe.execute(raise_on_error=False)
            except Exception as exc:  # (the log is best effort: a lost connection costs it these events)
                log.debug("could not log %d deliveries: %s", len(batch), exc)

    async def close(self) -> None:
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
