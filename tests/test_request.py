"""engine_worker.request with an instant engine: a claim's entries run in one task, one batch at a
time, their records queued for publishing a chunk at a time while the rest run; entries that need
more than the engine leave it for a task of their own, each with the outcome it has on the
per-request path; a finish round trip that fails is retried per entry."""

from __future__ import annotations

import asyncio
import time

import redis

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.request import BATCH_CHUNK
from redroll.engine_worker.worker import Worker
from redroll.producer.client import make_request, send
from redroll.shared.codec import decode_record
from redroll.shared.types import RecordStatus
from tests.conftest import wait_until


async def records(r, settings, count: int, timeout: float = 20.0) -> dict[str, object]:
    """The first ``count`` records of the results stream, by request_id (each checked to be alone)."""
    async def enough() -> bool:
        return await r.xlen(settings.keys.results) >= count
    await wait_until(enough, timeout=timeout)
    out = {}
    for _, fields in await r.xrange(settings.keys.results):
        rec = decode_record(fields)
        assert rec.request_id not in out, f"two records for {rec.request_id}"
        out[rec.request_id] = rec
    return out


async def run_worker(settings, engine: SyntheticEngine, **kw) -> tuple[Worker, asyncio.Task]:
    worker = Worker(settings, engine, block_ms=200, **kw)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.started.wait(), 10)
    return worker, task


async def stop(worker: Worker, task: asyncio.Task) -> None:
    worker.request_stop()
    await asyncio.wait_for(task, 15)


