"""RL rollout features on a real redis-server: groups, queued aborts, weight versions,
backpressure, staleness, partial rollouts, priorities, seeds."""

from __future__ import annotations

import asyncio
import time

import pytest

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer import Producer
from redroll.producer.client import make_request
from redroll.producer.rollout import staleness_report
from redroll.shared.types import RecordStatus
from tests.conftest import wait_until


async def _start(settings, max_inflight=8, **engine_kw):
    worker = Worker(settings, SyntheticEngine(**engine_kw), max_inflight=max_inflight, block_ms=200)
    return worker, asyncio.create_task(worker.run())


async def _stop(*pairs):
    for worker, _ in pairs:
        worker.request_stop()
    await asyncio.gather(*(t for _, t in pairs))


async def test_group_take_k_aborts_the_rest_and_reports_every_member(settings):
    pair = await _start(settings, max_inflight=2, token_ms=10, jitter=0.9)
    async with Producer(settings) as p:
        group = await p.submit_group(8, group_id="prompt-7", input_ids=[5, 6, 7], return_logprob=True,
                                     sampling_params={"max_new_tokens": 20, "sampling_seed": 100})
        assert group.request_ids == [f"prompt-7_{i:03d}" for i in range(8)]
        outcome = await group.take(3, accept=lambda rec: rec.request_id != "prompt-7_000", timeout=30)
        streamed = [rec async for rec in group.stream()]  # every member has a record
    await _stop(pair)
    assert len(outcome.accepted) == 3 and outcome.members == 8
    assert [rec.request_id for rec in outcome.rejected] == ["prompt-7_000"]
    assert outcome.aborted, "with 2 in flight at a time, some members were still queued or running"
    assert all(rec.status is RecordStatus.ABORTED and rec.group_id == "prompt-7" for rec in outcome.aborted)
    seen = [r.request_id for lst in (outcome.accepted, outcome.rejected, outcome.surplus, outcome.aborted,
                                     outcome.failed) for r in lst]
    assert sorted(seen) == group.request_ids == sorted(r.request_id for r in streamed)
    assert {r.meta_info["group_index"] for r in streamed} == set(range(8))


async def test_queued_abort_is_reported_within_a_second(settings, r):
    async with Producer(settings) as p:  # no worker at all: everything stays queued
        futs = await p.submit_many([dict(request_id=f"q-{i}", prompt="x", collect_unfinished=True,
                                         sampling_params={"n": 2}) for i in range(5)])
        started = time.monotonic()
        cancelled = await p.abort([f"q-{i}" for i in range(5)])
        recs = await asyncio.wait_for(asyncio.gather(*futs), 1.0)
        elapsed = time.monotonic() - started
    assert sorted(cancelled) == [f"q-{i}" for i in range(5)] and elapsed < 1.0
    for rec in recs:
        assert rec.status is RecordStatus.ABORTED and rec.finish_reasons == [None, None]
        assert rec.meta_info["cancelled_in_queue"] is True
    assert await r.xlen(settings.keys.requests) == 0
    # The ids stay held (a producer may not delete rid keys) until housekeeping releases them.
    from redroll.ops.gc import collect_garbage

    assert await r.exists(*(settings.keys.rid(f"q-{i}") for i in range(5))) == 5
    report = await collect_garbage(r, settings.keys, reply_ttl_s=3600)
    assert sorted(report.rid_keys) == sorted(settings.keys.rid(f"q-{i}") for i in range(5))
    assert not await r.exists(settings.keys.rid("q-0"))  # the id can be submitted again


async def test_queued_group_abort_from_producer(settings):
    async with Producer(settings) as p:
        group = await p.submit_group(4, group_id="g-q", prompt="x")
        await p.abort(group_id="g-q")
        recs = await group.wait(timeout=1.0)
    assert [rec.status for rec in recs] == [RecordStatus.ABORTED] * 4


