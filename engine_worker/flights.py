"""The worker's in-flight entries: the one owner of that state, and of when their tasks start.

An entry is in flight from its claim until its finish, dead letter or hand-back: it is leased
(renewed) all that time. It holds an engine slot while it is generating; ``max_inflight``
bounds those. Entries claimed while claiming is held (a weight update, released memory, an
isolation) or with every slot taken wait here, leased, deferred; entries that need newer weights
wait parked. Whoever waits for a slot or for the engine to go idle waits on an event that every
change sets, never by polling.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

from redroll.shared.types import GenerationRequest, RecordStatus

Fields = dict
DEATHS_SUFFIX = "#deaths"
"""A suspect's death note lives in ``{ns}:errors`` under its flight key plus this suffix (see
``Claimer._reclaim_halving``)."""
Run = Callable[["InFlight", Fields], Awaitable[None]]
RunBatch = Callable[[list[tuple["InFlight", Fields]]], Awaitable[None]]


@dataclass(eq=False)
class InFlight:
    stream: str
    entry_id: str
    key: str
    """Unique across the request streams: the key of the flights and of ``{ns}:errors``."""
    handle: str
    """The engine's handle of this attempt (``<key>.<deliveries>``)."""
    deliveries: int
    claimed_at: float
    fields: Fields
    """The entry's stream fields as claimed (a dead letter carries them)."""
    request: GenerationRequest | None = None
    task: asyncio.Task | None = None
    stop_status: RecordStatus | None = None
    """Set when the worker stops the generation: ABORTED (user abort) or EXPIRED (deadline)."""
    stop_reason: str | None = None
    """Why it was stopped: "user", "deadline" or "weight_update" (meta_info.abort_reason)."""
    handed_back: bool = False
    lease_lost: bool = False
    released: bool = False
    """Its engine slot was given back (generation over, the record is being published)."""
    publishing: bool = False
    """Its finish or dead letter is under way (a renewal racing it may see the entry as gone)."""
    deadline_timer: asyncio.TimerHandle | None = None
    reclaimed: bool = False
    """Taken over from another consumer (its notes in ``{ns}:errors`` are deleted when it ends)."""
    suspect_cap: int | None = None
    """Reclaimed from a worker that died (``recovery_split`` "halving"): the most suspects that
    may run together on this worker while it does (None: no suspect, or cleared by a checkpoint
    that advanced here)."""
    condemned: str | None = None
    """Why it is dead-lettered without running (it killed the worker that ran it alone)."""
    span: Any = None
    """OpenTelemetry: the publish span of its record, ended once the finish settled."""
    generation_started: float | None = None
    """When its generation began here (``time.monotonic``)."""
    generation_budget: int | None = None
    """The tokens that generation may make (``max_new_tokens`` of what the engine runs: a
    continuation's is what was left)."""
    checkpointed: bool = False
    """A checkpoint of this entry was saved or loaded here (its finish deletes it)."""
    leased_at: float = 0.0
    """When its lease was last taken or renewed (``time.time()``; 0: when it was claimed)."""
    uncounted_runs: int = 0
    """Runs its delivery count leaves out: the deaths it witnessed in a group ("halving" keeps the
    count there, so that innocent neighbours of a poison request are not dead-lettered with it)."""

    @property
    def attempt(self) -> int:
        """Which run of the request this is (the records' ``meta_info.attempt``)."""
        return self.deliveries + self.uncounted_runs

    @property
    def taken_back(self) -> bool:
        """Delivered before this run (a reclaim, a hand-back): it may have a checkpoint and notes in
        ``{ns}:errors``; a first delivery has neither."""
        return self.deliveries > 1 or self.reclaimed

    @property
    def generating(self) -> bool:
        return self.task is not None and not self.released

    def stop(self, engine: Any, status: RecordStatus, reason: str = "user") -> None:
        """Stop the generation (the first reason given is the one recorded)."""
        if self.stop_status is None:
            self.stop_status, self.stop_reason = status, reason
        engine.abort(self.handle)

    def context(self) -> dict[str, Any]:
        """Log context: every line about a request names it (the JSON log format emits these)."""
        return {"request_id": self.request.request_id if self.request else None, "entry_id": self.entry_id}


