"""One round trip per worker tick: every streamed chunk and checkpoint a worker saves.

Each request that saves partial output (a streamed one, a checkpointed one: see :mod:`.checkpoints`)
has a :class:`~.checkpoints.Saver`, registered here while its generation runs. One loop, every
:data:`TICK_S`, asks each saver whether a save is due (a streamed request: ``stream_chunk_tokens``
new tokens, or any at the streams' shared timer, which beats every ``stream_chunk_ms``; a
checkpointed one: ``checkpoint_tokens`` and ``checkpoint_interval_s``, whichever later, at the
checkpoints' beat when it saves less often than :data:`SLOW_SAVE_S`) and writes all the due saves
in one pipeline, per hash tag (each call's keys share one, as Redis Cluster wants):

- the *consolidating* saves (a saver's first of a delivery, one every :data:`CONSOLIDATE_S`, a
  flush before a hand-back) in one ``checkpoint_many`` call: each appends to its checkpoint the
  parts saved since the last one and its own (a streamed one's also its chunk);
- the streamed parts in one ``save_parts`` call: each one field of the call's entry in its
  producer's chunk stream and one of its entry in the worker's parts stream, fenced (its readers
  see it at once);
- the other parts in one plain ``XADD`` to the worker's parts stream (a field each, with the
  consolidating saves' markers), which nothing reads before it is consolidated but a worker that
  continues the request, so it needs no fence (see :mod:`redroll.shared.checkpoint_reads`).

Saves that come between ticks (a drain's or a notice's flush of what the engine made) are
coalesced the same way: whatever is queued when the writer gets to it goes in one round trip.

Why a call per tag rather than one per save: a pipeline saves the round trips but not the work
Redis does per call (dispatching the function, reading the consumer's pending entries to fence
it, one reply each); one call reads each request stream's pending entries once for all its
saves, and readers blocked on the chunk streams are woken once, after it. Why parts: a save then
costs Redis no command of its own (a field of an entry), where an append to its checkpoint costs
two and the Lua around them. The fencing and the all-or-nothing rule stay per save (see
``checkpoint_many.lua``, ``save_parts.lua``).
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
from redroll.shared.checkpoint_saves import CheckpointSave, PartSave
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.scripts import call_replies, checkpoint_outcomes, checkpoint_refused, with_library
from redroll.shared.streams import id_tuple, text

if TYPE_CHECKING:
    from redroll.engine_worker.context import WorkerContext

log = logging.getLogger("redroll.worker")

CONSOLIDATE_S = 10.0
"""How long a part may be only in the worker's parts stream: a saver's first save of a delivery
consolidates (appends to the checkpoint key), and then one every this many seconds while it has
parts the key lacks (its flush before a hand-back too); every other save is a part only."""
PARTS_KEEP_S = 60
"""How long a live worker's parts stream keeps a part (each call trims it: MINID ~ now - this),
far beyond :data:`CONSOLIDATE_S`; a stream its worker no longer writes expires with the checkpoints'
TTL, so a dead worker's parts wait for the worker that continues its requests."""
CHECKPOINT_BEAT_S = 0.1
"""The checkpoints' beat: a checkpoint (not streamed) saved less often than every
:data:`SLOW_SAVE_S` is made at the next beat once it is due (a tenth of a second later at most),
so the slow savers of a worker save together, a few calls a second, not one call a tick for one or
two saves (each call costs Redis a fence read and an entry, whatever the number of its saves)."""
SLOW_SAVE_S = 0.4
"""See :data:`CHECKPOINT_BEAT_S` (a checkpoint saved more often does not wait for the beat)."""
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

    def due(self, now: float, beat: bool = False, checkpoint_beat: bool = True) -> "Prepared | None": ...

    def settle(self, prepared: "Prepared", outcome: Any) -> bool: ...


