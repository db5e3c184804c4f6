"""A partitioned pipeline on one server: P complete copies of the per-request keys, {ns:0}..{ns:P-1}."""

from __future__ import annotations

import asyncio
from collections import Counter

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.ops.status import collect_pipeline_status
from redroll.producer import Producer
from redroll.producer.client import make_request, send
from redroll.shared.keys import Keys
from redroll.shared.types import RecordStatus
from tests.conftest import run_until_drained, wait_until, workers_and_consumer


async def test_placement_processing_and_status_over_three_partitions(settings, r):
    s = settings.with_(partitions=3)
    parts = s.partition_keys
    assert [p.tag for p in parts] == [f"{{{s.namespace}:{i}}}" for i in range(3)]
    applied: list[str] = []
    async with Producer(s) as p:
        singles = [dict(request_id=f"r-{i}", input_ids=[i + 1], sampling_params={"max_new_tokens": 3})
                   for i in range(120)]
        futs = await p.submit_many(singles)
        group = await p.submit_group(8, group_id="prompt-1", input_ids=[7], sampling_params={"max_new_tokens": 3})
        await send(s, r, [make_request(request_id=f"cb-{i}", input_ids=[1], callback="h",
                                       sampling_params={"max_new_tokens": 2}) for i in range(60)])
        # Placement: each request sits in the partition its id (or group id) hashes to.
        lengths = [await r.xlen(part.requests) for part in parts]
        expected = Counter(s.keys_for(make_request(request_id=x["request_id"], input_ids=[1])).tag for x in singles)
        expected.update(s.keys_for(make_request(request_id=f"cb-{i}", input_ids=[1])).tag for i in range(60))
        expected[s.keys_for(make_request(request_id="x", input_ids=[1], group_id="prompt-1")).tag] += 8
        assert lengths == [expected[part.tag] for part in parts] and all(lengths)
        assert await r.xlen(Keys(s.namespace).requests) == 0  # no plain-layout keys
        status = await collect_pipeline_status(r, s.keys, parts)
        assert status["requests"]["backlog"] == 188 and len(status["partitions"]) == 3

        workers, consumer = workers_and_consumer(s, applied)
        await run_until_drained(*workers, consumer, timeout=60)
        records = await asyncio.wait_for(asyncio.gather(*futs), 30)
        members = await group.wait(timeout=30)
    assert all(rec.status is RecordStatus.FINISHED for rec in records + members)
    assert sorted(applied) == sorted(f"cb-{i}" for i in range(60))
    assert sum(w.stats.published for w in workers) == 188
    assert all(w.stats.published > 0 for w in workers)
    for part in parts:
        assert await r.xlen(part.requests) == 0
    status = await collect_pipeline_status(r, s.keys, parts)
    assert status["requests"]["length"] == 0 and status["dead_letters"] == 0


async def test_queued_abort_and_dead_letters_stay_in_their_partition(settings, r):
    s = settings.with_(partitions=4)
    async with Producer(s) as p:
        futs = await p.submit_many([dict(request_id=f"q-{i}", prompt="x") for i in range(12)])
        cancelled = await p.abort([f"q-{i}" for i in range(12)])
        recs = await asyncio.wait_for(asyncio.gather(*futs), 2)
    assert sorted(cancelled) == sorted(f"q-{i}" for i in range(12))
    assert all(rec.status is RecordStatus.ABORTED for rec in recs)
    # A malformed entry in partition 2 is dead-lettered into partition 2's dead stream.
    part = s.partition_keys[2]
    await r.xadd(part.requests, {"rid": "bad", "data": b"\xc1"})
    worker = Worker(s, SyntheticEngine(), block_ms=200)
    task = asyncio.create_task(worker.run())
    await wait_until(lambda: r.xlen(part.dead))
    worker.request_stop()
    await task
    assert [await r.xlen(k.dead) for k in s.partition_keys] == [0, 0, 1, 0]


async def test_a_worker_serves_only_its_assigned_partitions(settings, r):
    s = settings.with_(partitions=4)
    parts = s.partition_keys
    worker = Worker(s, SyntheticEngine(), block_ms=100, only_partitions=[3, 1])
    assert [p.tag for p in worker.parts] == [parts[1].tag, parts[3].tag]
    task = asyncio.create_task(worker.run())
    async with Producer(s) as p:
        reqs = [dict(request_id=f"a-{i}", prompt="x", sampling_params={"max_new_tokens": 2}) for i in range(40)]
        futs = await p.submit_many(reqs)
        served = [f for req, f in zip(reqs, futs)
                  if s.keys_for(make_request(request_id=req["request_id"], prompt="x")).partition in (1, 3)]
        records = await asyncio.wait_for(asyncio.gather(*served), 15)
        await asyncio.sleep(0.3)
        assert all(rec.status is RecordStatus.FINISHED for rec in records)
        assert [await r.xlen(part.requests) for part in parts][0::2] == [
            sum(1 for x in reqs if s.keys_for(make_request(request_id=x["request_id"], prompt="x")).partition == i)
            for i in (0, 2)]
        assert await r.xlen(parts[1].requests) == await r.xlen(parts[3].requests) == 0
    worker.request_stop()
    await task
    for bad in ([4], [], [-1]):
        try:
            Worker(s, SyntheticEngine(), only_partitions=bad)
        except ValueError as exc:
            assert "0..3" in str(exc)
        else:
            raise AssertionError(f"only_partitions={bad} accepted")
