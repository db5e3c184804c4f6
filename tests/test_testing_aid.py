"""The testing aid: ``redroll.testing.Pipeline`` and its ``join()``, burst workers and consumers
(in-process and as ``redroll worker --burst`` / ``redroll consume --burst`` processes)."""

from __future__ import annotations

import asyncio

import pytest

from redroll.consumer.runner import ConsumerRunner
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.ops.backlog import Backlog, group_backlog, requests_left
from redroll.producer.client import make_request, send
from redroll.shared.keys import WORKERS_GROUP
from redroll.testing import RECORDS_GROUP, JoinTimeout, Pipeline
from tests.conftest import read_jsonl, run_until_drained, spawn, stop_process


def _requests(n: int, prefix: str = "r", **fields) -> list:
    return [make_request(request_id=f"{prefix}{i}", prompt=f"p{i}", sampling_params={"max_new_tokens": 3},
                         **fields) for i in range(n)]


async def _finished(r, stream: str, group: str) -> bool:
    return int((await r.xpending(stream, group))["pending"]) == 0


# ---------------------------------------------------------------- Pipeline


async def test_pipeline_join_waits_for_every_record_and_every_group(settings):
    scored: list[str] = []
    logged: list[str] = []

    async def slow_score(record) -> None:  # (an async handler: join must wait for its ack, not its call)
        await asyncio.sleep(0.001)
        scored.append(record.request_id)

    async with Pipeline(settings, workers=2) as pipeline:
        pipeline.consume("trainer", {"score": slow_score})
        pipeline.consume("audit", default_handler=lambda rec: logged.append(rec.request_id))
        await pipeline.send(_requests(40, callback="score") + _requests(10, prefix="plain"))
        await pipeline.join(timeout=60)
        assert pipeline.missing() == {}
        assert set(pipeline.records) == {f"r{i}" for i in range(40)} | {f"plain{i}" for i in range(10)}
        # each group applied what it has a handler for, once: "score" records in trainer, the
        # callback-less ones in audit (audit has no "score" handler: those stay pending there)
        assert sorted(scored) == sorted(f"r{i}" for i in range(40))
        assert sorted(logged) == sorted(f"plain{i}" for i in range(10))
        assert pipeline.applied["trainer"] == set(scored)
        pending = pipeline.redis.xpending
        assert int((await pending(settings.keys.results, "trainer"))["pending"]) == 10  # (the plain ones)
        assert int((await pending(settings.keys.results, "audit"))["pending"]) == 40
        assert await _finished(pipeline.redis, settings.keys.requests, WORKERS_GROUP)
    assert all(t.done() for t in pipeline._tasks)


async def test_pipeline_on_the_embedded_redis_and_a_later_consumer():
    """No settings: the embedded Redis, a namespace of its own. A group started after the records
    were published still applies them (its group starts at the stream's beginning)."""
    got: list[str] = []
    async with Pipeline(claim_idle_ms=2000) as pipeline:
        assert pipeline.settings.claim_idle_ms == 2000
        await pipeline.send(_requests(5))
        await pipeline.join(timeout=60)  # records only: no group yet
        pipeline.consume("late", default_handler=lambda rec: got.append(rec.request_id))
        await pipeline.join(timeout=60)
        assert sorted(got) == [f"r{i}" for i in range(5)]
        assert all(rec.status.value == "finished" for rec in pipeline.records.values())


async def test_join_names_what_is_missing(settings):
    def refuse(record) -> None:
        raise RuntimeError("no")

    async with Pipeline(settings.with_(max_deliveries=50)) as pipeline:
        pipeline.consume("picky", default_handler=refuse)
        await pipeline.send(_requests(3))
        with pytest.raises(JoinTimeout, match=r"3 not applied by group 'picky' \(e.g. r0, r1, r2\)"):
            await pipeline.join(timeout=1.0)
        assert pipeline.missing() == {"picky": ["r0", "r1", "r2"]}


async def test_join_fails_at_once_when_a_role_crashed(settings):
    async with Pipeline(settings, workers=0) as pipeline:
        pipeline.add_worker(engine=_EngineThatCannotStart())
        await pipeline.send(_requests(1))
        with pytest.raises(RuntimeError, match="crashed: OSError.'no device'"):
            await pipeline.join(timeout=60)


class _EngineThatCannotStart(SyntheticEngine):
    async def start(self) -> None:
        raise OSError("no device")


async def test_the_pipelines_own_group_is_refused(settings):
    async with Pipeline(settings, workers=0) as pipeline:
        with pytest.raises(ValueError, match=RECORDS_GROUP):
            pipeline.consume(RECORDS_GROUP, default_handler=print)


# ---------------------------------------------------------------- burst, in process


async def test_burst_worker_stops_once_the_queue_is_empty(settings, r):
    await send(settings, r, _requests(60))
    worker = Worker(settings, SyntheticEngine(token_ms=1.0), max_inflight=8, block_ms=100, burst=True)
    await asyncio.wait_for(worker.run(), 60)  # returns on its own
    assert worker.stats.published == 60
    assert await r.xlen(settings.keys.results) == 60
    assert await _finished(r, settings.keys.requests, WORKERS_GROUP)
    assert await r.hlen(settings.keys.workers) == 0  # deregistered as on a drain


