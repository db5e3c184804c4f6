"""engine_worker.flights: the in-flight entries, their slots, and waits without polling."""

from __future__ import annotations

import asyncio

from redroll.engine_worker.flights import Flights
from redroll.shared.types import RecordStatus


class Gate:
    """A run function whose tasks wait until released, recording what ran."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.release = asyncio.Event()
        self.flights: Flights | None = None

    async def __call__(self, flight, fields) -> None:
        self.started.append(flight.entry_id)
        try:
            await self.release.wait()
        finally:
            self.flights.done(flight)  # (what the worker's request task does at its end)


def make(max_inflight: int = 2) -> tuple[Flights, Gate, asyncio.Event]:
    gate, stopping = Gate(), asyncio.Event()
    gate.flights = Flights(max_inflight, gate, stopping)
    return gate.flights, gate, stopping


async def test_slots_defer_and_start_in_order():
    fl, gate, _ = make(max_inflight=2)
    for i in range(3):
        fl.add("s", f"1-{i}", f"1-{i}", 1, {}, defer=i >= 2)
    await asyncio.sleep(0)
    assert gate.started == ["1-0", "1-1"] and len(fl) == 3 and fl.occupied == 3
    waiter = asyncio.create_task(fl.wait_for_slot())
    await asyncio.sleep(0.01)
    assert not waiter.done()  # every slot is taken
    gate.release.set()
    await asyncio.wait_for(waiter, 1)
    await asyncio.sleep(0.01)
    assert gate.started == ["1-0", "1-1", "1-2"] and len(fl) == 0


async def test_once_stopping_a_deferred_entry_is_not_started():
    # (the drain finishes what runs and hands the rest back: a deferred one once started as a
    # running one ended, only to be aborted, or to run on past its hand-back)
    fl, gate, stopping = make(max_inflight=1)
    fl.add("s", "1-0", "1-0", 1, {})
    deferred = fl.add("s", "1-1", "1-1", 1, {}, defer=True)
    await asyncio.sleep(0)
    stopping.set()
    gate.release.set()
    await asyncio.sleep(0.01)
    assert gate.started == ["1-0"] and list(fl) == [deferred] and deferred.task is None


async def test_released_slot_lets_the_next_claim_overlap_the_finish():
    fl, gate, _ = make(max_inflight=1)
    flight = fl.add("s", "1-0", "1-0", 1, {})
    await asyncio.sleep(0)
    assert fl.occupied == 1
    fl.release_slot(flight)
    assert fl.occupied == 0 and len(fl) == 1  # still in flight (publishing), slot free
    await asyncio.wait_for(fl.wait_for_slot(), 1)
    gate.release.set()
    await asyncio.sleep(0.01)
    assert len(fl) == 0 and fl.occupied == 0


async def test_holds_pause_claiming_and_release_starts_deferred():
    fl, gate, _ = make(max_inflight=4)
    fl.hold("weights")
    fl.add("s", "1-0", "1-0", 1, {}, defer=fl.claiming_paused)
    await asyncio.sleep(0)
    assert gate.started == [] and fl.claiming_paused
    waiter = asyncio.create_task(fl.wait_for_slot())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    fl.release("weights")
    await asyncio.wait_for(waiter, 1)
    await asyncio.sleep(0)
    assert gate.started == ["1-0"]
    gate.release.set()


async def test_wait_idle_wakes_when_the_last_task_ends_and_parked_ones_do_not_count():
    fl, gate, _ = make(max_inflight=4)
    a = fl.add("s", "1-0", "1-0", 1, {})
    fl.add("s", "1-1", "1-1", 1, {})
    await asyncio.sleep(0)
    fl.park(a, {})  # (its task would end now; parked entries stay in flight, not running)
    idle = asyncio.create_task(fl.wait_idle())
    await asyncio.sleep(0.01)
    assert not idle.done()
    gate.release.set()
    await asyncio.wait_for(idle, 1)
    assert fl.parked == 1 and fl.get("1-0") is a


async def test_stop_keeps_the_first_reason_and_aborts_in_the_engine():
    fl, gate, _ = make()
    flight = fl.add("s", "1-0", "1-0", 3, {})

    class Engine:
        aborted: list[str] = []

        def abort(self, handle):
            self.aborted.append(handle)

    engine = Engine()
    flight.stop(engine, RecordStatus.EXPIRED, "deadline")
    flight.stop(engine, RecordStatus.ABORTED, "user")
    assert (flight.stop_status, flight.stop_reason) == (RecordStatus.EXPIRED, "deadline")
    assert engine.aborted == ["1-0.3", "1-0.3"]
    gate.release.set()


async def test_a_stop_wakes_slot_waiters():
    fl, gate, stopping = make(max_inflight=1)
    fl.add("s", "1-0", "1-0", 1, {})
    waiter = asyncio.create_task(fl.wait_for_slot())
    await asyncio.sleep(0.01)
    stopping.set()
    fl.wake()
    await asyncio.wait_for(waiter, 1)
    gate.release.set()


class BatchGate:
    """A batch runner recording each batch it was given (its entries end when released)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = asyncio.Event()
        self.flights: Flights | None = None

    async def __call__(self, batch) -> None:
        self.batches.append([flight.entry_id for flight, _ in batch])
        try:
            await self.release.wait()
        finally:
            for flight, _ in batch:
                self.flights.done(flight)


