"""One bad stream must not loop, duplicate or dead-letter its neighbours (real redis-server).

The traps are what any client with the producer role can do: ``XADD`` an entry with the largest
possible id to a stream of the pipeline (from then on it refuses every new entry), or put a key
of another type where a stream belongs.
"""

from __future__ import annotations

import asyncio
import collections

import pytest

from redroll.consumer.runner import ConsumerRunner
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.ops.repair import repair_stream
from redroll.ops.status import collect_pipeline_status
from redroll.producer.client import Producer, make_request, send
from redroll.shared.refusals import StreamRefusedError
from redroll.shared.types import RecordStatus
from tests.conftest import running, wait_until

LAST_ID = "18446744073709551615-18446744073709551615"
SP = {"max_new_tokens": 4}


async def trap(r, key: str) -> None:
    await r.xadd(key, {"f": "v"}, id=LAST_ID)


def fleet(settings, applied: collections.Counter, **worker_kw):
    worker = Worker(settings, SyntheticEngine(token_ms=1), max_inflight=32, block_ms=100, **worker_kw)
    consumer = ConsumerRunner(settings, group="g", handlers={"h": lambda rec: applied.update([rec.request_id])},
                              block_ms=100)
    return worker, consumer


async def dead_letters(r, settings) -> list[dict]:
    return [{k.decode(): v for k, v in f.items()} for _, f in await r.xrange(settings.keys.dead)]


async def test_a_trapped_reply_stream_costs_only_its_own_request(settings, r):
    keys = settings.keys
    trap_stream = keys.reply("trap")
    await trap(r, trap_stream)
    applied: collections.Counter = collections.Counter()
    worker, consumer = fleet(settings, applied)
    async with running(worker, consumer), Producer(settings, name="good") as producer:
        # One burst: 24 valid requests (12 awaited through the producer, 12 fire-and-forget to
        # a consumer group) and the trap request, all in the same worker batches.
        futures = await producer.submit_many([make_request(request_id=f"p-{i}", prompt=f"p{i}", sampling_params=SP)
                                              for i in range(12)])
        await send(settings, r, [make_request(request_id=f"f-{i}", prompt=f"f{i}", sampling_params=SP, callback="h")
                                 for i in range(12)])
        await send(settings, r, [make_request(request_id="the-trap", prompt="t", sampling_params=SP)],
                   reply_to=trap_stream)
        records = await asyncio.wait_for(asyncio.gather(*futures), 20)
        await wait_until(lambda: sum(applied.values()) == 12, 20)
        await wait_until(lambda: worker.stats.dead_lettered == 1, 10)
        await asyncio.sleep(2.0)  # long enough for any loop to show
        letters = await dead_letters(r, settings)
        assert worker.flights.holds == set() and worker.state() == "running"
    assert all(rec.status is RecordStatus.FINISHED for rec in records)
    assert applied == collections.Counter({f"f-{i}": 1 for i in range(12)})
    assert await r.xlen(keys.results) <= 12 and await r.xlen(producer.reply_to) == 0
    # The trap request: dead-lettered exactly once, the letter names the stream and the error.
    assert len(letters) == 1
    (letter,) = letters
    assert letter["rid"] == b"the-trap" and letter["reply_to"] == trap_stream.encode()
    assert trap_stream.encode() in letter["reason"] and b"exhausted the last possible ID" in letter["reason"]
    assert letter["reply_error"] == letter["reason"]
    assert await r.xlen(keys.requests) == 0 and (await r.xpending(keys.requests, "workers"))["pending"] == 0
    assert worker.stats.published == 24 and worker.stats.engine_errors == 0


async def test_a_producer_whose_reply_stream_is_trapped_learns_from_the_dead_letter(settings, r):
    worker = Worker(settings, SyntheticEngine(), max_inflight=8, block_ms=100)
    async with running(worker), Producer(settings, name="victim") as producer:
        await trap(r, producer.reply_to)
        rec = await asyncio.wait_for(await producer.submit(request_id="lost-1", prompt="x", sampling_params=SP), 15)
    assert rec.status is RecordStatus.ERROR and rec.request_id == "lost-1"
    assert "exhausted the last possible ID" in rec.error and producer.reply_to in rec.error
    assert rec.meta_info["dead_letter"] and rec.meta_info["reply_error"]
    # One letter for the request; the trap entry itself the producer dead-lettered as undecodable.
    letters = await dead_letters(r, settings)
    assert sorted(x["source"] for x in letters) == [b"producer", b"worker"]
    assert [x["rid"] for x in letters if x["source"] == b"worker"] == [b"lost-1"]


