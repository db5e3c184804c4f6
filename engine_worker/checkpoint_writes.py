"""One batched, fenced write per worker tick: every streamed chunk and checkpoint a worker saves.

Each request that saves partial output (a streamed one, a checkpointed one: see :mod:`.checkpoints`)
has a :class:`~.checkpoints.Saver`, registered here while its generation runs. One loop, every
:data:`TICK_S`, asks each saver whether a save is due (a streamed request: ``stream_chunk_tokens``
new tokens, or any at the streams' shared timer, which beats every ``stream_chunk_ms``; a
checkpointed one: ``checkpoint_tokens`` and ``checkpoint_interval_s``, whichever later) and writes
all the due saves at once: one
``checkpoint_many`` call per hash tag (each call's keys share one, as Redis Cluster wants), all of
them in one pipeline, one round trip. Saves that come between ticks (a drain's or a notice's
flush of what the engine made) are coalesced the same way: whatever is queued when the writer gets
to it goes in one call.

Why one function call per tag rather than a pipeline of one call per save: a pipeline saves the
round trips but not the work Redis does per call (dispatching the function, reading the
consumer's pending entries to fence it, one reply each); one call reads each request stream's
pending entries once for all its saves, and readers blocked on the chunk streams are woken once,
after it. The fencing and the all-or-nothing rule stay per save (see ``checkpoint_many.lua``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import redis

from redroll.engine_worker.flights import DEATHS_SUFFIX
from redroll.shared.batcher import Coalescer
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.scripts import CheckpointSave, call_replies, checkpoint_outcomes, checkpoint_refused, with_library

if TYPE_CHECKING:
    from redroll.engine_worker.context import WorkerContext

log = logging.getLogger("redroll.worker")

TICK_S = 0.02
"""How often the writer looks at what its requests made (a streamed request's first chunk comes
at most this much after it is due); ``stream_chunk_ms`` when that is shorter."""
MAX_BATCH = 1024
"""The most saves in one round trip."""


class Saver(Protocol):
    """What the writer asks of a generation's saver (:class:`~.checkpoints.Saver`, whose module
    imports this one)."""

    request: Any
    flight: Any
    broken: bool

    def due(self, now: float, beat: bool = False) -> "Prepared | None": ...

    def settle(self, prepared: "Prepared", outcome: Any) -> bool: ...


@dataclass
class Prepared:
    """A save a :class:`~.checkpoints.Saver` made ready: what to write, and what it settles."""

    saver: "Saver"
    save: CheckpointSave
    end: int
    """Tokens of this worker's generation saved once it is written."""
    text: str | None = None
    """A streamed request's text up to ``end`` (what its readers will have been sent)."""


class CheckpointWriter(Coalescer[Prepared]):
    """The saves of one worker: the tick loop, and one batched write for whatever is queued."""

    def __init__(self, ctx: "WorkerContext"):
        super().__init__(MAX_BATCH)
        self.ctx = ctx
        self.savers: dict["Saver", None] = {}
        """The savers of the generations running now, in the order they began."""
        self._tick_task: asyncio.Task | None = None
        self._stream_beat = 0.0
        """When the streams' shared timer beats next (``stream_chunk_ms`` apart)."""
        self._has_savers = asyncio.Event()
        self.calls = 0
        """Round trips made (each one call per hash tag)."""
        self.saves = 0
        """Saves written."""

    def add(self, saver: "Saver") -> None:
        self.savers[saver] = None
        self._has_savers.set()
        if self._tick_task is None or self._tick_task.done():
            self._tick_task = asyncio.create_task(self._tick_loop(), name="checkpoint-tick")

    def remove(self, saver: "Saver") -> None:
        self.savers.pop(saver, None)

    async def write(self, prepared: list[Prepared]) -> list[bool]:
        """Write ``prepared`` (with whatever else is queued, in one round trip); True for each that was saved."""
        if not prepared:
            return []
        return list(await asyncio.gather(*(self._enqueue(p) for p in prepared)))

    async def close(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
            await asyncio.gather(self._tick_task, return_exceptions=True)
            self._tick_task = None
        await super().close()

    async def _tick_loop(self) -> None:
        while True:
            if not self.savers:
                self._has_savers.clear()
                await self._has_savers.wait()
            # (a stream timer set shorter than the tick: the tick follows it)
            await asyncio.sleep(min(TICK_S, self.ctx.settings.stream_chunk_ms / 1000.0))
            now = time.monotonic()
            beat = now >= self._stream_beat
            if beat:
                self._stream_beat = now + self.ctx.settings.stream_chunk_ms / 1000.0
            due = []
            for saver in list(self.savers):
                try:
                    p = saver.due(now, beat)
                except Exception as exc:  # (a defect in one request's save costs no other request its saves)
                    log.error("checkpoint of %s not made: %s", saver.request.request_id, exc, exc_info=exc)
                    saver.broken = True
                    continue
                if p is not None:
                    due.append(p)
            if due:
                await self.write(due)

    async def _flush(self, batch: list[tuple[Prepared, asyncio.Future]]) -> None:
        """One round trip: one checkpoint_many call per hash tag; each save settled by its saver."""
        ctx = self.ctx
        by_tag: dict[str, list[tuple[Prepared, asyncio.Future]]] = {}
        for item in batch:
            by_tag.setdefault(_tag_of(item[0].save.requests_key), []).append(item)
        groups = list(by_tag.values())

        async def attempt() -> list:
            async with ctx.redis.pipeline(transaction=False) as pipe:
                for group in groups:
                    ctx.scripts.checkpoint_many_in(pipe, group=WORKERS_GROUP, consumer=ctx.name,
                                                   saves=[p.save for p, _ in group], ttl_s=ctx.settings.rid_ttl_s,
                                                   chunks_ttl_s=ctx.settings.stream_chunk_ttl_s)
                replies = await pipe.execute(raise_on_error=False)
            return call_replies(replies, [checkpoint_refused(len(g)) for g in groups])

        try:
            replies = await with_library(ctx.redis, attempt)
        except (redis.RedisError, OSError) as exc:
            # (a lost connection: nothing is known to be written; each saver tries again at its next save)
            log.warning("%d checkpoint(s) not saved: %s", len(batch), exc)
            for p, fut in batch:
                p.saver.settle(p, None)
                if not fut.done():
                    fut.set_result(False)
            return
        self.calls += 1
        cleared = []
        for group, reply in zip(groups, replies):
            for (p, fut), outcome in zip(group, checkpoint_outcomes(reply)):
                ok = p.saver.settle(p, outcome)
                self.saves += ok
                flight = p.saver.flight
                if ok and getattr(flight, "suspect_cap", None) is not None:
                    # Its checkpoint advanced here, after the death of a worker that ran it: it is no
                    # suspect of that death any more (the next death counts from scratch), nor does it
                    # bound the group of the suspects running beside it.
                    flight.suspect_cap = None
                    cleared.append(flight.key + DEATHS_SUFFIX)
                if not fut.done():
                    fut.set_result(ok)
        if cleared:
            try:
                await ctx.redis.hdel(ctx.keys.errors, *cleared)
            except redis.RedisError as exc:
                log.warning("death notes of %d entr(ies) not cleared: %s", len(cleared), exc)


def _tag_of(key: str) -> str:
    """The hash tag of ``key`` (``{ns}`` or ``{ns:i}``): the saves of one call share it."""
    return key[: key.index("}") + 1] if key.startswith("{") and "}" in key else key


__all__ = ["CheckpointWriter", "MAX_BATCH", "Prepared", "TICK_S"]