async def test_min_weight_version_is_never_violated(settings, r):
    pairs = [await _start(settings, token_ms=2) for _ in range(2)]
    async with Producer(settings) as p:
        old = await p.submit_many([dict(prompt=f"o{i}", sampling_params={"max_new_tokens": 4}) for i in range(10)])
        assert all(rec.meta_info["weight_version"] == "0" for rec in await asyncio.gather(*old))
        await p.update_weights("/ckpt/1", "1", wait=False)
        # Submitted right away: workers that still run version 0 must not generate these.
        new = await p.submit_many([dict(prompt=f"n{i}", min_weight_version=1, sampling_params={"max_new_tokens": 4})
                                   for i in range(20)])
        recs = await asyncio.wait_for(asyncio.gather(*new), 20)
        assert all(rec.status is RecordStatus.FINISHED and rec.meta_info["weight_version"] == "1" for rec in recs)
        # No update to version 5 is coming: dead-lettered with a clear error, not parked forever.
        too_new = await asyncio.wait_for(await p.submit(prompt="x", min_weight_version=5), 10)
        assert p.weight_version == 1
        report = staleness_report(recs, current_version=2)
        assert report == {"samples": 20, "max": 1, "min": 1, "mean": 1.0, "histogram": {"1": 20}}
    await _stop(*pairs)
    assert too_new.status is RecordStatus.ERROR and "min_weight_version 5" in too_new.error


async def test_waiting_for_weights_then_update_arrives(settings, r):
    pair = await _start(settings)
    await wait_until(lambda: r.hexists(settings.keys.workers, pair[0].name))  # started on version 0
    async with Producer(settings) as p:
        await r.hset(settings.keys.weights, mapping={"model_path": "/ckpt/3", "weight_version": "3"})
        fut = await p.submit(prompt="x", min_weight_version=3, sampling_params={"max_new_tokens": 2})
        await asyncio.sleep(0.5)
        assert not fut.done()  # parked: the desired weights are new enough, this worker's are not
        await p.update_weights("/ckpt/3", "3", timeout=10)
        rec = await asyncio.wait_for(fut, 10)
    await _stop(pair)
    assert rec.status is RecordStatus.FINISHED and rec.meta_info["weight_version"] == "3"


async def test_backpressure_holds_max_inflight(settings, r):
    pair = await _start(settings, max_inflight=16, token_ms=5)
    peak = 0
    async with Producer(settings, max_inflight=4) as p:
        submitting = asyncio.create_task(p.submit_many(
            [dict(prompt=str(i), sampling_params={"max_new_tokens": 4}) for i in range(40)]))
        while not submitting.done():
            peak = max(peak, p.outstanding)
            queued = await r.xlen(settings.keys.requests)
            assert queued <= 4
            await asyncio.sleep(0.002)
        recs = await asyncio.gather(*submitting.result())
    await _stop(pair)
    assert len(recs) == 40 and all(rec.ok for rec in recs)
    assert 1 <= peak <= 4


async def test_staleness_bound_blocks_until_version_advances(settings):
    pair = await _start(settings)
    async with Producer(settings, max_staleness=1, batch_size=5) as p:
        submitting = asyncio.create_task(p.submit_many(
            [dict(request_id=f"s{i}", prompt=str(i), sampling_params={"max_new_tokens": 2}) for i in range(25)]))
        await wait_until(lambda: p.admitted == 10)  # (1 + 0 + 1) * 5
        await asyncio.sleep(0.3)
        assert p.admitted == 10 and not submitting.done()  # blocked, nothing dropped
        p.set_weight_version(1)
        await wait_until(lambda: p.admitted == 15)
        p.set_weight_version(3)
        recs = await asyncio.gather(*await asyncio.wait_for(submitting, 10))
    await _stop(pair)
    assert [rec.request_id for rec in recs] == [f"s{i}" for i in range(25)]


