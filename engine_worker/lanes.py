"""Affinity lanes: which lanes this worker owns, and claiming from them.

With ``affinity_lanes`` L > 0 a request with an affinity key queues on lane
``lane_index(key, L)`` of its partition (see :func:`redroll.shared.keys.lane_index`). Every worker
works out the same owner for every lane, with no coordinator, from the list of the workers that
are claiming (state ``running``; a dead, paused, draining, blocked or weight-waiting worker drops
out within a few heartbeats, and an in-place weight update does not count as paused):
consistent hashing with bounded loads (:mod:`.lane_plan`). A disagreement for a beat (two workers
that saw different lists) only costs affinity: the consumer group still hands each entry to one
worker, and the fenced finish still publishes it once.

The lane table. A worker does not read the other workers' heartbeats to learn the list: its
heartbeat is one function call (``lanes_beat.lua``) that also keeps, in Redis, the claiming
workers with the server time of their last beat, the set of those whose last beat said they had
no free slot, and the published member list with its epoch (a join or a leave publishes a new list
at the next beat at least :attr:`LaneTable.settle_ms` after the last: a starting fleet makes a few
lists, not one per worker); the call answers with the epoch, the members whose beat is late, the
full ones (to a worker with room: it may steal), and the list itself only when the caller's epoch
is out of date. An idle fleet's heartbeats therefore cost Redis the same per worker whatever its
size, where each used to read every other worker's beat (workers x workers) and compute ownership
from L scores per worker (workers x lanes).

Claiming. A worker claims, in one atomic script (``claim_lanes.lua``), the high-priority stream,
its own lanes, the shared stream, and then entries of other lanes that have waited longer than
``steal_after_ms`` or lie deep in a lane, in whole runs of one key where it can (see the script).
With nothing there it blocks on the streams it reads first (:class:`.blocking.BlockingRead`),
which any new entry there ends, and which its heartbeat cuts short when its lanes change. Which
other lanes it scans (:attr:`LaneTable.scanned`): those of owners that are full (their last beat
said no free slot, or their claim loop had not turned for a while: :meth:`LaneClaimer.healthy`),
of no owner, and those of late owners (no beat for :attr:`LaneTable.late_ms`: gone, or hung) whose
heir it is (the first worker after the late owner on the ring: :func:`.lane_plan.lane_heirs`); it
scans them once per ``steal_after_ms`` while there are any. An owner with room takes its lanes'
entries itself at once (it blocks on them), so their lanes need nobody else's scans: an idle
fleet runs no scan at all. A full or stuck owner costs an entry on its lanes at most about 2 x
``steal_after_ms`` once its next beat says so; a dead or hung one about that plus three heartbeats
(two until it is late, one until its heir's beat says so).

A worker's reclaim passes (``XPENDING … IDLE``) look at the lanes it owns and those of no owner
(:meth:`LaneTable.reclaim_streams`): a dead worker drops out of the lane table within a few
heartbeats, long before an entry it held is ``claim_idle`` old, and its lanes' new owners take
back what it held.

Fair claiming (see :mod:`.claim`) holds here too: every claim, from the worker's own lanes, the
shared stream or a steal, takes at most what its engine can start now plus ``claim_prefetch``, and
a worker counts as having room in the lane table only below that bound. The entries of a hot
lane beyond it wait in the lane, where workers with room steal them after ``steal_after_ms``, or
at once when they lie beyond ``STEAL_DEPTH_FACTOR`` x the claim limit: a burst on one key costs
the owner's prefix cache some hits, not a queue inside one engine.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Awaitable, Callable

from redroll.engine_worker.blocking import BlockingRead
from redroll.engine_worker.context import WorkerContext
from redroll.engine_worker.flights import Flights
from redroll.engine_worker.lane_plan import Plan, lane_heirs, lane_plan
from redroll.shared.keys import WORKERS_GROUP, Keys
from redroll.shared.lanes import stream_backlog
from redroll.shared.streams import ensure_groups, script_fields, text

log = logging.getLogger("redroll.worker")

CLAIMING_STATES = ("running",)
"""Heartbeat states of a worker that owns lanes."""

STEAL_DEPTH_FACTOR = 2
"""A worker with free slots also takes from another worker's lane what lies beyond the first
``STEAL_DEPTH_FACTOR x claim limit`` undelivered entries (the claim limit: ``Flights.claim_limit``)
(that owner cannot start them soon: a hot key), without waiting ``steal_after_ms``; a steal ends at
the end of one key's run where it can."""


def has_room(beat: dict[str, Any] | None) -> bool:
    """Whether a worker's heartbeat says it had a free slot (False when it does not say): ``room``
    where it says so, else fewer entries in flight than its claim limit (``claim_limit``;
    ``max_inflight`` in an older beat)."""
    try:
        if "room" in beat:  # type: ignore[operator]
            return bool(beat["room"])  # type: ignore[index]
        return int(beat["inflight"]) < int(beat.get("claim_limit", beat["max_inflight"]))  # type: ignore[union-attr]
    except (KeyError, TypeError, ValueError):
        return False