async def test_a_claims_entries_start_as_one_batch_and_the_surplus_waits_for_a_slot():
    gate, batch = Gate(), BatchGate()
    fl = gate.flights = batch.flights = Flights(2, gate, asyncio.Event(), run_batch=batch)
    fl.add_claimed([("s", f"1-{i}", f"1-{i}", {"i": i}) for i in range(3)])
    await asyncio.sleep(0)
    assert batch.batches == [["1-0", "1-1"]] and gate.started == []
    first, second, third = (fl.get(f"1-{i}") for i in range(3))
    assert first.task is second.task and third.task is None and fl.occupied == 3
    batch.release.set()
    await asyncio.sleep(0.01)
    assert gate.started == ["1-2"]  # (a deferred entry starts in a task of its own)
    gate.release.set()
    await asyncio.sleep(0.01)
    assert len(fl) == 0


async def test_without_a_batch_runner_each_claimed_entry_gets_its_task_and_a_hold_defers_them_all():
    fl, gate, _ = make(max_inflight=4)
    fl.add_claimed([("s", "1-0", "1-0", {}), ("s", "1-1", "1-1", {})])
    await asyncio.sleep(0)
    assert gate.started == ["1-0", "1-1"] and fl.get("1-0").task is not fl.get("1-1").task
    fl.hold("weights")
    fl.add_claimed([("s", "1-2", "1-2", {})])
    await asyncio.sleep(0)
    assert gate.started == ["1-0", "1-1"] and fl.get("1-2").deliveries == 1
    fl.release("weights")
    await asyncio.sleep(0)
    assert gate.started == ["1-0", "1-1", "1-2"]
    gate.release.set()


async def test_held_back_entries_take_no_slot_and_start_first_once_released():
    fl, gate, _ = make(max_inflight=2)
    fl.add_claimed([("h", "2-0", "h/2-0", {})])
    fl.hold_back([("s", "1-5", "1-5", {}), ("s", "1-6", "1-6", {})])
    await asyncio.sleep(0)
    assert gate.started == ["2-0"] and len(fl) == 3 and fl.held == 2 and fl.occupied == 1
    await asyncio.wait_for(fl.wait_for_slot(), 1)  # (held entries leave the slot to the next claim)
    # the next claim found no high-priority entry: the held ones go first, then what it brought
    fl.release_held()
    fl.add_claimed([("s", "1-7", "1-7", {})])
    await asyncio.sleep(0)
    assert gate.started == ["2-0", "1-5"] and fl.held == 0 and fl.occupied == 4
    gate.release.set()
    await asyncio.sleep(0.01)
    assert gate.started == ["2-0", "1-5", "1-6", "1-7"] and len(fl) == 0
