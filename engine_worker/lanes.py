"""Affinity lanes: which lanes this worker owns, and claiming from them.

With ``affinity_lanes`` L > 0 a request with an affinity key queues on lane
``lane_index(key, L)`` of its partition (see :func:`redroll.shared.keys.lane_index`). Every worker
works out the same owner for every lane from the heartbeat hash, with no coordinator: capped
rendezvous hashing over the workers that are claiming (state ``running``; a dead, paused, draining,
blocked or weight-waiting worker drops out within a few heartbeats, and an in-place weight update
does not count as paused). A disagreement for a beat (two workers that saw different heartbeats)
only costs affinity: the consumer group still hands each entry to one worker, and the fenced
finish still publishes it once.

A worker claims, in one atomic script (``claim_lanes.lua``), the high-priority stream, its own
lanes, the shared stream, and then entries of other lanes that have waited longer than
``steal_after_ms`` or lie deep in a lane, in whole runs of one key where it can (see the script),
so an owner that is busy, slow or just dead costs a queued entry about twice that wait at most.

Which other lanes a worker's steal scans look at (:attr:`LaneTable.scanned`): every lane whose
owner had no free slot at its last heartbeat (or whose beat does not say), and, of the lanes whose
owner had room, only those it watches: each lane's first :data:`WATCHERS` workers after its owner
in the lane's rendezvous order. An owner with room takes its own lanes' entries at once (it blocks
on them), so those lanes need only a few lookers in case it stops or fills up between two beats;
with every worker scanning every lane, an idle fleet's scans grew with workers x lanes.

For the same reason a worker's reclaim passes (``XPENDING … IDLE``) look at the lanes it owns or
watches, not at all of them (:meth:`LaneTable.reclaim_streams`): every lane still has its owner and
its watchers among the claiming workers, and a dead one drops out of every lane's plan within a
few heartbeats, long before an entry it held is ``claim_idle`` old.

Fair claiming (see :mod:`.claim`) holds here too: every claim, from the worker's own lanes, the
shared stream or a steal, takes at most what its engine can start now plus ``claim_prefetch``, and
a worker counts as having room in the heartbeat (:func:`has_room`) only below that bound. The
entries of a hot lane beyond it wait in the lane, where the workers that scan it steal them after
``steal_after_ms``, or at once when they lie beyond ``STEAL_DEPTH_FACTOR`` x the claim limit: a
burst on one key costs the owner's prefix cache some hits, not a queue inside one engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any, Callable, Iterable

from redroll.engine_worker.context import WorkerContext
from redroll.engine_worker.flights import Flights
from redroll.shared.keys import WORKERS_GROUP, Keys
from redroll.shared.lanes import stream_backlog
from redroll.shared.streams import read_group, script_fields, text

log = logging.getLogger("redroll.worker")

CLAIMING_STATES = ("running",)

STEAL_DEPTH_FACTOR = 2
"""A worker with free slots also takes from another worker's lane what lies beyond the first
``STEAL_DEPTH_FACTOR x claim limit`` undelivered entries (the claim limit: ``Flights.claim_limit``) (that owner cannot start them soon: a hot
key), without waiting ``steal_after_ms``; a steal ends at the end of one key's run where it can."""
"""Heartbeat states of a worker that owns lanes."""

WATCHERS = 3
"""Besides its owner, the workers whose steal scans look at a lane while its owner has free slots:
the first ``WATCHERS`` others in the lane's rendezvous order (all the others in a smaller fleet)."""