class LaneTable:
    """This worker's view of the lanes: their owners, and which owners are full or late."""

    def __init__(self, ctx: WorkerContext, *, interval_s: float | None = None):
        self.ctx = ctx
        self.lanes = ctx.settings.affinity_lanes
        self.plan: Plan = lane_plan([], self.lanes)
        self.owners: list[str | None] = [None] * self.lanes
        self.owned: list[int] = []
        """The lanes this worker owns."""
        self.scanned: list[int] = list(range(self.lanes))
        """The other lanes this worker's steal scans look at (every lane until the first beat)."""
        self.reclaimed: list[int] = list(range(self.lanes))
        """The lanes this worker's reclaim passes look at: those it owns, and any with no owner
        (every lane until the first beat)."""
        self.epoch: int | None = None
        """The lane table's epoch this view was computed for (None: none yet)."""
        self.members: list[str] = []
        """The published member list the owners were computed from."""
        self.late: set[str] = set()
        self.full: set[str] = set()
        interval = interval_s if interval_s is not None else ctx.settings.heartbeat_s
        self.stale_ms = int(1000 * max(3 * interval, 1.0))
        """A member whose last beat is older than this is dropped from the table (its lanes move)."""
        self.late_ms = int(1000 * max(2 * interval, 0.5))
        """A member whose last beat is older than this is late: its lanes' heirs scan them."""
        self.settle_ms = int(1000 * interval / 2)
        """The member list is published at most this often (a burst of joins makes one new list)."""
        self.on_change: Callable[[], Awaitable[None]] | None = None
        """Called when the lanes this worker owns or scans changed (the claim loops' reads end)."""

    async def beat(self, beat: dict[str, Any], room: bool) -> None:
        """Write this worker's heartbeat and its entry in the lane table, and bring this view up to date."""
        ctx = self.ctx
        claiming = beat["state"] in CLAIMING_STATES
        epoch, late, full, members = await ctx.scripts.lanes_beat(
            ctx.keys, ctx.name, json.dumps(beat, separators=(",", ":")), claiming=claiming, room=room,
            late_ms=self.late_ms, stale_ms=self.stale_ms, settle_ms=self.settle_ms, epoch=self.epoch)
        if ctx.metrics is not None:
            ctx.stats.queued = await self.queued()
        before = set(self.owned)
        self.update(epoch, members, late, full)
        gained = [part.lane(j) for part in ctx.parts for j in self.owned if j not in before]
        if gained:  # (its owner makes a lane's group: a lane's entries wait for their owner anyway)
            await ensure_groups(ctx.redis, gained, WORKERS_GROUP)
        # (the claim loops' reads are on streams chosen with the previous view: ended when it matters)
        if self._changed and self.on_change is not None:
            await self.on_change()

    def update(self, epoch: int, members: list[str] | None, late: list[str], full: list[str]) -> None:
        """Take the lane table's answer (:meth:`beat`): new owners when the epoch changed."""
        before = (self.owned, self.scanned)
        me = self.ctx.name
        if members is not None:
            plan = lane_plan(members, self.lanes)
            if plan.owners != self.plan.owners:
                log.info("affinity lanes: %d worker(s) claiming; this one owns %s", len(set(members)),
                         list(plan.by_owner.get(me, ())) or "none")
            self.plan, self.members = plan, list(members)
            self.owners = list(plan.owners)
            self.owned = list(plan.by_owner.get(me, ()))
        self.epoch = epoch
        self.late, self.full = set(late) - {me}, set(full) - {me}
        # A late owner's lanes are looked after by their heir: the first worker after it on the
        # ring that is not late (usually the one that gets the lane once the late one is dropped);
        # the others leave them alone.
        orphaned = self.plan.lanes_of(self.late)
        heirs = lane_heirs(self.members, self.lanes, self.late, orphaned) if orphaned else {}
        unowned = list(self.plan.by_owner.get(None, ()))
        self.scanned = sorted([*self.plan.lanes_of(self.full), *(j for j, h in heirs.items() if h == me), *unowned])
        self.reclaimed = sorted([*self.owned, *unowned])
        self._changed = (self.owned, self.scanned) != before

    _changed = False

    async def leave(self) -> None:
        """Deregister: the heartbeat deleted, out of the lane table (its lanes move at the next publication)."""
        ctx = self.ctx
        await ctx.scripts.lanes_beat(ctx.keys, ctx.name, "", claiming=False, room=False, late_ms=self.late_ms,
                                     stale_ms=self.stale_ms, settle_ms=self.settle_ms, epoch=self.epoch)

    def reclaim_streams(self) -> list[str]:
        """The request streams a reclaim pass looks at: the worker's request streams, in their
        claiming order, less the lanes that are not in :attr:`reclaimed`."""
        parts = self.ctx.parts
        return [*(k.requests_high for k in parts), *(k.lane(j) for k in parts for j in self.reclaimed),
                *(k.requests for k in parts)]

    async def queued(self) -> int:
        """Entries not yet delivered to group ``workers`` in this worker's request streams."""
        total = 0
        for stream in self.ctx.request_streams:
            total += sum(b["backlog"] for b in await stream_backlog(self.ctx.redis, stream))
        return total


