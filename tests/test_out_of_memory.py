"""Redis out of memory (maxmemory, noeviction) mid-run: every role holds what it cannot finish,
reports it, and resumes by itself once memory frees; nothing lost, nothing duplicated."""

from __future__ import annotations

import asyncio
import collections

import pytest
import redis

from redroll.consumer.runner import ConsumerRunner
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.ops.status import collect_pipeline_status
from redroll.producer.client import Producer, make_request, send
from redroll.shared.connection import connect
from redroll.shared.settings import Settings
from redroll.shared.types import RecordStatus
from tests.conftest import running, start_test_server, wait_until

MAXMEMORY = 64 * 1024 * 1024


@pytest.fixture
def small_server():
    server = start_test_server("--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "noeviction")
    yield server
    server.stop()


async def fill_past_maxmemory(r) -> None:
    """Filler keys of 256 kB until Redis refuses one; then maxmemory goes a little below what is
    used, so that the smallest write is refused too (Redis counts client buffers near the limit)."""
    i = 0
    while True:
        try:
            await r.set(f"filler:{i}", b"x" * (1 << 18))
        except redis.exceptions.OutOfMemoryError:
            break
        i += 1
    used = int((await r.info("memory"))["used_memory"])
    await r.config_set("maxmemory", used - (1 << 20))


async def free_filler(r) -> None:
    await r.delete(*[k async for k in r.scan_iter(match="filler:*")])


@pytest.mark.slow
async def test_out_of_memory_mid_run_loses_and_duplicates_nothing(small_server):
    settings = Settings(redis_url=small_server.url, namespace="oom", claim_idle_ms=1500, heartbeat_s=0.5,
                        drain_timeout_s=5.0, max_deliveries=3)
    r = connect(settings)
    applied: collections.Counter = collections.Counter()
    awaited: collections.Counter = collections.Counter()
    worker = Worker(settings, SyntheticEngine(token_ms=20, jitter=0.5), max_inflight=16, block_ms=100)
    async def apply(rec) -> None:
        applied.update([rec.request_id])
        if rec.request_id == "f-5":
            await asyncio.sleep(2.0)  # its batch acks after memory ran out: the acks must be held

    consumer = ConsumerRunner(settings, group="g", handlers={"h": apply}, block_ms=100)
    sp = {"max_new_tokens": 8}
    try:
        async with running(worker, consumer), Producer(settings, name="p", max_inflight=32) as producer:
            async def produce(start: int, n: int) -> list:
                futures = []
                for i in range(start, start + n, 10):
                    futures += await producer.submit_many(
                        [make_request(request_id=f"p-{j}", prompt=f"p{j}", sampling_params=sp)
                         for j in range(i, i + 10)], callback=lambda rec: awaited.update([rec.request_id]))
                    await send(settings, r, [make_request(request_id=f"f-{j}", prompt=f"f{j}", sampling_params=sp,
                                                          callback="h") for j in range(i, i + 10)])
                    await asyncio.sleep(0.05)
                return futures

            first = await produce(0, 100)
            await wait_until(lambda: applied["f-5"] == 1, 30)
            await fill_past_maxmemory(r)
            # While it lasts: submits wait (retried), workers hold their records, consumers their acks.
            during = asyncio.create_task(produce(100, 100))
            await asyncio.sleep(3.0)
            status = await collect_pipeline_status(r, settings.keys, settings.partition_keys)
            assert any("out of memory" in a for a in status["alerts"]), status["alerts"]
            assert worker.state() == "blocked" and worker.stats.refusals.get("out_of_memory", 0) > 0
            assert consumer.blocked is not None and consumer.stats.refusals > 0
            assert not during.done()
            await free_filler(r)
            futures = first + await asyncio.wait_for(during, 60)
            records = await asyncio.wait_for(asyncio.gather(*futures), 60)
            # nothing left for the group and no request left: no duplicate can still be applied
            await wait_until(consumer.idle, 60)
            status = await collect_pipeline_status(r, settings.keys, settings.partition_keys)
            assert status["alerts"] == []
        assert all(rec.status is RecordStatus.FINISHED for rec in records)
        assert awaited == collections.Counter({f"p-{i}": 1 for i in range(200)})
        assert applied == collections.Counter({f"f-{i}": 1 for i in range(200)})
        assert await r.xlen(settings.keys.dead) == 0 and await r.xlen(settings.keys.requests) == 0
        assert consumer.stats.duplicates_skipped == 0
    finally:
        await r.aclose()


async def test_a_consumer_refused_its_markers_keeps_the_entries_from_other_consumers(small_server):
    # The entries were idle for the whole callback before the first refusal: renewed at once, no
    # other consumer's reclaim takes them while the acks are held, and the callback runs once.
    settings = Settings(redis_url=small_server.url, namespace="oomc", claim_idle_ms=1500)
    r = connect(settings)
    calls: collections.Counter = collections.Counter()

    async def slow(record) -> None:
        calls.update([record.request_id])
        if calls[record.request_id] == 1:
            await asyncio.sleep(1.2)  # (most of claim_idle)
            await fill_past_maxmemory(r)

    first = ConsumerRunner(settings, group="g", handlers={"h": slow}, block_ms=100, name="first")
    other = ConsumerRunner(settings, group="g", handlers={"h": slow}, block_ms=100, name="other")
    try:
        async with running(first):
            await send(settings, r, [make_request(request_id="x", prompt="x", sampling_params={"max_new_tokens": 2},
                                                  callback="h")])
            async with running(Worker(settings, SyntheticEngine(), block_ms=100)):
                await wait_until(lambda: calls["x"] == 1, 10)
            async with running(other):
                await wait_until(lambda: first.blocked is not None, 10)
                await asyncio.sleep(2.5)  # (past claim_idle after the refusal: a reclaim pass or two)
                await free_filler(r)
                await wait_until(lambda: first.blocked is None, 10)
                await asyncio.sleep(0.5)
        assert calls == collections.Counter({"x": 1})
        assert other.stats.reclaimed == 0 and first.stats.applied == 1
        assert (await r.xpending(settings.keys.results, "g"))["pending"] == 0
    finally:
        await r.aclose()