@dataclass
class Prepared:
    """A save a :class:`~.checkpoints.Saver` made ready: what to write, and what it settles."""

    saver: "Saver"
    save: CheckpointSave | None
    """A consolidating save: the checkpoint key's append (None: a part only)."""
    part: PartSave | None
    """The part, for the worker's parts stream (None: a consolidation of earlier parts alone)."""
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
        self._checkpoint_beat = 0.0
        """When the checkpoints' beat comes next (:data:`CHECKPOINT_BEAT_S` apart)."""
        self._has_savers = asyncio.Event()
        self._parts_clock: dict[str, int] = {}
        """Per parts stream, the server's time (ms) of this worker's last XADD there."""
        self.calls = 0
        """Round trips made (each one pipeline: per hash tag, its calls and its parts' XADD)."""
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
            checkpoint_beat = now >= self._checkpoint_beat
            if checkpoint_beat:
                self._checkpoint_beat = now + CHECKPOINT_BEAT_S
            due = []
            for saver in list(self.savers):
                try:
                    p = saver.due(now, beat, checkpoint_beat)
                except Exception as exc:  # (a defect in one request's save costs no other request its saves)
                    log.error("checkpoint of %s not made: %s", saver.request.request_id, exc, exc_info=exc)
                    saver.broken = True
                    continue
                if p is not None:
                    due.append(p)
            if due:
                await self.write(due)

    async def _flush(self, batch: list[tuple[Prepared, asyncio.Future]]) -> None:
        """One round trip: per hash tag, one checkpoint_many call for its consolidating saves, one
        save_parts call for its streamed parts and one XADD of its other parts (with the markers of
        the consolidations: see :func:`part_fields`) to the worker's parts stream; each save
        settled by its saver."""
        ctx = self.ctx
        by_tag: dict[str, list[int]] = {}
        for i, (p, _) in enumerate(batch):
            by_tag.setdefault(_tag_of(p.saver.flight.stream), []).append(i)
        calls: list[tuple[str, list[int], str | None]] = []  # (what was sent, the batch's items it has, its key)

        async def attempt() -> list:
            calls.clear()
            async with ctx.redis.pipeline(transaction=False) as pipe:
                for mine in by_tag.values():
                    self._queue_tag(pipe, [batch[i][0] for i in mine], mine, calls)
                replies = await pipe.execute(raise_on_error=False)
            functions = [k for k, (kind, _, _) in enumerate(calls) if kind in ("checkpoint_many", "save_parts")]
            checked = call_replies([replies[k] for k in functions],
                                   [checkpoint_refused(len(calls[k][1])) for k in functions])
            for k, reply in zip(functions, checked):
                replies[k] = reply
            return replies

        try:
            replies = await with_library(ctx.redis, attempt)
        except (redis.RedisError, OSError) as exc:
            # (a lost connection: nothing is known to be written; each saver tries again at its next
            # save, but a streamed part's, which its readers may have: see Saver.settle)
            log.warning("%d checkpoint(s) not saved: %s", len(batch), exc)
            for p, fut in batch:
                p.saver.settle(p, None)
                if not fut.done():
                    fut.set_result(False)
            return
        # Each save's outcome: the first of its writes that did not take (else saved)
        outcomes: dict[int, tuple[int, int | str]] = {}
        for (kind, items, key), reply in zip(calls, replies):
            if kind in ("checkpoint_many", "save_parts"):
                got = checkpoint_outcomes(reply)
            elif kind == "xadd":
                refused = isinstance(reply, Exception)
                got = [(2, str(reply)) if refused else (1, 0)] * len(items)
                if not refused and key is not None:
                    self._parts_clock[key] = id_tuple(text(reply))[0]
            else:
                continue
            for i, outcome in zip(items, got):
                if i not in outcomes or outcomes[i][0] == 1:
                    outcomes[i] = outcome
        self.calls += 1
        cleared = []
        for i, (p, fut) in enumerate(batch):
            ok = p.saver.settle(p, outcomes.get(i))
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

    def _parts_key(self, prepared: Prepared) -> str:
        return self.ctx.part_of[prepared.saver.flight.stream].parts(self.ctx.name)

    def _queue_tag(self, pipe: Any, group: list[Prepared], at: list[int], calls: list) -> None:
        """Queue the writes of one hash tag's saves (``group``, whose places in the batch are ``at``)."""
        ctx = self.ctx
        saves = [k for k, p in enumerate(group) if p.save is not None]
        streamed = [k for k, p in enumerate(group) if p.save is None and p.part is not None and p.part.chunks_key]
        if saves:
            ctx.scripts.checkpoint_many_in(pipe, group=WORKERS_GROUP, consumer=ctx.name,
                                           saves=[group[k].save for k in saves], ttl_s=ctx.settings.rid_ttl_s,
                                           chunks_ttl_s=ctx.settings.stream_chunk_ttl_s)
            calls.append(("checkpoint_many", [at[k] for k in saves], None))
        parts_key = self._parts_key(group[0])
        if streamed:
            ctx.scripts.save_parts_in(pipe, group=WORKERS_GROUP, consumer=ctx.name, parts_key=parts_key,
                                      parts=[group[k].part for k in streamed], keep_ms=PARTS_KEEP_S * 1000,
                                      parts_ttl_s=ctx.settings.rid_ttl_s, chunks_ttl_s=ctx.settings.stream_chunk_ttl_s)
            calls.append(("save_parts", [at[k] for k in streamed], parts_key))
        plain = [k for k, p in enumerate(group) if p.save is None and p.part is not None and not p.part.chunks_key]
        fields = part_fields([group[k] for k in plain] + [group[k] for k in saves if group[k].part is not None])
        if fields:
            # (trimmed by the server's clock: as of this worker's last XADD there, which it answered)
            clock = self._parts_clock.get(parts_key)
            pipe.xadd(parts_key, fields, minid=None if clock is None else max(0, clock - PARTS_KEEP_S * 1000),
                      approximate=True)
            calls.append(("xadd", [at[k] for k in plain], parts_key))
            pipe.expire(parts_key, ctx.settings.rid_ttl_s)
            calls.append(("expire", [], parts_key))


def part_fields(prepared: list[Prepared]) -> dict[str, bytes]:
    """A plain XADD's fields: per part ``<entry id> <request_id> <tokens before it> <tokens in it>``
    and the part; a consolidating save's part is a marker (its field, no bytes): where a reader of
    the stream, going back from its end, stops (:func:`~redroll.shared.checkpoint_reads.read_later_parts`)."""
    fields = {}
    for p in prepared:
        part = p.part
        fields[f"{part.entry_id} {part.request_id} {part.before} {part.adding}"] = b"" if p.save else part.part
    return fields


def _tag_of(key: str) -> str:
    """The hash tag of ``key`` (``{ns}`` or ``{ns:i}``): the saves of one call share it."""
    return key[: key.index("}") + 1] if key.startswith("{") and "}" in key else key


__all__ = ["CHECKPOINT_BEAT_S", "CONSOLIDATE_S", "CheckpointWriter", "MAX_BATCH", "PARTS_KEEP_S", "Prepared",
           "SLOW_SAVE_S", "TICK_S"]
