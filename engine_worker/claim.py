"""Claiming new entries (XREADGROUP) and reclaiming idle ones from dead or paused workers.

Fair claiming: a worker claims no more than its engine can start now plus ``claim_prefetch``
(:func:`claim_limit`): it holds at most ``min(capacity + claim_prefetch, max_inflight)`` entries
that take or wait for an engine slot (``Flights.claim_limit``), so a burst that comes while several
workers are idle spreads over them instead of queueing inside the engine of the first to wake, and
the entries it cannot start stay in the stream for the others. Under steady load the engine stays
full: the prefetched entries take the slots that finishes free, and the claim loop refills the
rest as soon as they are free. Reclaimed entries (hand-backs, a dead worker's) count against the
same bound. With affinity lanes (:mod:`.lanes`) the same bound applies to what a worker takes from
its own lanes, the shared stream and steals: a hot lane's entries beyond it stay in the lane, where
other workers with free slots steal them after ``steal_after_ms``, or at once beyond the steal
depth (``STEAL_DEPTH_FACTOR`` x the claim limit).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import redis

from redroll.engine_worker.blocking import BlockingRead
from redroll.engine_worker.context import WorkerContext
from redroll.engine_worker.flights import DEATHS_SUFFIX, Flights, InFlight
from redroll.engine_worker.outcomes import hand_back_entries, uncounted_runs
from redroll.shared.events import Delivery
from redroll.shared.keys import WORKERS_GROUP, Keys
from redroll.shared.streams import read_group, script_fields, text

log = logging.getLogger("redroll.worker")

def deaths_field(flight_key: str) -> str:
    return flight_key + DEATHS_SUFFIX


def parse_deaths(raw: Any) -> tuple[int, int, int | None, bool, str | None]:
    """A death note ``"<deaths witnessed> <of them alone> <group cap> <1: alone at the last> <the
    consumer whose death it counts last>"``; no note: ``(0, 0, None, False, None)``."""
    try:
        deaths, alone, cap, last_alone, owner = text(raw).split(" ", 4)
        return int(deaths), int(alone), max(1, int(cap)), last_alone == "1", owner
    except (TypeError, ValueError, AttributeError):
        return 0, 0, None, False, None


@dataclass
class _Plan:
    """A suspect to take back (``recovery_split`` "halving")."""

    stream: str
    entry_id: str
    retry: int
    """Its delivery count once claimed (XCLAIM RETRYCOUNT)."""
    cap: int
    """The most suspects it may run with on one worker."""
    condemned: str | None = None
    group_deaths: int = 0
    """Deaths it witnessed in a group (not in its delivery count)."""
    owner: str | None = None
    """The consumer that died holding it."""


DEFAULT_MAX_INFLIGHT = 32
"""``max_inflight`` when the engine declares no capacity (None: it runs whatever it is given)."""


def engine_capacity(engine: Any) -> int | None:
    """The engine's declared ``capacity`` (:class:`~redroll.engine_worker.engines.base.Engine`):
    requests it runs at once, read once it started; None for an engine that runs whatever it is
    given. Anything else is a defect of the engine, said at start."""
    if not hasattr(engine, "capacity"):
        raise TypeError(f"{type(engine).__name__} declares no capacity (the Engine contract: an int, or None "
                        "for an engine that runs whatever it is given)")
    capacity = engine.capacity
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1):
        raise TypeError(f"{type(engine).__name__}.capacity is {capacity!r}: a positive int, or None")
    return capacity


def default_max_inflight(capacity: int | None, prefetch: int) -> int:
    """``--max-inflight`` when not given: what the engine runs at once plus the claim prefetch
    (:data:`DEFAULT_MAX_INFLIGHT` for an engine that declares no capacity)."""
    return DEFAULT_MAX_INFLIGHT if capacity is None else capacity + max(0, int(prefetch))


def claim_limit(capacity: int | None, max_inflight: int, prefetch: int) -> int:
    """The most entries a worker holds that take or wait for an engine slot: what the engine can
    run at once plus ``prefetch`` (the ``claim_prefetch`` setting), at most ``max_inflight``;
    ``max_inflight`` when the engine declares no capacity."""
    max_inflight = max(1, int(max_inflight))
    if capacity is None:
        return max_inflight
    return max(1, min(max_inflight, capacity + max(0, int(prefetch))))