async def test_a_trapped_results_stream_blocks_claiming_and_repair_resumes_it(settings, r):
    keys = settings.keys
    await trap(r, keys.results)
    applied: collections.Counter = collections.Counter()
    worker, consumer = fleet(settings, applied)
    async with running(worker, consumer), Producer(settings, name="prod") as producer:
        await send(settings, r, [make_request(request_id=f"f-{i}", prompt=f"f{i}", sampling_params=SP, callback="h")
                                 for i in range(40)])
        await wait_until(lambda: worker.state() == "blocked", 10)
        awaited = await producer.submit(request_id="awaited", prompt="a", sampling_params=SP)
        status = await collect_pipeline_status(r, keys, settings.partition_keys)
        assert any("exhausted the last possible id" in a and keys.results in a for a in status["alerts"])
        await asyncio.sleep(2.0)
        # Nothing loops while it is broken: no request is dead-lettered (the one letter is the trap
        # entry itself, which the consumer group could not decode), claims paused, the records held.
        assert [x["source"] for x in await dead_letters(r, settings)] == [b"consumer:g"]
        # (claims already under way when the first refusal came still land: at most another batch)
        held = len(worker.flights)
        assert 0 < held <= 2 * 32 and worker.stats.claimed == held
        refusals_before = sum(worker.stats.refusals.values())
        await asyncio.sleep(1.0)
        assert worker.stats.claimed == held  # claiming stays paused
        assert sum(worker.stats.refusals.values()) - refusals_before <= held * 2  # backoff, not a spin
        status = await collect_pipeline_status(r, keys, settings.partition_keys)
        assert any(f"worker {worker.name} is blocked" in a for a in status["alerts"])

        report = await repair_stream(r, keys.results)
        assert report.state == "repaired" and report.removed == [LAST_ID] and report.groups_reset == ["g"]
        await wait_until(lambda: sum(applied.values()) == 40, 30)
        assert (await asyncio.wait_for(awaited, 15)).status is RecordStatus.FINISHED
        await wait_until(lambda: worker.state() == "running", 10)
    assert applied == collections.Counter({f"f-{i}": 1 for i in range(40)})
    assert await r.xlen(keys.dead) == 1 and await r.xlen(keys.requests) == 0
    assert (await collect_pipeline_status(r, keys, settings.partition_keys))["alerts"] == []


async def test_wrong_key_types_are_refused_per_item(settings, r):
    keys = settings.keys
    hashy = keys.reply("hashy")
    await r.hset(hashy, "not", "a stream")
    await r.hset(keys.rid("rid-hash"), "not", "a string")
    worker = Worker(settings, SyntheticEngine(), max_inflight=8, block_ms=100)
    async with running(worker), Producer(settings, name="types") as producer:
        # A submit whose rid key is a hash is refused alone; its neighbours in the batch go through.
        futures = await producer.submit_many([make_request(request_id=x, prompt=x, sampling_params=SP)
                                              for x in ("ok-1", "rid-hash", "ok-2")])
        with pytest.raises(StreamRefusedError, match="WRONGTYPE"):
            await futures[1]
        assert [(await asyncio.wait_for(f, 10)).status for f in (futures[0], futures[2])] == \
            [RecordStatus.FINISHED, RecordStatus.FINISHED]
        # A record for a reply stream that is a hash: that request is dead-lettered once.
        await send(settings, r, [make_request(request_id="to-hash", prompt="h", sampling_params=SP)], reply_to=hashy)
        await wait_until(lambda: worker.stats.dead_lettered == 1, 10)
        # A dead stream of another type blocks the worker (it cannot dead-letter anything), until fixed.
        await r.rename(keys.dead, keys.dead + "-saved")
        await r.set(keys.dead, "a string")
        await send(settings, r, [make_request(request_id="to-hash-2", prompt="h", sampling_params=SP)], reply_to=hashy)
        await wait_until(lambda: worker.state() == "blocked", 10)
        await asyncio.sleep(1.0)
        assert worker.stats.dead_lettered == 1
        await r.delete(keys.dead)
        await wait_until(lambda: worker.stats.dead_lettered == 2 and worker.state() == "running", 10)
    first = [{k.decode(): v for k, v in f.items()} for _, f in await r.xrange(keys.dead + "-saved")]
    letters = await dead_letters(r, settings)
    assert [x["rid"] for x in first] == [b"to-hash"] and [x["rid"] for x in letters] == [b"to-hash-2"]
    assert b"WRONGTYPE" in letters[0]["reason"] and hashy.encode() in letters[0]["reason"]
    assert await r.xlen(keys.requests) == 0