async def test_partial_rollout_stitched_across_a_weight_update(settings):
    pair = await _start(settings, token_ms=20)
    async with Producer(settings) as p:
        task = asyncio.create_task(p.generate_across_updates(
            request_id="long-1", input_ids=[1, 2, 3], return_logprob=True,
            sampling_params={"max_new_tokens": 60, "sampling_seed": 9}))
        await wait_until(lambda: pair[0].inflight_count == 1)
        await asyncio.sleep(0.4)
        await p.update_weights("/ckpt/1", "1", abort_inflight=True, timeout=10)
        rec = await asyncio.wait_for(task, 20)
    await _stop(pair)
    segs = rec.meta_info["segments"]
    assert [s["weight_version"] for s in segs] == ["0", "1"]
    assert segs[0]["finish_reason"] == "abort" and segs[1]["finish_reason"] == "length"
    assert rec.request_id == "long-1" and rec.status is RecordStatus.FINISHED and rec.finish_reasons == ["length"]
    assert len(rec.output_token_ids[0]) == 60 == len(rec.output_logprobs[0]) == sum(s["tokens"] for s in segs)
    assert rec.weight_versions == [["0"] * segs[0]["tokens"] + ["1"] * segs[1]["tokens"]]
    assert rec.token_versions(0) == rec.weight_versions[0]
    # The stitched record is exactly the concatenation of its parts.
    engine = SyntheticEngine()
    first = make_request(request_id="x", input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 60, "sampling_seed": 9})
    ids0, _ = engine.tokens_for(first, 0)
    n0 = segs[0]["tokens"]
    assert rec.output_token_ids[0][:n0] == ids0[:n0] and 0 < n0 < 60
    second = make_request(request_id="y", input_ids=[1, 2, 3] + ids0[:n0],
                          sampling_params={"max_new_tokens": 60 - n0, "sampling_seed": 9})
    assert rec.output_token_ids[0][n0:] == engine.tokens_for(second, 0)[0]


async def test_high_priority_is_claimed_before_queued_normal_requests(settings, r):
    pair = await _start(settings, max_inflight=1, token_ms=5)
    order: list[str] = []
    async with Producer(settings) as p:
        normal = await p.submit_many([dict(request_id=f"n{i}", prompt=str(i), sampling_params={"max_new_tokens": 4})
                                      for i in range(30)], callback=lambda rec: order.append(rec.request_id))
        await wait_until(lambda: len(order) >= 3)
        queued_before = await r.xlen(settings.keys.requests)
        high = await p.submit_many([dict(request_id=f"h{i}", prompt=str(i), priority=1,
                                         sampling_params={"max_new_tokens": 4}) for i in range(3)],
                                   callback=lambda rec: order.append(rec.request_id))
        await asyncio.wait_for(asyncio.gather(*normal, *high), 30)
    await _stop(pair)
    first_high = order.index("h0")
    # At most the one normal request in flight when they arrived finishes between.
    assert order[first_high:first_high + 3] == ["h0", "h1", "h2"]
    assert sum(1 for x in order[:first_high] if x.startswith("n")) <= 30 - queued_before + 1


async def test_same_seed_same_tokens_through_the_pipeline(settings):
    pair = await _start(settings)
    async with Producer(settings) as p:
        a, b, c = await asyncio.gather(*await p.submit_many([
            dict(request_id=rid, input_ids=[4, 5, 6], sampling_params={"max_new_tokens": 12, "sampling_seed": seed})
            for rid, seed in (("a", 7), ("b", 7), ("c", 8))]))
    await _stop(pair)
    assert a.output_token_ids == b.output_token_ids != c.output_token_ids