class Claimer:
    def __init__(self, ctx: WorkerContext, flights: Flights, *, reclaim_interval_s: float,
                 reclaim_streams: Callable[[], list[str]] | None = None, block_ms: int | None = None):
        self.ctx = ctx
        self.flights = flights
        self.reclaim_interval_s = reclaim_interval_s
        self.reclaim_streams = reclaim_streams or (lambda: ctx.request_streams)
        """The request streams a reclaim pass looks at (with affinity lanes: ``LaneTable.reclaim_streams``)."""
        self._attempts = 0
        """Suspects taken back by this process (their engine handles stay unique)."""
        self._woken = asyncio.Event()
        self._handbacks_waiting = False
        """The last pass left hand-backs for want of a free slot here."""
        self._block_ms = block_ms
        self.readers: list[BlockingRead] = []
        """Each claim loop's blocking read (:meth:`interrupt` ends them)."""

    async def interrupt(self) -> None:
        """End the claim loops' blocking reads now (the worker stops)."""
        for reader in self.readers:
            await reader.interrupt()


    # ------------------------------------------------------------ new entries

    def loop_for(self, parts: list[Keys], loops: int) -> Any:
        """The claim loop over ``parts``; with ``loops`` loops at once each reads a share of the
        free slots, so together they take at most about one batch more than there is room for
        (the surplus waits, leased, for a slot)."""
        reader = BlockingRead(self.ctx.redis, WORKERS_GROUP, self.ctx.name, block_ms=self._block_ms)
        self.readers.append(reader)

        async def claim_loop() -> None:
            await self._claim_loop(parts, loops, reader)
        return claim_loop

    async def _claim_loop(self, parts: list[Keys], loops: int, reader: BlockingRead) -> None:
        ctx, flights = self.ctx, self.flights
        highs = [k.requests_high for k in parts]
        streams = [*highs, *(k.requests for k in parts)]
        plain = False
        """Claim with one plain XREADGROUP (see below): with one partition, once a claim found no
        high-priority entry."""
        waited = False
        """The last turn's blocking read ended with nothing: the next turn blocks again at once (a
        blocking read returns at once what is there), without a read that would find nothing."""
        while not ctx.stopping.is_set():
            await flights.wait_for_slot()
            if ctx.stopping.is_set():
                return
            free = -(-flights.free_to_claim // loops)
            refused: list[str] = []
            claimed: list[tuple[str, str, Any]] = []
            if waited:
                pass  # (the blocking read below returns at once whatever came since the last one ended)
            elif plain:
                # One XREADGROUP over the high-priority and the request stream. COUNT applies per
                # stream, so it reads beyond the free slots only as many normal entries as
                # high-priority ones arrived since the last claim found none; those wait, held
                # back (below). claim.lua moves every entry it reads through Lua and back (about 7
                # µs of Redis's CPU an entry) for a budget only high-priority traffic needs.
                claimed = await self._read(streams, free)
            else:
                # One round trip while there is work (claim.lua): high priority first, then the
                # request streams, nothing read beyond the free slots.
                got, refused = await ctx.scripts.claim(streams=streams, group=WORKERS_GROUP, consumer=ctx.name,
                                                       budget=free)
                claimed = [(stream, text(entry_id), script_fields(flat))
                           for stream, entries in got for entry_id, flat in entries]
            # Either goes out just before the finishes of the batch that freed the slots, so Redis
            # answers it first and the worker runs the next batch while Redis stores those records.
            # With nothing there, block on every request stream.
            waited = False
            if not claimed and not refused:
                if ctx.stopping.is_set():
                    return
                claimed = [(stream, entry_id, fields) for stream, entries in await reader.read(streams, free)
                           for entry_id, fields in entries]
                waited = not claimed
            if ctx.stopping.is_set():
                # The read was already blocking when the stop came: what it brought goes back to
                # the fleet at once, never into the engine.
                ctx.stats.claimed += len(claimed)
                await self._give_back([(stream, entry_id) for stream, entry_id, _ in claimed])
                return
            ctx.stats.claimed += len(claimed)
            high = sum(1 for stream, _, _ in claimed if stream in highs)  # (they come first)
            if not high:
                flights.release_held()  # (read before these: they go first)
            entries = [(stream, entry_id, ctx.flight_key(stream, entry_id), fields) for stream, entry_id, fields in claimed]
            if high and len(entries) > free:  # normal entries read beside high-priority ones, beyond the slots
                flights.add_claimed(entries[:free])
                flights.hold_back(entries[free:])
            else:
                flights.add_claimed(entries)
            plain = len(parts) == 1 and not high and not refused
            if refused:  # (after the entries read: those run) NOGROUP makes the caller recreate the groups
                raise redis.ResponseError("claim: " + "; ".join(refused))

    async def _read(self, streams: list[str], count: int, block: int | None = None) -> list[tuple[str, str, Any]]:
        """One XREADGROUP of new entries as (stream, entry id, fields)."""
        read = await read_group(self.ctx.redis, WORKERS_GROUP, self.ctx.name, streams, count=count, block=block)
        return [(stream, entry_id, fields) for stream, entries in read for entry_id, fields in entries]

    async def _give_back(self, entries: list[tuple[str, str]]) -> None:
        """Hand entries claimed after the stop began straight back (owner-checked, JUSTID: their
        delivery count stays), marked as handed back so nobody takes them for suspects."""
        if not entries:
            return
        await hand_back_entries(self.ctx, entries, f"handed back by {self.ctx.name} (claimed while stopping)")
        log.info("handed back %d entr%s claimed while stopping", len(entries), "y" if len(entries) == 1 else "ies")

    # ------------------------------------------------------------ idle entries

    async def reclaim_loop(self) -> None:
        """Take over entries idle past ``claim_idle``: dead or paused workers' work, and hand-backs.

        ``XPENDING … IDLE`` first shows what is idle, its owner and delivery count, so the worker
        picks what to take with ``XCLAIM`` (min-idle checked, so two workers never both take one):
        entries with a recorded error or hand-back, and entries delivered to this run of the worker
        that it never saw (a claim read whose reply was lost), are taken in bulk. Entries that were
        in flight on a worker that died ("suspects": one of them may be what killed it) are taken
        as ``recovery_split`` says (see :class:`~redroll.shared.settings.Settings`):

        * "halving" (default): in bulk, beside the survivor's other work, in groups at most half
          the size of the group each was in when its worker died (:meth:`_reclaim_halving`): a
          request that kills every worker it runs on is alone after about log2 N deaths and is
          dead-lettered then, while its neighbours finish (none is dead-lettered with it: group
          deaths do not raise the delivery count); a suspect down to running alone runs with
          nothing else in flight on its worker.
        * "alone": one at a time, each run with nothing else in flight (claiming stopped). A
          poison request takes down no innocent neighbour, and only its own delivery count climbs
          until it is dead-lettered; the suspects left for later keep their counts; but a dead
          worker's N entries take N generations, one after the other.

        (XAUTOCLAIM would take and count a whole batch at once.) XCLAIM drops ids deleted from the
        stream from the PEL.
        """
        ctx = self.ctx
        first = True  # (a worker that joins takes what waits at once: hand-backs, a dead worker's)
        while not ctx.stopping.is_set():
            if not first:
                await self._pause()
            first = False
            try:
                # Isolation lasts until no suspect is left, so new claims do not refill the slots
                # between two suspects.
                while not ctx.stopping.is_set() and await self._reclaim_once():
                    pass
            finally:
                self.flights.end_isolation()

    def wake(self) -> None:
        """Run a reclaim pass now (another worker handed entries back: a notice, a drain)."""
        self._woken.set()

    async def _pause(self) -> None:
        """Until the next pass: ``reclaim_interval_s``, a quarter second while hand-backs wait for
        a free slot here, or until :meth:`wake` (or a stop)."""
        interval = min(self.reclaim_interval_s, 0.25) if self._handbacks_waiting else self.reclaim_interval_s
        woken = asyncio.ensure_future(self._woken.wait())
        stop = asyncio.ensure_future(self.ctx.stopping.wait())
        try:
            await asyncio.wait([woken, stop], timeout=interval, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            stop.cancel()
        self._woken.clear()

    async def _reclaim_once(self) -> bool:
        """One pass; True when it took a suspect (so the next pass should follow at once)."""
        ctx, flights = self.ctx, self.flights
        bulk: list[tuple[str, str, int, str, str]] = []
        suspects: list[tuple[str, str, int, str]] = []
        """(stream, entry id, times delivered so far, the consumer that died holding it)"""
        if flights.holds:
            return False
        halving = ctx.settings.recovery_split == "halving"
        # Even with every slot taken, look: suspects are run in isolation, which waits for the
        # slots to empty, so a busy worker still takes over a dead one's work. One round trip for
        # every request stream (with affinity lanes there are hundreds, mostly empty). (Halving
        # sizes groups by how many entries a dead worker held: look at enough of them.)
        count = max(flights.free_to_claim, 16) * 4
        if halving:
            count = max(count, 4 * flights.claim_limit, 256)
        streams = self.reclaim_streams()
        waiting = 0
        kept: dict[tuple[str, str], int] = {}
        """Entries handed back on notice → the runs their delivery count leaves out."""
        by_part: dict[Keys, list[str]] = {}
        for stream in streams:
            by_part.setdefault(ctx.part_of[stream], []).append(stream)
        # (per partition one function call: only entries old enough to be idle, and those newer ones
        # handed back, are walked: see reclaim_scan.lua)
        replies = await asyncio.gather(*(ctx.scripts.reclaim_scan(
            streams=group, marks=part.reclaim_marks, group=WORKERS_GROUP, min_idle_ms=ctx.settings.claim_idle_ms,
            count=count) for part, group in by_part.items()))
        found = {s: rows for group, reply in zip(by_part.values(), replies) for s, rows in zip(group, reply)}
        for stream in streams:  # high priority first
            rows = found[stream]
            if isinstance(rows, str):
                if "NOGROUP" in rows:  # (a lane whose owner has not made its group yet: nothing there)
                    continue
                raise redis.ResponseError(f"{stream}: {rows}")
            idle = [{"message_id": text(i), "consumer": text(c), "time_since_delivered": int(ms),
                     "times_delivered": int(n)} for i, c, ms, n in rows]
            idle = [p for p in idle if ctx.flight_key(stream, text(p["message_id"])) not in flights]
            if not idle:
                continue
            ids = [text(p["message_id"]) for p in idle]
            notes = await ctx.redis.hmget(ctx.keys.errors, [ctx.flight_key(stream, i) for i in ids])
            now = time.monotonic()
            for p, entry_id, note in zip(idle, ids, notes):
                deliveries = int(p["times_delivered"]) + 1  # what it will be once claimed
                # An entry delivered to this run of the worker that it does not know of never ran:
                # a claim read whose reply was lost (and retried by the client). It is no suspect.
                # (One delivered to its name before this run began was a previous run's: a restart
                # with the same name after a crash, which that entry may have caused. The margin
                # covers the idle time's millisecond steps: an entry this run lost in its first
                # 0.1 s is taken as a suspect, which is only slower.)
                delivered_at = now - int(p["time_since_delivered"]) / 1000.0
                never_ran = text(p["consumer"]) == ctx.name and delivered_at >= ctx.started_at + 0.1
                # (Halving: a suspect's delivery count says nothing of the deaths it witnessed in
                # a group; the death notes decide, below.)
                if note is not None or never_ran or (deliveries > ctx.settings.max_deliveries and not halving):
                    waiting += 1
                    if len(bulk) < flights.free_to_claim:
                        why = ("its claim reply was lost" if never_ran and note is None
                               else "delivered too often" if note is None
                               else text(note).split(" (", 1)[0] if text(note).startswith("handed back")
                               else "after an error: " + text(note)[:120])
                        uncounted = uncounted_runs(text(note)) if note is not None else None
                        if uncounted is not None:  # (a hand-back on notice: its delivery count stays)
                            kept[(stream, entry_id)] = uncounted
                            deliveries -= 1
                        bulk.append((stream, entry_id, deliveries, text(p["consumer"]), why))
                else:
                    suspects.append((stream, entry_id, deliveries - 1, text(p["consumer"])))
        self._handbacks_waiting = waiting > len(bulk)
        if bulk:
            for flight in await self._claim_and_start(bulk, kept):
                flight.reclaimed = True
                flight.uncounted_runs = kept.get((flight.stream, flight.entry_id), 0)
        if not suspects:
            return False
        if halving:
            return await self._reclaim_halving(suspects)
        # Isolation: stop claiming, let what runs finish, then take exactly one suspect (a random
        # one of the oldest, so workers reclaiming at once do not all contend for the same entry).
        flights.isolating = True
        await flights.wait_idle()
        if ctx.stopping.is_set():
            return False
        stream, entry_id, times, owner = random.choice(suspects[:8])
        for flight in await self._claim_and_start([(stream, entry_id, times + 1, owner, "its worker died")]):
            flight.reclaimed = True
            await self._run_alone(flight)
        return True

    async def _run_alone(self, flight: InFlight) -> None:
        log.warning("entry %s was in flight on a worker that died (delivery %d): running it alone",
                    flight.entry_id, flight.deliveries, extra=flight.context())
        if flight.task is not None:
            # Until it ends, or the worker stops: then the drain waits for it (up to its timeout)
            # and hands it back, as any flight.
            stop = asyncio.ensure_future(self.ctx.stopping.wait())
            try:
                await asyncio.wait([flight.task, stop], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()

    async def _reclaim_halving(self, suspects: list[tuple[str, str, int, str]]) -> bool:
        """Group testing over the entries of workers that died (``recovery_split`` "halving").

        Each suspect's death note (``<flight key>#deaths`` in ``{ns}:errors``: deaths witnessed,
        of them alone, group cap) says how large a group it may run in. The group it was in when
        its worker died is the entries that worker held (as many as are idle under its name), at
        most its previous cap; it now runs in groups of at most half that. One that was alone
        when its worker died is counted as delivered once more; one in a group keeps its delivery
        count (``XCLAIM … RETRYCOUNT``). It is dead-lettered when it was alone and has witnessed
        ``max_deliveries`` deaths (or been delivered more often than that). Per pass this worker
        takes, beside what it runs, the dead-lettered ones, then as many suspects as every
        suspect's cap here allows (the suspects running on one worker form its group), and
        otherwise one suspect down to running alone, in isolation (claiming stopped)."""
        ctx, flights = self.ctx, self.flights
        max_deliveries = ctx.settings.max_deliveries
        fields = [deaths_field(ctx.flight_key(s, i)) for s, i, _, _ in suspects]
        notes = await ctx.redis.hmget(ctx.keys.errors, fields)
        held = collections.Counter(owner for _, _, _, owner in suspects)
        condemned: list[_Plan] = []
        grouped: list[_Plan] = []
        alone: list[_Plan] = []
        counted: dict[str, str] = {}
        for (stream, entry_id, times, owner), field, raw in zip(suspects, fields, notes):
            deaths, deaths_alone, cap, was_alone, noted_owner = parse_deaths(raw)
            if noted_owner != owner:
                # A death not counted yet: the first survivor to see it notes it for every entry
                # the dead worker held (so the group is the whole of it, whoever takes which part).
                group = held[owner] if cap is None else min(cap, held[owner])
                was_alone = group <= 1
                deaths, deaths_alone, cap = deaths + 1, deaths_alone + was_alone, max(1, group // 2)
                counted[field] = f"{deaths} {deaths_alone} {cap} {int(was_alone)} {owner}"
            assert cap is not None
            retry = times + 1 if was_alone else times
            plan = _Plan(stream, entry_id, retry, cap, group_deaths=deaths - deaths_alone, owner=owner)
            if was_alone and (deaths >= max_deliveries or retry > max_deliveries):
                plan.condemned = (f"its worker died while it ran alone: {deaths} worker deaths witnessed "
                                  f"({deaths_alone} alone), delivered {retry} times (max_deliveries={max_deliveries})")
                condemned.append(plan)
            elif cap > 1:
                grouped.append(plan)
            else:
                alone.append(plan)
        if counted:
            await ctx.redis.hset(ctx.keys.errors, mapping=counted)
        chosen = condemned[:16]
        # Groups: every suspect running here counts against the smallest cap among them.
        caps = flights.suspect_caps()
        limit = min(caps, default=1 << 30)
        size = len(caps)
        room = max(1, flights.claim_limit)
        for plan in sorted(grouped, key=lambda p: -p.cap):
            if size + 1 > min(limit, plan.cap) or room <= 0:
                break
            chosen.append(plan)
            limit, size, room = min(limit, plan.cap), size + 1, room - 1
        if chosen:
            await self._claim_planned(chosen)
            return True
        if not alone or caps:
            return False
        # Down to running alone: stop claiming, let what runs finish, then take exactly one (a
        # random one of the oldest, so workers reclaiming at once do not contend for one entry).
        flights.isolating = True
        await flights.wait_idle()
        if ctx.stopping.is_set():
            return False
        for flight in await self._claim_planned([random.choice(alone[:8])]):
            await self._run_alone(flight)
        return True

    async def _claim_planned(self, plans: list["_Plan"]) -> list[InFlight]:
        """XCLAIM the planned suspects (min-idle checked: nobody else took them meanwhile) with the
        delivery count each is to have, then start them, or defer them until a slot is free."""
        ctx, flights = self.ctx, self.flights
        claimed: list[tuple[_Plan, Any]] = []
        by_key: dict[tuple[str, int], list[_Plan]] = collections.defaultdict(list)
        for plan in plans:
            by_key[(plan.stream, plan.retry)].append(plan)
        async with ctx.redis.pipeline(transaction=False) as pipe:
            for (stream, retry), group in by_key.items():
                pipe.xclaim(stream, WORKERS_GROUP, ctx.name, ctx.settings.claim_idle_ms,
                            [p.entry_id for p in group], retrycount=retry)
            replies = await pipe.execute(raise_on_error=False)
        for group, reply in zip(by_key.values(), replies):
            if isinstance(reply, Exception):
                # (one stream's refusal costs no other stream its claims; what it holds is
                # looked at again in the next pass)
                log.warning("reclaim from %s failed: %s", group[0].stream, reply)
                continue
            ids = {p.entry_id: p for p in group}
            for raw_id, fields in reply:
                plan = ids.get(text(raw_id))
                if plan is not None and fields:
                    claimed.append((plan, fields))
        if not claimed:
            return []
        if ctx.stopping.is_set():
            await self._give_back([(p.stream, p.entry_id) for p, _ in claimed])
            return []
        started = []
        for plan, fields in claimed:
            key = ctx.flight_key(plan.stream, plan.entry_id)
            if key in flights:
                continue
            ctx.stats.reclaimed += 1
            self._attempts += 1
            flight = flights.add(plan.stream, plan.entry_id, key, plan.retry, fields, defer=not flights.slot_free,
                                 handle=f"{key}.{plan.retry}.r{self._attempts}")
            flight.reclaimed = True
            flight.suspect_cap = None if plan.condemned else plan.cap
            flight.condemned = plan.condemned
            flight.uncounted_runs = plan.group_deaths
            started.append(flight)
        ctx.deliveries.note([Delivery(p.stream, p.entry_id, fields, n=p.retry, previous=p.owner,
                                      why="its worker died") for p, fields in claimed])
        grouped = [f for f in started if f.condemned is None and (f.suspect_cap or 1) > 1]
        if grouped:
            log.warning("took back %d entr%s (each was in flight on a worker that died), in groups of at most %d",
                        len(grouped), "y" if len(grouped) == 1 else "ies", min(f.suspect_cap or 1 for f in grouped))
        return started

    async def _claim_and_start(self, chosen: list[tuple[str, str, int, str, str]],
                               kept: dict[tuple[str, str], int] | None = None) -> list[InFlight]:
        """XCLAIM and start (stream, entry id, delivery count, previous owner, why it is taken back);
        the entries in ``kept`` keep their delivery count (``RETRYCOUNT``: a hand-back on notice)."""
        ctx = self.ctx
        kept = kept or {}
        started = []
        for stream in ctx.request_streams:
            counts = {entry_id: n for s, entry_id, n, _, _ in chosen if s == stream}
            how = {entry_id: (owner, why) for s, entry_id, _, owner, why in chosen if s == stream}
            if not counts:
                continue
            claimed = []
            counted = [i for i in counts if (stream, i) not in kept]
            if counted:
                claimed += await ctx.redis.xclaim(stream, WORKERS_GROUP, ctx.name, ctx.settings.claim_idle_ms,
                                                  counted)
            for n in sorted({counts[i] for i in counts if (stream, i) in kept}):
                claimed += await ctx.redis.xclaim(stream, WORKERS_GROUP, ctx.name, ctx.settings.claim_idle_ms,
                                                  [i for i in counts if (stream, i) in kept and counts[i] == n],
                                                  retrycount=n)
            if ctx.stopping.is_set():
                await self._give_back([(stream, text(i)) for i, fields in claimed if fields])
                continue
            for raw_id, fields in claimed:
                entry_id = text(raw_id)
                if not fields or ctx.flight_key(stream, entry_id) in self.flights:
                    continue
                owner, why = how[entry_id]
                ctx.deliveries.note([Delivery(stream, entry_id, fields, n=counts[entry_id], previous=owner, why=why)])
                ctx.stats.reclaimed += 1
                self._attempts += 1  # (a kept count may repeat a handle this worker used: a suffix keeps it unique)
                started.append(self.flights.add(stream, entry_id, ctx.flight_key(stream, entry_id), counts[entry_id],
                                                fields, handle=f"{ctx.flight_key(stream, entry_id)}.{counts[entry_id]}"
                                                f".h{self._attempts}" if (stream, entry_id) in kept else None))
        return started
