"""The worker's lease renewal (engine_worker/liveness.py) against a real redis-server."""

from __future__ import annotations

import asyncio

from redroll.engine_worker.context import WorkerContext, WorkerStats
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.flights import Flights
from redroll.engine_worker.liveness import Liveness
from redroll.engine_worker.outcomes import Outcomes
from redroll.producer.client import make_request, send
from redroll.shared.keys import WORKERS_GROUP


async def _idle_ms(r, stream: str) -> int:
    [entry] = await r.xpending_range(stream, WORKERS_GROUP, min="-", max="+", count=10)
    return int(entry["time_since_delivered"])


async def test_an_entry_handed_back_while_a_renewal_is_on_its_way_stays_handed_back(settings, r):
    """The renewal read the flights, then the entry was handed back before the renewal reached
    Redis: the renewal leases it again, so it hands it back once more (the fleet would otherwise
    wait claim_idle to take it)."""
    await send(settings, r, [make_request(request_id="handed", prompt="x")])
    stream = settings.keys.requests
    await r.xgroup_create(stream, WORKERS_GROUP, id="0", mkstream=True)
    [(_, [(entry_id, fields)])] = await r.xreadgroup(WORKERS_GROUP, "w", {stream: ">"}, count=1)
    entry_id = entry_id.decode()
    ctx = WorkerContext(settings=settings, name="w", engine=SyntheticEngine(), redis=r, parts=[settings.keys],
                        stats=WorkerStats(), stopping=asyncio.Event(), block_ms=100)
    flights = Flights(4, run=lambda *_: asyncio.sleep(0), stopping=ctx.stopping)
    flight = flights.add(stream, entry_id, ctx.flight_key(stream, entry_id), 1, fields, defer=True)
    outcomes = Outcomes(ctx, flights)
    liveness = Liveness(ctx, flights, state=lambda: "running", blocked=dict)

    renew = ctx.scripts.renew
    calls: list[int] = []

    async def hand_back_first(stream, group, consumer, ids, idle_ms=0, marks=None):
        calls.append(idle_ms)
        if len(calls) == 1:  # the race: the hand-back reaches Redis before the renewal that listed it
            await outcomes.hand_back(flight)
        return await renew(stream, group, consumer, ids, idle_ms, marks)

    ctx.scripts.renew = hand_back_first  # type: ignore[method-assign]
    idle = settings.claim_idle_ms
    flight.claimed_at -= idle / 3000  # (a lease a third of claim_idle old: due for renewal)
    await liveness.renew_leases()
    assert calls == [0, idle, idle] and ctx.stats.handed_back == 1  # renewal, hand-back, hand-back again
    assert await _idle_ms(r, stream) >= idle  # (reclaimable at once)
    await liveness.renew_leases()  # a later pass leaves it alone
    assert calls == [0, idle, idle]


async def test_only_leases_a_third_of_claim_idle_old_are_renewed(settings, r):
    """A heartbeat renews the leases that are a third of claim_idle old or more (none gets older
    than two thirds of it): an entry that ends sooner costs no renewal at all."""
    await send(settings, r, [make_request(request_id=f"l{i}", prompt="x") for i in range(2)])
    stream = settings.keys.requests
    await r.xgroup_create(stream, WORKERS_GROUP, id="0", mkstream=True)
    [(_, entries)] = await r.xreadgroup(WORKERS_GROUP, "w", {stream: ">"}, count=2)
    ctx = WorkerContext(settings=settings, name="w", engine=SyntheticEngine(), redis=r, parts=[settings.keys],
                        stats=WorkerStats(), stopping=asyncio.Event(), block_ms=100)
    flights = Flights(4, run=lambda *_: asyncio.sleep(0), stopping=ctx.stopping)
    fresh, old = (flights.add(stream, i.decode(), ctx.flight_key(stream, i.decode()), 1, f, defer=True)
                  for i, f in entries)
    old.claimed_at -= settings.claim_idle_ms / 3000
    renewed: list[list[str]] = []
    renew = ctx.scripts.renew

    async def counting(stream, group, consumer, ids, idle_ms=0, marks=None):
        renewed.append(list(ids))
        return await renew(stream, group, consumer, ids, idle_ms, marks)

    ctx.scripts.renew = counting  # type: ignore[method-assign]
    liveness = Liveness(ctx, flights, state=lambda: "running", blocked=dict)
    await liveness.renew_leases()
    assert renewed == [[old.entry_id]] and old.leased_at > fresh.leased_at == 0.0
    await liveness.renew_leases()  # renewed just now: not again at the next beat
    assert renewed == [[old.entry_id]]