async def test_burst_worker_stops_after_a_queued_request_was_cancelled(settings, r):
    """A cancelled queued request is deleted from the stream ahead of the group's position (where
    Redis 7.0 then reports a lag that never reaches 0): the burst worker stops all the same."""
    ids = await send(settings, r, _requests(5))
    await r.xgroup_create(settings.keys.requests, WORKERS_GROUP, id="0")
    await r.xdel(settings.keys.requests, ids[3])
    worker = Worker(settings, SyntheticEngine(), block_ms=100, burst=True)
    await asyncio.wait_for(worker.run(), 30)
    assert worker.stats.published == 4


async def test_burst_worker_with_nothing_to_do_exits_at_once(settings):
    worker = Worker(settings, SyntheticEngine(), block_ms=100, burst=True)
    await asyncio.wait_for(worker.run(), 30)
    assert worker.stats.claimed == 0


async def test_burst_worker_takes_over_what_a_dead_worker_held(settings, r):
    """Entries claimed by a worker that died are not 'done': the burst worker reclaims and runs them."""
    await send(settings, r, _requests(4))
    await r.xgroup_create(settings.keys.requests, WORKERS_GROUP, id="0")
    await r.xreadgroup(WORKERS_GROUP, "gone-worker", {settings.keys.requests: ">"}, count=4)
    worker = Worker(settings, SyntheticEngine(), block_ms=100, burst=True)
    await asyncio.wait_for(worker.run(), 60)
    assert worker.stats.reclaimed == 4
    assert await r.xlen(settings.keys.results) == 4


async def test_burst_consumer_waits_for_records_still_to_come(settings, r):
    """Requests queued with no worker yet: the burst consumer keeps running; once a worker runs them
    it applies every record and stops, leaving a record it has no handler for pending."""
    applied: list[str] = []
    await send(settings, r, _requests(20) + _requests(1, prefix="other", callback="elsewhere"))
    consumer = ConsumerRunner(settings, group="g", default_handler=lambda rec: applied.append(rec.request_id),
                              block_ms=100, burst=True, redis_client=r)
    consuming = asyncio.create_task(consumer.run())
    assert not await consumer.idle()  # (nothing ran yet: 21 requests are queued)
    worker = Worker(settings, SyntheticEngine(), block_ms=100, burst=True)
    await asyncio.wait_for(asyncio.gather(worker.run(), consuming), 60)
    assert sorted(applied) == sorted(f"r{i}" for i in range(20))
    assert consumer.stats.unhandled >= 1
    assert int((await r.xpending(settings.keys.results, "g"))["pending"]) == 1


# ---------------------------------------------------------------- burst, as processes


@pytest.mark.timeout(120)
async def test_cli_burst_worker_and_consumer_exit_zero(settings, r, tmp_path):
    applied_file = tmp_path / "applied.jsonl"
    await send(settings, r, _requests(30))
    consumer = spawn(settings, "consume", "--group", "g", "--default-handler", "tests.handlers:append_to_file",
                     "--burst", REDROLL_TEST_APPLIED=str(applied_file))
    worker = spawn(settings, "worker", "--engine", "synthetic", "--burst")
    try:
        assert await asyncio.to_thread(worker.wait, 90) == 0
        assert await asyncio.to_thread(consumer.wait, 90) == 0
    finally:
        for proc in (worker, consumer):
            stop_process(proc)
    assert sorted(x["request_id"] for x in read_jsonl(applied_file)) == sorted(f"r{i}" for i in range(30))


# ---------------------------------------------------------------- the backlog a burst stop reads


async def test_requests_left_counts_queued_and_claimed_entries(settings, r):
    parts = settings.partition_keys
    assert await requests_left(r, parts) == 0  # (no stream yet)
    await send(settings, r, _requests(3) + _requests(1, prefix="hi", priority=1))
    assert await requests_left(r, parts) == 4
    await r.xgroup_create(settings.keys.requests, WORKERS_GROUP, id="0")
    await r.xreadgroup(WORKERS_GROUP, "someone", {settings.keys.requests: ">"}, count=2)
    assert await requests_left(r, parts) == 4  # claimed is not done
    await run_until_drained(Worker(settings, SyntheticEngine(), block_ms=100), timeout=30)
    assert await requests_left(r, parts) == 0


async def test_group_backlog_is_pending_plus_lag(settings, r):
    stream = settings.keys.results
    for i in range(3):
        await r.xadd(stream, {"n": i})
    assert await group_backlog(r, [stream, "absent"], "g") == Backlog(1, 0)  # no group: not read
    await r.xgroup_create(stream, "g", id="0")
    assert await group_backlog(r, [stream], "g") == Backlog(3, 0)
    got = await r.xreadgroup("g", "c", {stream: ">"}, count=2)
    assert await group_backlog(r, [stream], "g") == Backlog(1, 2)
    await r.xack(stream, "g", *[i for i, _ in got[0][1]])
    await r.xreadgroup("g", "c", {stream: ">"}, count=10)
    assert await group_backlog(r, [stream], "g") == Backlog(0, 1)
