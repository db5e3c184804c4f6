"""engine_worker.claim: how a worker reads new entries. With one partition, once a claim finds no
high-priority entry, a plain XREADGROUP over both streams (claim.lua, which carries the budget from
one stream to the next, is needed only while high-priority entries are about); normal entries such
a read brings beside high-priority ones wait until none of those is left."""

from __future__ import annotations

import asyncio

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer.client import make_request, send
from redroll.shared.scripts import Scripts
from tests.conftest import wait_until


class CountingClaims:
    """Counts claim.lua calls (wraps Scripts.claim for the test's duration)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = Scripts.claim

        async def claim(scripts, **kw):
            self.calls += 1
            return await real(scripts, **kw)

        monkeypatch.setattr(Scripts, "claim", claim)


async def run_waves(settings, r, worker: Worker, waves: int, per_wave: int, priority: int = 0) -> None:
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.started.wait(), 10)
        for w in range(waves):
            await send(settings, r, [make_request(request_id=f"w{w}-{i}", prompt="x", priority=priority,
                                                  sampling_params={"max_new_tokens": 2}) for i in range(per_wave)])
            await wait_until(lambda: worker.stats.published == (w + 1) * per_wave, timeout=10)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 15)


async def test_without_high_priority_traffic_one_partition_is_read_plainly(settings, r, monkeypatch):
    claims = CountingClaims(monkeypatch)
    worker = Worker(settings, SyntheticEngine(), max_inflight=16, block_ms=100)
    await run_waves(settings, r, worker, waves=4, per_wave=50)
    assert worker.stats.claimed == 200 and claims.calls == 1  # (the first claim, which found nothing)


async def test_while_high_priority_entries_come_claims_are_exact(settings, r, monkeypatch):
    claims = CountingClaims(monkeypatch)
    worker = Worker(settings, SyntheticEngine(), max_inflight=16, block_ms=100)
    await run_waves(settings, r, worker, waves=3, per_wave=40, priority=1)
    assert worker.stats.claimed == 120 and claims.calls >= 3  # (after each read that brought some)


async def test_several_partitions_are_always_claimed_exactly(settings, r, monkeypatch):
    settings = settings.with_(partitions=2)
    claims = CountingClaims(monkeypatch)
    worker = Worker(settings, SyntheticEngine(), max_inflight=16, block_ms=100)
    await run_waves(settings, r, worker, waves=3, per_wave=40)
    assert worker.stats.claimed == 120 and claims.calls >= 4  # (each wave's claims, and the first)