class Flights:
    """In-flight entries by key, their slots, and the reasons claiming waits."""

    def __init__(self, max_inflight: int, run: Run, stopping: asyncio.Event, run_batch: RunBatch | None = None):
        self.max_inflight = max(1, int(max_inflight))
        self.capacity: int | None = None
        """The engine's declared capacity, once it started (None: it runs whatever it is given)."""
        self.claim_limit = self.max_inflight
        """The most entries claimed that take or wait for an engine slot: the claim loops wait
        below it and read no more than the difference (set at start to the engine's capacity plus
        ``claim_prefetch``, at most ``max_inflight``: see :func:`.claim.claim_limit`)."""
        self._run = run
        self._run_batch = run_batch
        """Runs the entries of one claim that start at once in one task (None: a task each)."""
        self._stopping = stopping
        self._by_key: dict[str, InFlight] = {}
        self._released = 0
        self._deferred: list[tuple[InFlight, Fields]] = []
        self._held: list[tuple[InFlight, Fields]] = []
        self._parked: list[tuple[InFlight, Fields]] = []
        self.holds: set[str] = set()
        """Reasons claiming is paused (a weight update, released GPU memory, blocked publishing)."""
        self.isolating = False
        """A suspect from a dead worker runs alone: nothing else starts meanwhile."""
        self._changed = asyncio.Event()

    # ------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def __iter__(self) -> Iterator[InFlight]:
        return iter(list(self._by_key.values()))

    def get(self, key: str) -> InFlight | None:
        return self._by_key.get(key)

    def holds_entry(self, flight: InFlight) -> bool:
        """True while ``flight`` is still this worker's (not finished, not replaced)."""
        return self._by_key.get(flight.key) is flight

    @property
    def occupied(self) -> int:
        """Entries that hold an engine slot: claimed and not yet through the engine (publishing
        ones have given theirs back, so the next claim overlaps the finish round trip; held-back
        ones take none until they are released)."""
        return len(self._by_key) - self._released - len(self._held)

    @property
    def free_to_claim(self) -> int:
        """How many more entries a claim may take now (fair claiming: see :mod:`.claim`)."""
        return max(0, min(self.claim_limit, self.max_inflight) - self.occupied)

    def suspect_caps(self) -> list[int]:
        """The group caps of the suspects in flight here (see ``InFlight.suspect_cap``)."""
        return [f.suspect_cap for f in self._by_key.values() if f.suspect_cap is not None]

    @property
    def slot_free(self) -> bool:
        """A flight added now would start at once (no hold, no isolation, a slot free)."""
        return not self.claiming_paused and self.generating < self.max_inflight

    @property
    def generating(self) -> int:
        return sum(1 for f in self._by_key.values() if f.generating)

    @property
    def claiming_paused(self) -> bool:
        return bool(self.holds) or self.isolating

    def running(self) -> bool:
        """Any task still running (generating, publishing, or waiting in the engine)."""
        return any(f.task is not None and not f.task.done() for f in self._by_key.values())

    # ------------------------------------------------------------ changes

    def add(self, stream: str, entry_id: str, key: str, deliveries: int, fields: Fields, *,
            defer: bool = False, handle: str | None = None) -> InFlight:
        """A claimed entry: leased (renewed) from now on; its task starts now, or when a slot and
        claiming are free again (``defer``). ``handle``: the engine's handle of this attempt when
        ``<key>.<deliveries>`` may not be unique (a reclaim that kept the delivery count)."""
        flight = self._new(stream, entry_id, key, deliveries, fields)
        if handle is not None:
            flight.handle = handle
        if defer:
            self._deferred.append((flight, fields))
        else:
            self.start(flight, fields)
        return flight

    def add_claimed(self, entries: list[tuple[str, str, str, Fields]]) -> None:
        """Entries a claim read delivered for the first time, as (stream, entry id, key, fields).
        Each waits, leased, while claiming is held or every slot is taken (a hold or an isolation
        may have begun while the read was blocked, or several streams answered it); the others
        start now, all in one task when there is a batch runner."""
        running = self.generating
        now: list[tuple[InFlight, Fields]] = []
        for stream, entry_id, key, fields in entries:
            flight = self._new(stream, entry_id, key, 1, fields)
            if self.claiming_paused or running >= self.max_inflight:
                self._deferred.append((flight, fields))
            else:
                now.append((flight, fields))
                running += 1
        if self._run_batch is None:
            for flight, fields in now:
                self.start(flight, fields)
        elif now:
            task = asyncio.create_task(self._run_batch(now))
            for flight, _ in now:
                flight.task = task

    def hold_back(self, entries: list[tuple[str, str, str, Fields]]) -> None:
        """Entries a read brought beyond the free slots behind high-priority ones, as (stream,
        entry id, key, fields): leased, but they take no slot and start only at
        :meth:`release_held` (once a claim finds no high-priority entry), before what that claim
        brought, so no normal entry runs ahead of a high-priority one queued meanwhile."""
        for stream, entry_id, key, fields in entries:
            self._held.append((self._new(stream, entry_id, key, 1, fields), fields))

    @property
    def held(self) -> int:
        return len(self._held)

    def release_held(self) -> None:
        """The held-back entries wait for a slot from now on, ahead of those deferred since."""
        if self._held:
            self._deferred[:0] = self._held
            self._held = []
            self._signal()
            self.start_deferred()

    def _new(self, stream: str, entry_id: str, key: str, deliveries: int, fields: Fields) -> InFlight:
        flight = InFlight(stream=stream, entry_id=entry_id, key=key, handle=f"{key}.{deliveries}",
                          deliveries=deliveries, claimed_at=time.time(), fields=fields)
        self._by_key[key] = flight
        return flight

    def start(self, flight: InFlight, fields: Fields) -> None:
        """Run ``flight`` in a task of its own."""
        flight.task = asyncio.create_task(self._run(flight, fields))

    def start_deferred(self) -> None:
        """Start entries that waited for a hold, an isolation or a free slot to end (not once the
        worker stops: the drain finishes what runs and hands these back)."""
        if self.claiming_paused or self._stopping.is_set() or not self._deferred:
            return
        running = self.generating
        while self._deferred and running < self.max_inflight:
            flight, fields = self._deferred.pop(0)
            if self.holds_entry(flight) and flight.task is None:
                self.start(flight, fields)
                running += 1

    def release_slot(self, flight: InFlight) -> None:
        """The generation of ``flight`` is over: its slot is free for the next claim."""
        if not flight.released and self.holds_entry(flight):
            flight.released = True
            self._released += 1
            self._signal()

    def park(self, flight: InFlight, fields: Fields) -> None:
        """Leased but not running: it starts again at :meth:`resume_parked` (new weights)."""
        flight.task = None
        self._parked.append((flight, fields))
        self._signal()

    @property
    def parked(self) -> int:
        return len(self._parked)

    def resume_parked(self) -> None:
        parked, self._parked = self._parked, []
        for flight, fields in parked:
            if self.holds_entry(flight):
                self.start(flight, fields)

    def done(self, flight: InFlight) -> None:
        """``flight``'s task ended (finished, dead-lettered, handed back); parked ones stay."""
        if flight.deadline_timer is not None:
            flight.deadline_timer.cancel()
        if flight.task is not None and self._by_key.get(flight.key) is flight:
            del self._by_key[flight.key]
            if flight.released:
                self._released -= 1
        self._signal()
        self.start_deferred()

    def hold(self, reason: str) -> None:
        self.holds.add(reason)
        self._signal()

    def release(self, reason: str) -> None:
        self.holds.discard(reason)
        self._signal()
        self.start_deferred()

    def end_isolation(self) -> None:
        self.isolating = False
        self._signal()
        self.start_deferred()

    def _signal(self) -> None:
        self._changed.set()

    def wake(self) -> None:
        """Wake every waiter (a stop was requested)."""
        self._signal()

    # ------------------------------------------------------------ waiting

    async def _wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def wait_for_slot(self) -> None:
        """Until a slot is free to claim for (below :attr:`claim_limit`) and claiming is not paused
        (or the worker stops)."""
        while (not self.free_to_claim or self.claiming_paused) and not self._stopping.is_set():
            await self._wait_change()

    async def wait_idle(self) -> None:
        """Until no task runs (or the worker stops)."""
        while self.running() and not self._stopping.is_set():
            await self._wait_change()