async def test_a_claim_of_plain_requests_runs_in_one_task_and_publishes_a_chunk_a_call(settings, r):
    engine = SyntheticEngine(vocab_size=1000)
    requests = [make_request(request_id=f"plain-{i}", input_ids=[1, 2, i], return_logprob=True,
                             meta_info={"i": i}, sampling_params={"max_new_tokens": 5, "n": 2}) for i in range(40)]
    await send(settings, r, requests)  # (queued before the worker starts: one claim reads them all)
    worker, task = await run_worker(settings, engine, max_inflight=64)
    got = await records(r, settings, 40)
    publisher = worker._outcomes.ctx.publisher  # type: ignore[union-attr]
    flushes = publisher.flushes
    await stop(worker, task)
    assert 1 <= flushes <= -(-40 // BATCH_CHUNK)  # (chunks queued during a flush go out with the next)
    assert worker.stats.claimed == 40 and worker.stats.published == 40
    for req in requests:
        rec = got[req.request_id]
        assert rec.status is RecordStatus.FINISHED and rec.finish_reasons == ["length", "length"]
        assert rec.output_token_ids == [engine.tokens_for(req, k)[0] for k in range(2)]
        assert rec.output_logprobs == [engine.tokens_for(req, k)[1] for k in range(2)]
        m = rec.meta_info
        assert m["i"] == req.meta_info["i"] and m["attempt"] == 1 and m["completion_tokens"] == 10
        assert m["worker"] == worker.name and m["queue_ms"] >= 0 and m["engine_ms"] >= 0
    assert await r.xlen(settings.keys.requests) == 0
    assert not [k async for k in r.scan_iter(match=settings.keys.rid("*"))]  # every rid key released


class CountingEngine(SyntheticEngine):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.made = 0

    def generate_now(self, request):
        self.made += 1
        return super().generate_now(request)


async def test_a_batchs_records_are_queued_a_chunk_at_a_time_while_the_rest_run(settings, r):
    engine = CountingEngine()
    await send(settings, r, [make_request(request_id=f"chunk-{i}", prompt="x", sampling_params={"max_new_tokens": 2})
                             for i in range(100)])
    worker = Worker(settings, engine, block_ms=200, max_inflight=128)
    queued: list[tuple[int, int]] = []  # (records queued by this call, outputs made when it was called)
    real_wire = worker._wire  # (the publisher exists once the worker is wired: wrapped then)

    def wire():
        wired = real_wire()
        real = worker._outcomes.ctx.publisher.finish_many

        def finish_many(finishes):
            queued.append((len(finishes), engine.made))
            return real(finishes)

        worker._outcomes.ctx.publisher.finish_many = finish_many
        return wired

    worker._wire = wire
    task = asyncio.create_task(worker.run())
    await records(r, settings, 100)
    await stop(worker, task)
    assert [n for n, _ in queued] == [BATCH_CHUNK] * (100 // BATCH_CHUNK) + [100 % BATCH_CHUNK]
    assert [made for _, made in queued] == [min(100, BATCH_CHUNK * (i + 1)) for i in range(len(queued))]


async def test_entries_that_need_more_than_the_engine_get_their_own_outcome_beside_a_batch(settings, r):
    settings = settings.with_(max_deliveries=2)
    keys = settings.keys
    plain = [make_request(request_id=f"ok-{i}", prompt=f"fine {i}", sampling_params={"max_new_tokens": 3})
             for i in range(6)]
    special = [
        make_request(request_id="aborted-1", prompt="x", sampling_params={"max_new_tokens": 3}),
        make_request(request_id="expired-1", prompt="x", deadline=time.time() - 1,
                     sampling_params={"max_new_tokens": 3}),
        make_request(request_id="later-1", prompt="x", deadline=time.time() + 60,
                     sampling_params={"max_new_tokens": 3}),
        make_request(request_id="poison-1", prompt="a POISON prompt", sampling_params={"max_new_tokens": 3}),
        make_request(request_id="future-1", prompt="x", min_weight_version=9,
                     sampling_params={"max_new_tokens": 3}),
    ]
    await send(settings, r, [*plain[:3], *special, *plain[3:]])
    await r.zadd(keys.aborted, {"r:aborted-1": time.time()})
    await r.xadd(keys.requests, {"rid": "garbage-1", "reply_to": keys.results, "data": b"\xc1 not msgpack"})
    worker, task = await run_worker(settings, SyntheticEngine(vocab_size=1000, raise_marker="POISON"))
    got = await records(r, settings, len(plain) + len(special) + 1)
    await stop(worker, task)
    assert all(got[q.request_id].status is RecordStatus.FINISHED for q in plain)
    assert got["later-1"].status is RecordStatus.FINISHED  # (a deadline ahead: it runs in the batch)
    assert got["aborted-1"].status is RecordStatus.ABORTED and got["aborted-1"].finish_reasons == [None]
    assert got["expired-1"].status is RecordStatus.EXPIRED
    assert got["poison-1"].status is RecordStatus.ERROR
    assert "RuntimeError: synthetic engine failure for poison-1" in got["poison-1"].error
    assert got["future-1"].status is RecordStatus.ERROR and "min_weight_version" in got["future-1"].error
    assert got["garbage-1"].status is RecordStatus.ERROR and "msgpack" in got["garbage-1"].error
    dead = {f[b"rid"] for _, f in await r.xrange(keys.dead)}
    assert dead == {b"poison-1", b"future-1", b"garbage-1"}
    assert worker.stats.engine_errors == settings.max_deliveries  # the poison one, once per delivery
    assert await r.xlen(keys.requests) == 0 and await r.hlen(keys.errors) == 0


async def test_a_failed_finish_round_trip_is_retried_per_entry_and_publishes_each_once(settings, r):
    worker, task = await run_worker(settings, SyntheticEngine())
    publisher = worker._outcomes.ctx.publisher  # type: ignore[union-attr]
    real, failed = publisher._execute, []

    async def lose_the_first(calls):
        if not failed:
            failed.append(sum(len(c) for c in calls))
            raise redis.ConnectionError("connection lost (test)")
        return await real(calls)

    publisher._execute = lose_the_first
    await send(settings, r, [make_request(request_id=f"again-{i}", prompt="x", sampling_params={"max_new_tokens": 2})
                             for i in range(20)])
    got = await records(r, settings, 20)
    await asyncio.sleep(0.3)  # (a second record would have come by now)
    await stop(worker, task)
    assert failed and failed[0] >= 1 and sorted(got) == sorted(f"again-{i}" for i in range(20))
    assert await r.xlen(settings.keys.results) == 20 and worker.stats.published == 20
    assert worker.stats.engine_errors == 0 and worker.stats.handed_back == 0  # (retried here, not elsewhere)