def _score(worker: str, lane: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{worker}|{lane}".encode(), digest_size=8).digest(), "big")


def lane_scores(worker: str, lanes: int) -> list[int]:
    """``worker``'s rendezvous score for each lane (fixed for a name: :class:`LaneTable` keeps them)."""
    return [_score(worker, lane) for lane in range(lanes)]


def lane_plan(workers: Iterable[str], lanes: int, watchers: int = WATCHERS,
              scores: Callable[[str], list[int]] | None = None) -> tuple[list[str | None], list[list[str]]]:
    """The owner and the watchers of each lane, the same on every worker given the same set.

    Owners: capped rendezvous hashing (each lane goes to its highest-scoring worker that holds
    fewer than ceil(L / W) lanes). Watchers: the lane's first ``watchers`` other workers by score.
    ``scores`` gives a worker's :func:`lane_scores` (kept between calls, so that a refresh of a
    fleet of hundreds hashes only its new names)."""
    names = sorted(set(workers))
    if not names:
        return [None] * lanes, [[] for _ in range(lanes)]
    rows = [scores(w) if scores is not None else lane_scores(w, lanes) for w in names]
    cap = -(-lanes // len(names))
    load = [0] * len(names)
    owners: list[str | None] = []
    watching: list[list[str]] = []
    for column in zip(*rows):  # one lane: each worker's score
        order = sorted(range(len(names)), key=column.__getitem__, reverse=True)
        owner = next(i for i in order if load[i] < cap)
        load[owner] += 1
        owners.append(names[owner])
        watching.append([names[i] for i in order[:watchers + 1] if i != owner][:watchers])
    return owners, watching


def has_room(beat: dict[str, Any] | None) -> bool:
    """Whether a worker's heartbeat says it had a free slot (False when it does not say): fewer
    entries in flight than its claim limit (``claim_limit``; ``max_inflight`` in an older beat)."""
    try:
        return int(beat["inflight"]) < int(beat.get("claim_limit", beat["max_inflight"]))  # type: ignore[union-attr]
    except (KeyError, TypeError, ValueError):
        return False


def claiming_workers(beats: dict[str, dict[str, Any]], now: float, stale_after_s: float) -> list[str]:
    """Workers whose heartbeat is fresh and says they are claiming."""
    return [name for name, beat in beats.items()
            if beat.get("state") in CLAIMING_STATES and now - float(beat.get("seen", 0)) <= stale_after_s]


class LaneTable:
    """This worker's view of lane ownership, refreshed with every heartbeat."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.lanes = ctx.settings.affinity_lanes
        self.owners: list[str | None] = [None] * self.lanes
        self.scanned: list[int] = list(range(self.lanes))
        """The other lanes this worker's steal scans look at (see the module's docstring)."""
        self.reclaimed: list[int] = list(range(self.lanes))
        """The lanes this worker's reclaim passes look at: those it owns or watches, and any lane
        with no owner (every lane until the first refresh)."""
        self._scores: dict[str, list[int]] = {}
        """Each claiming worker's :func:`lane_scores` (a name's never change)."""
        self.stale_after_s = max(3 * ctx.settings.heartbeat_s, 1.0)

    @property
    def owned(self) -> list[int]:
        return [j for j, owner in enumerate(self.owners) if owner == self.ctx.name]

    async def refresh(self, my_state: str) -> None:
        raw = await self.ctx.redis.hgetall(self.ctx.keys.workers)
        beats = {}
        for name, value in raw.items():
            try:
                beats[text(name)] = json.loads(value)
            except ValueError:
                continue
        claiming = set(claiming_workers(beats, time.time(), self.stale_after_s))
        # Its own state counts as it is now (its last heartbeat may say otherwise).
        (claiming.add if my_state in CLAIMING_STATES else claiming.discard)(self.ctx.name)
        if self.ctx.metrics is not None:
            self.ctx.stats.queued = await self.queued()
        self._scores = {name: self._scores.get(name) or lane_scores(name, self.lanes) for name in claiming}
        owners, watchers = lane_plan(claiming, self.lanes, scores=self._scores.__getitem__)
        if owners != self.owners:
            mine = [j for j, o in enumerate(owners) if o == self.ctx.name]
            log.info("affinity lanes: %d worker(s) claiming; this one owns %s", len(claiming), mine or "none")
        self.owners = owners
        me = self.ctx.name
        with_room = {name for name in claiming if name != me and has_room(beats.get(name))}
        self.scanned = [j for j, owner in enumerate(owners)
                        if owner != me and (owner not in with_room or me in watchers[j])]
        self.reclaimed = [j for j, owner in enumerate(owners) if owner in (None, me) or me in watchers[j]]

    def reclaim_streams(self) -> list[str]:
        """The request streams a reclaim pass looks at: the worker's request streams, in their
        claiming order, less the lanes that are not in :attr:`reclaimed`."""
        reclaimed = set(self.reclaimed)
        skipped = {s for k in self.ctx.parts for j, s in enumerate(k.lane_streams) if j not in reclaimed}
        return [s for s in self.ctx.request_streams if s not in skipped]


    async def queued(self) -> int:
        """Entries not yet delivered to group ``workers`` in this worker's request streams."""
        total = 0
        for stream in self.ctx.request_streams:
            total += sum(b["backlog"] for b in await stream_backlog(self.ctx.redis, stream))
        return total


class LaneClaimer:
    """The claim loop with affinity lanes (the plain layout keeps :class:`.claim.Claimer`'s)."""

    def __init__(self, ctx: WorkerContext, flights: Flights, table: LaneTable, give_back: Any):
        self.ctx = ctx
        self.flights = flights
        self.table = table
        self._give_back = give_back
        """``Claimer._give_back``: entries read after a stop began go straight back."""

    def loop_for(self, parts: list[Keys], loops: int) -> Any:
        async def claim_loop() -> None:
            await self._claim_loop(parts, loops)
        return claim_loop

    async def _claim_loop(self, parts: list[Keys], loops: int) -> None:
        ctx, flights = self.ctx, self.flights
        # Wake for a new entry in a stream this worker reads first; the lanes it scans are looked
        # at again at least once per steal wait, so an entry there is stolen within about twice
        # that wait, and an idle fleet scans each lane about WATCHERS times per steal wait.
        block_ms = max(1, min(ctx.block_ms, ctx.settings.steal_after_ms))
        while not ctx.stopping.is_set():
            await flights.wait_for_slot()
            if ctx.stopping.is_set():
                return
            free = -(-flights.free_to_claim // loops)
            got: list[tuple[str, str, dict, str]] = []
            for part in parts:
                if free - len(got) > 0:
                    got += await self._claim_from(part, free - len(got))
            if not got:
                # Nothing now: block on the streams this worker reads first (one entry each at most).
                owned = self.table.owned
                streams = [s for part in parts for s in (part.requests_high, *(part.lane(j) for j in owned),
                                                         part.requests)]
                # (A read issued just before an ownership change may still take one entry from a
                # lane that moved: at most one per block_ms after a change, costing only affinity.)
                resp = await read_group(ctx.redis, WORKERS_GROUP, ctx.name, streams, count=1, block=block_ms)
                got = [(s, i, f, "woken") for s, es in resp for i, f in es]
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

    async def _claim_from(self, part: Keys, budget: int) -> list[tuple[str, str, dict, str]]:
        ctx = self.ctx
        got = await ctx.scripts.claim_lanes(
            high=part.requests_high, own=[part.lane(j) for j in self.table.owned], shared=part.requests,
            others=[part.lane(j) for j in self.table.scanned], group=WORKERS_GROUP,
            consumer=ctx.name, budget=budget, steal_after_ms=ctx.settings.steal_after_ms,
            steal_depth=STEAL_DEPTH_FACTOR * self.flights.claim_limit)
        return [(stream, text(entry_id), script_fields(flat), kind)
                for stream, kind, entries in got for entry_id, flat in entries]