async def test_same_seed_same_tokens_transformers_engine(settings):
    pytest.importorskip("torch")
    from redroll.engine_worker.engines.transformers_engine import TransformersEngine

    worker = Worker(settings, TransformersEngine("tiny-random"), max_inflight=8, block_ms=200)
    task = asyncio.create_task(worker.run())
    async with Producer(settings) as p:
        recs = await asyncio.wait_for(asyncio.gather(*await p.submit_many([
            dict(request_id=f"t{i}", input_ids=[65, 66 + i % 2], sampling_params={
                "max_new_tokens": 10, "sampling_seed": 3 if i < 4 else 4, "temperature": 1.0})
            for i in range(6)])), 60)
    worker.request_stop()
    await task
    same = {tuple(recs[i].output_token_ids[0]) for i in (0, 2)}
    assert len(same) == 1 and recs[0].output_token_ids == recs[2].output_token_ids
    assert recs[1].output_token_ids == recs[3].output_token_ids


# ---------------------------------------------------------------- cases found checking rollouts from outside


async def test_a_record_cancelled_in_the_queue_carries_the_promised_meta(settings, r):
    async with Producer(settings) as p:  # no worker: it stays queued
        await p.update_weights("/ckpt/7", "7", wait=False)
        fut = await p.submit(request_id="queued-meta", prompt="x", meta_info={"mine": 1})
        await asyncio.sleep(0.05)
        assert await p.abort(["queued-meta"]) == ["queued-meta"]
        rec = await asyncio.wait_for(fut, 2)
    assert rec.status is RecordStatus.ABORTED and rec.finish_reasons == [None]
    meta = rec.meta_info
    assert meta["mine"] == 1 and meta["cancelled_in_queue"] is True and meta["abort_reason"] == "user"
    assert meta["weight_version"] == "7" and meta["worker"] is None and meta["attempt"] == 0
    assert meta["queue_ms"] >= 50


async def test_abort_cancels_the_queued_ones_before_aborting_in_flight(settings):
    # 24 in flight, 16 queued: the in-flight abort frees every slot, so cancelling afterwards would
    # leave the workers to claim (and abort) the queued 16.
    pair = await _start(settings, max_inflight=24, token_ms=50)
    async with Producer(settings) as p:
        futs = await p.submit_many([dict(request_id=f"ab-{i}", prompt=f"x{i}", sampling_params={"max_new_tokens": 400})
                                    for i in range(40)])
        await wait_until(lambda: pair[0].generating_count == 24, 10)
        cancelled = await p.abort([f"ab-{i}" for i in range(40)])
        recs = await asyncio.wait_for(asyncio.gather(*futs), 15)
    await _stop(pair)
    assert len(cancelled) == 16
    in_queue = [rec for rec in recs if rec.meta_info.get("cancelled_in_queue")]
    by_worker = [rec for rec in recs if not rec.meta_info.get("cancelled_in_queue")]
    assert len(in_queue) == 16 and len(by_worker) == 24
    assert all(rec.status is RecordStatus.ABORTED for rec in recs)
    assert pair[0].stats.claimed == 24


class _Unstoppable(SyntheticEngine):
    """Finishes every generation on its own, whatever abort arrives (an abort that came too late)."""

    def abort(self, handle: str) -> None:
        pass


async def test_a_sample_that_finished_as_its_abort_arrived_is_finished(settings):
    worker = Worker(settings, _Unstoppable(token_ms=20), max_inflight=8, block_ms=200)
    task = asyncio.create_task(worker.run())
    async with Producer(settings) as p:
        group = await p.submit_group(4, group_id="late-abort", prompt="x", sampling_params={"max_new_tokens": 10})
        outcome = await group.take(1, timeout=15)
    worker.request_stop()
    await task
    assert len(outcome.accepted) == 1 and outcome.members == 4
    # The other three were running when their abort came and finished anyway: labelled by what
    # happened (finished, finish reason length), so take() files them as surplus.
    assert len(outcome.surplus) == 3 and not outcome.aborted
    assert all(rec.status is RecordStatus.FINISHED and rec.finish_reasons == ["length"] for rec in outcome.surplus)