class LaneClaimer:
    """The claim loop with affinity lanes (the plain layout keeps :class:`.claim.Claimer`'s)."""

    def __init__(self, ctx: WorkerContext, flights: Flights, table: LaneTable, give_back: Any,
                 block_ms: int | None = None):
        self.ctx = ctx
        self.flights = flights
        self.table = table
        self._give_back = give_back
        """``Claimer._give_back``: entries read after a stop began go straight back."""
        self._block_ms = block_ms
        self.readers: list[BlockingRead] = []
        self._progress: dict[int, float] = {}
        """Per claim loop: when it last began a turn or a read (monotonic)."""
        table.on_change = self.interrupt

    def loop_for(self, parts: list[Keys], loops: int) -> Any:
        reader = BlockingRead(self.ctx.redis, WORKERS_GROUP, self.ctx.name, block_ms=self._block_ms)
        self.readers.append(reader)
        index = len(self.readers) - 1

        async def claim_loop() -> None:
            await self._claim_loop(parts, loops, reader, index)
        return claim_loop

    async def interrupt(self) -> None:
        """End the claim loops' reads now (a stop, or their streams changed)."""
        for reader in self.readers:
            await reader.interrupt()

    def healthy(self) -> bool:
        """Whether every claim loop turned, or began a read, recently enough (within its longest
        wait and a few seconds): one that did not is stuck, and its lanes are the others' to scan."""
        now = time.monotonic()
        limit = max((r.block_ms for r in self.readers), default=0) / 1000.0 + 5.0
        return all(now - t <= limit for t in self._progress.values())

    async def _claim_loop(self, parts: list[Keys], loops: int, reader: BlockingRead, index: int) -> None:
        ctx, flights, table = self.ctx, self.flights, self.table
        steal_s = ctx.settings.steal_after_ms / 1000.0
        look = True
        """Claim (the script) before waiting: at the start, and after a turn that brought entries."""
        scan_due = 0.0
        while not ctx.stopping.is_set():
            self._progress[index] = time.monotonic()
            await flights.wait_for_slot()
            if ctx.stopping.is_set():
                return
            free = -(-flights.free_to_claim // loops)
            got: list[tuple[str, str, dict, str]] = []
            now = time.monotonic()
            scanning = bool(table.scanned)
            if look or (scanning and now >= scan_due):
                for part in parts:
                    if free - len(got) > 0:
                        got += await self._claim_from(part, free - len(got), scanning)
                if scanning:
                    scan_due = now + steal_s
            if not got:
                # Nothing now: block on the streams this worker reads first (one entry each at most)
                # until an entry comes, the next steal scan is due, or the heartbeat ends the read
                # (its lanes changed, or there are lanes to scan now).
                owned = table.owned
                streams = [s for part in parts for s in (part.requests_high, *(part.lane(j) for j in owned),
                                                         part.requests)]
                wait_ms = None
                if table.scanned:
                    wait_ms = max(1, min(reader.block_ms, int(1000 * (scan_due - time.monotonic()))))
                if ctx.stopping.is_set():
                    return
                self._progress[index] = time.monotonic()
                # (A read issued just before an ownership change may still take one entry from a
                # lane that moved: costing only affinity.)
                resp = await reader.read(streams, 1, wait_ms)
                got = [(s, i, f, "woken") for s, es in resp for i, f in es]
            look = bool(got)
            if ctx.stopping.is_set():
                ctx.stats.claimed += len(got)
                await self._give_back([(s, i) for s, i, _, _ in got])
                return
            kinds = ctx.stats.claims_by_kind
            for _, _, _, kind in got:
                kinds[kind] = kinds.get(kind, 0) + 1
            ctx.stats.claimed += len(got)
            flights.add_claimed([(stream, entry_id, ctx.flight_key(stream, entry_id), fields)
                                 for stream, entry_id, fields, _ in got])

    async def _claim_from(self, part: Keys, budget: int, scanning: bool) -> list[tuple[str, str, dict, str]]:
        ctx = self.ctx
        others = [part.lane(j) for j in self.table.scanned] if scanning else []
        got = await ctx.scripts.claim_lanes(
            high=part.requests_high, own=[part.lane(j) for j in self.table.owned], shared=part.requests,
            others=others, group=WORKERS_GROUP, consumer=ctx.name, budget=budget,
            steal_after_ms=ctx.settings.steal_after_ms, steal_depth=STEAL_DEPTH_FACTOR * self.flights.claim_limit)
        return [(stream, text(entry_id), script_fields(flat), kind)
                for stream, kind, entries in got for entry_id, flat in entries]
