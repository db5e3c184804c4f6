"""The worker loop against a real redis-server: abort, deadlines, heartbeats, in-flight bound, leases."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from redroll.engine_worker.engines.base import SampleOutput
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer import Producer
from redroll.producer.client import make_request, send
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.types import RecordStatus
from tests.conftest import run_until_drained, wait_until


async def start_worker(settings, token_ms: float = 0.0, **kw) -> tuple[Worker, asyncio.Task]:
    worker = Worker(settings, SyntheticEngine(token_ms=token_ms, vocab_size=1000), **kw)
    return worker, asyncio.create_task(worker.run())


async def stop(worker: Worker, task: asyncio.Task) -> None:
    worker.request_stop()
    await asyncio.wait_for(task, 15)


async def test_n_samples_and_meta(settings):
    worker, task = await start_worker(settings)
    async with Producer(settings) as p:
        rec = await asyncio.wait_for(await p.submit(
            input_ids=[1, 2, 3], return_logprob=True, meta_info={"step": 7},
            sampling_params={"n": 4, "max_new_tokens": 9}), 10)
    await stop(worker, task)
    assert rec.status is RecordStatus.FINISHED
    assert len(rec.output_token_ids) == 4 and rec.finish_reasons == ["length"] * 4
    assert all(len(ids) == 9 == len(lp) for ids, lp in zip(rec.output_token_ids, rec.output_logprobs))
    assert len({tuple(ids) for ids in rec.output_token_ids}) == 4  # samples differ
    m = rec.meta_info
    assert m["step"] == 7 and m["prompt_tokens"] == 3 and m["completion_tokens"] == 36
    assert m["worker"] == worker.name and m["attempt"] == 1 and m["weight_version"] == "0"
    assert m["queue_ms"] >= 0 and m["engine_ms"] >= 0


@pytest.mark.parametrize("collect", [False, True])
async def test_abort_before_start(settings, collect):
    async with Producer(settings) as p:
        fut = await p.submit(request_id="queued-1", prompt="x", collect_unfinished=collect,
                             sampling_params={"max_new_tokens": 5, "n": 2})
        await p.abort(["queued-1"])
        worker, task = await start_worker(settings)
        rec = await asyncio.wait_for(fut, 10)
    await stop(worker, task)
    assert rec.status is RecordStatus.ABORTED
    assert rec.finish_reasons == [None, None] and rec.output_token_ids == [[], []]


@pytest.mark.parametrize("collect", [False, True])
async def test_abort_during_generation(settings, collect):
    worker, task = await start_worker(settings, token_ms=20)
    async with Producer(settings) as p:
        fut = await p.submit(request_id="running-1", prompt="x", collect_unfinished=collect, return_logprob=True,
                             sampling_params={"max_new_tokens": 200})
        other = await p.submit(prompt="y", sampling_params={"max_new_tokens": 3})
        await wait_until(lambda: any(f.request and f.request.request_id == "running-1"
                                     for f in worker.flights))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await p.abort(["running-1"])
        rec = await asyncio.wait_for(fut, 10)
        assert time.monotonic() - started < 2.0  # stopped, not run to the end (4 s)
        assert (await asyncio.wait_for(other, 10)).status is RecordStatus.FINISHED
    await stop(worker, task)
    assert rec.status is RecordStatus.ABORTED
    if collect:
        assert rec.finish_reasons == ["abort"]
        n = len(rec.output_token_ids[0])
        assert 0 < n < 200 and len(rec.output_logprobs[0]) == n
    else:
        assert rec.finish_reasons == [None] and rec.output_token_ids == [[]]


async def test_abort_by_group(settings):
    worker, task = await start_worker(settings, token_ms=20)
    async with Producer(settings) as p:
        futs = await p.submit_many([dict(request_id=f"g-{i}", prompt="x", group_id="grp",
                                         sampling_params={"max_new_tokens": 200}) for i in range(3)])
        await wait_until(lambda: sum(f.request is not None for f in worker.flights) == 3)
        await p.abort(group_id="grp")
        recs = await asyncio.wait_for(asyncio.gather(*futs), 10)
    await stop(worker, task)
    assert [r.status for r in recs] == [RecordStatus.ABORTED] * 3


async def test_deadline(settings):
    worker, task = await start_worker(settings, token_ms=20)
    async with Producer(settings) as p:
        past = await p.submit(prompt="x", deadline=time.time() - 1, sampling_params={"max_new_tokens": 5})
        # (2 s: time to claim it on a busy machine; its 500 tokens take 10 s, so it expires mid-way)
        mid = await p.submit(prompt="y", deadline=time.time() + 2.0, collect_unfinished=True,
                             sampling_params={"max_new_tokens": 500})
        r_past, r_mid = await asyncio.wait_for(asyncio.gather(past, mid), 10)
    await stop(worker, task)
    assert r_past.status is RecordStatus.EXPIRED and r_past.finish_reasons == [None]
    assert r_mid.status is RecordStatus.EXPIRED and r_mid.finish_reasons == ["abort"]
    assert 0 < len(r_mid.output_token_ids[0]) < 500


async def test_heartbeat_and_deregistration(settings, r):
    worker, task = await start_worker(settings)
    await wait_until(lambda: r.hexists(settings.keys.workers, worker.name))
    beat = json.loads(await r.hget(settings.keys.workers, worker.name))
    assert beat["engine"] == "synthetic" and beat["inflight"] == 0 and beat["state"] == "running"
    assert {"host", "pid", "model", "weight_version", "started", "seen"} <= set(beat)
    await stop(worker, task)
    assert not await r.hexists(settings.keys.workers, worker.name)


async def test_inflight_bound(settings, r):
    """max_inflight bounds what is in the engine; a slot is given back when generation ends, so the
    next claim overlaps the finish round trip (claimed-but-unacked can briefly reach twice that)."""
    worker, task = await start_worker(settings, token_ms=10, max_inflight=3)
    await asyncio.wait_for(worker.started.wait(), 10)  # (its group exists: XPENDING below reads it)
    peak_engine = peak_pending = 0
    async with Producer(settings) as p:
        futs = await p.submit_many([dict(prompt=str(i), sampling_params={"max_new_tokens": 10}) for i in range(15)])
        gathered = asyncio.ensure_future(asyncio.gather(*futs))
        while not gathered.done():
            info = await r.xpending(settings.keys.requests, WORKERS_GROUP)
            peak_pending = max(peak_pending, int(info["pending"]))
            peak_engine = max(peak_engine, worker.generating_count)
            await asyncio.sleep(0.002)
        assert all(rec.ok for rec in gathered.result())
    await stop(worker, task)
    assert 1 <= peak_engine <= 3
    assert peak_pending <= 6


async def test_a_request_stream_that_lost_its_group_is_read_again_while_the_others_are_served(settings, r):
    """The high-priority stream loses its group (deleted, as on a server that restarted empty) while
    the worker works through a backlog: the backlog keeps running, the group is made again, and a
    high-priority request submitted meanwhile is served."""
    worker, task = await start_worker(settings, token_ms=2, max_inflight=4)
    async with Producer(settings) as p:
        normal = await p.submit_many([dict(prompt=str(i), sampling_params={"max_new_tokens": 5}) for i in range(40)])
        await wait_until(lambda: worker.stats.published >= 4)
        await r.delete(settings.keys.requests_high)
        high = await p.submit(prompt="h", priority=1, sampling_params={"max_new_tokens": 5})
        records = await asyncio.wait_for(asyncio.gather(*normal, high), 30)
    await stop(worker, task)
    assert all(rec.ok for rec in records)
    groups = [g["name"] for g in await r.xinfo_groups(settings.keys.requests_high)]
    assert groups == [WORKERS_GROUP.encode()]


async def test_lease_renewal_keeps_long_generation(settings, r):
    """A generation lasting 3x claim_idle is not stolen by another worker."""
    long_ms = 3 * settings.claim_idle_ms
    w1, t1 = await start_worker(settings, token_ms=long_ms / 10)
    async with Producer(settings) as p:
        fut = await p.submit(prompt="long", sampling_params={"max_new_tokens": 10})
        await wait_until(lambda: w1.inflight_count == 1)
        w2, t2 = await start_worker(settings)
        rec = await asyncio.wait_for(fut, long_ms / 1000 + 10)
    await stop(w1, t1)
    await stop(w2, t2)
    assert rec.status is RecordStatus.FINISHED and rec.meta_info["worker"] == w1.name
    assert w2.stats.reclaimed == 0 and w1.stats.fenced == 0


async def test_drain_longer_than_claim_idle_keeps_leases(settings, r):
    """Work finishing during a drain that outlasts claim_idle is not stolen: leases are renewed."""
    s = settings.with_(drain_timeout_s=10.0)
    long_ms = 2 * s.claim_idle_ms
    w1, t1 = await start_worker(s, token_ms=long_ms / 10)
    async with Producer(s) as p:
        fut = await p.submit(prompt="long", sampling_params={"max_new_tokens": 10})
        await wait_until(lambda: w1.inflight_count == 1)
        # (once it made a token: its pace says it ends inside the notice, so it is let finish there)
        await wait_until(lambda: any((w1.engine.partial(f.handle) or SampleOutput([], None, None)).token_ids
                                     for f in w1.flights), 10)
        w1.request_stop()  # the notice begins; the generation needs about 2 x claim_idle more
        w2, t2 = await start_worker(s)
        rec = await asyncio.wait_for(fut, long_ms / 1000 + 10)
        await asyncio.wait_for(t1, 15)
    await stop(w2, t2)
    assert rec.status is RecordStatus.FINISHED and rec.meta_info["worker"] == w1.name
    assert w2.stats.reclaimed == 0 and w1.stats.fenced == 0


class _Counting(SyntheticEngine):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.generated: list[str] = []
        self.running = self.most_at_once = 0

    async def generate(self, request, handle):
        self.generated.append(request.request_id)
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            return await super().generate(request, handle)
        finally:
            self.running -= 1


async def test_a_stop_ends_an_idle_claim_read_at_once(settings, r):
    """An idle worker's claim read waits long (few commands for an idle fleet); a stop cuts it short
    (CLIENT UNBLOCK): the worker stops at once, and what is submitted afterwards stays queued."""
    worker = Worker(settings, SyntheticEngine(), max_inflight=8)
    task = asyncio.create_task(worker.run())
    await wait_until(lambda: worker.state() == "running")
    await asyncio.sleep(0.3)  # the claim read is blocking now
    assert worker._claimer.readers[0].block_ms >= 10_000
    stopped_at = time.monotonic()
    worker.request_stop()
    await asyncio.wait_for(task, 10)
    assert time.monotonic() - stopped_at < 2.0 and worker.stats.claimed == 0
    await send(settings, r, [make_request(request_id="after", prompt="x")])
    assert await r.xlen(settings.keys.requests) == 1
    assert await r.xpending(settings.keys.requests, "workers") == {"pending": 0, "min": None, "max": None,
                                                                 "consumers": []}


async def test_entries_claimed_after_the_stop_began_go_back_at_once(settings, r, monkeypatch):
    """A claim read that Redis answers before the stop's cut reaches it (here: a read that is not
    cut short at all) returns entries submitted after the stop: they are handed back (delivery
    count unchanged), never started, and another worker runs them."""
    from redroll.engine_worker.blocking import BlockingRead

    async def not_cut(self) -> None:
        return None

    monkeypatch.setattr(BlockingRead, "interrupt", not_cut)
    engine = _Counting()
    worker = Worker(settings, engine, max_inflight=8, block_ms=3000)
    task = asyncio.create_task(worker.run())
    await wait_until(lambda: worker.stats.claimed == 0 and worker.state() == "running")
    await asyncio.sleep(0.3)  # the claim read is blocking now
    worker.request_stop()
    await send(settings, r, [make_request(request_id=f"late-{i}", prompt="x") for i in range(3)])
    await asyncio.wait_for(task, 10)
    assert engine.generated == [] and worker.stats.claimed == 3 and worker.stats.handed_back == 3
    pending = await r.xpending_range(settings.keys.requests, "workers", min="-", max="+", count=10)
    assert len(pending) == 3 and all(int(p["times_delivered"]) == 1 for p in pending)
    assert all(int(p["time_since_delivered"]) >= settings.claim_idle_ms for p in pending)
    second = Worker(settings, SyntheticEngine(), max_inflight=8, block_ms=200)
    await run_until_drained(second, timeout=30)
    assert second.stats.published == 3
    collected = [f[b"rid"] for _, f in await r.xrange(settings.keys.results)]
    assert sorted(collected) == [b"late-0", b"late-1", b"late-2"]


async def test_entries_read_without_a_reply_are_reclaimed_in_bulk(settings, r, monkeypatch):
    """A claim read the server ran but whose reply was lost, then retried by the client itself (as
    redis-py does on a dropped connection): the entries sit in this worker's pending list unknown
    to it. Its reclaim pass takes them back after claim_idle, all at once (they never ran, so they
    are no suspects to run alone), and runs them."""
    from redroll.engine_worker.blocking import BlockingRead

    original = BlockingRead.read
    state = {"swallowed": 0}

    async def retried_read(self, streams, count, block_ms=None):
        result = await original(self, streams, count, block_ms)
        if result and state["swallowed"] == 0:
            state["swallowed"] += 1
            return await original(self, streams, count, block_ms)  # the silent retry
        return result

    monkeypatch.setattr(BlockingRead, "read", retried_read)
    engine = _Counting(token_ms=50)
    worker = Worker(settings, engine, max_inflight=8, block_ms=200)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.started.wait(), 10)
    await asyncio.sleep(0.2)
    await send(settings, r, [make_request(request_id=f"unseen-{i}", prompt="x") for i in range(4)])
    try:
        await wait_until(lambda: worker.stats.published == 4, timeout=15)
    finally:
        await stop(worker, task)
    assert state["swallowed"] == 1 and worker.stats.reclaimed == 4
    assert engine.most_at_once == 4  # together, not one at a time
    collected = [f[b"rid"] for _, f in await r.xrange(settings.keys.results)]
    assert sorted(collected) == [f"unseen-{i}".encode() for i in range(4)]


async def test_a_previous_runs_entries_under_the_same_name_are_still_suspects(settings, r):
    """A worker restarted with the same ``--name`` after a crash finds the entries its previous run
    had in flight under its name: they may be what crashed it, so they are run alone, one at a time,
    like any dead worker's (only entries delivered to this run are taken back in bulk)."""
    await send(settings, r, [make_request(request_id=f"before-{i}", prompt="x") for i in range(2)])
    await r.xgroup_create(settings.keys.requests, WORKERS_GROUP, id="0", mkstream=True)
    taken = await r.xreadgroup(WORKERS_GROUP, "fixed-name", {settings.keys.requests: ">"}, count=10)
    assert len(taken[0][1]) == 2  # the previous run's claim; then it died
    await asyncio.sleep(0.05)  # (its restart)
    engine = _Counting(token_ms=50)
    worker = Worker(settings, engine, max_inflight=8, block_ms=200, name="fixed-name")
    await run_until_drained(worker, timeout=30)
    assert worker.stats.published == 2 and worker.stats.reclaimed == 2 and engine.most_at_once == 1  # one at a time


async def test_a_stop_while_a_suspect_runs_alone_drains_it_in_time_and_hands_it_back(settings, r):
    """A stop while a dead worker's entry runs alone: the drain waits for it up to its timeout,
    then aborts it and hands it back. (It once waited for the suspect to end, past the drain's
    bound, and closing the engine published an aborted record nobody had asked for.)"""
    s = settings.with_(drain_timeout_s=0.5)
    await send(s, r, [make_request(request_id="suspect-1", prompt="x", sampling_params={"max_new_tokens": 100})])
    await r.xgroup_create(s.keys.requests, WORKERS_GROUP, id="0", mkstream=True)
    await r.xreadgroup(WORKERS_GROUP, "dead-worker", {s.keys.requests: ">"}, count=10)
    await asyncio.sleep(s.claim_idle_ms / 1000 + 0.1)
    worker = Worker(s, SyntheticEngine(token_ms=200), max_inflight=4, block_ms=200)  # (20 s of generation)
    task = asyncio.create_task(worker.run())
    await wait_until(lambda: worker.stats.reclaimed == 1 and worker.inflight_count == 1, timeout=10)
    started = time.monotonic()
    await stop(worker, task)
    assert time.monotonic() - started < s.drain_timeout_s + 2
    assert worker.stats.handed_back == 1 and worker.stats.published == 0
    [entry] = await r.xpending_range(s.keys.requests, WORKERS_GROUP, min="-", max="+", count=10)
    assert entry["time_since_delivered"] >= s.claim_idle_ms  # (handed back: reclaimable at once)
    await asyncio.sleep(0.3)
    assert await r.xlen(s.keys.results) == 0


async def test_a_drain_leaves_no_hand_back_note_for_an_entry_that_was_not_its_own_any_more(settings, r):
    """An entry finished or taken elsewhere before the drain handed it back: its note is not left
    behind in {ns}:errors (nothing else would ever delete it); a handed-back one keeps its note."""
    s = settings.with_(drain_timeout_s=0.3, heartbeat_s=30.0, claim_idle_ms=90_000)  # (no lease renewal meanwhile)
    await send(s, r, [make_request(request_id=f"long-{i}", prompt=f"x{i}", sampling_params={"max_new_tokens": 100})
                      for i in range(2)])
    worker, task = await start_worker(s, token_ms=200)  # (20 s of generation each)
    await wait_until(lambda: worker.inflight_count == 2, timeout=10)
    (gone, _), (kept, _) = await r.xrange(s.keys.requests)
    await r.xack(s.keys.requests, WORKERS_GROUP, gone)  # (as if it had finished meanwhile)
    await r.xdel(s.keys.requests, gone)
    await stop(worker, task)
    assert worker.stats.handed_back == 1 and worker.stats.published == 0
    notes = await r.hgetall(s.keys.errors)
    assert list(notes) == [kept] and b"(notice" in notes[kept]  # (keyed by entry id on the plain stream)


@pytest.mark.parametrize("cap", [0, -1, 2])
async def test_records_to_the_results_stream_under_any_cap_setting(settings, r, cap):
    # 0 or less: no MAXLEN; above: an approximate one. A cap setting never makes a record refused.
    s = settings.with_(results_max_len=cap)
    worker, task = await start_worker(s)
    # (without text: the five records fit in one stream node, which ~ trims whole or not at all)
    await send(s, r, [make_request(request_id=f"capped-{i}", prompt="x", return_text=False) for i in range(5)])

    async def published() -> bool:
        return await r.xlen(s.keys.results) == 5

    await wait_until(published, timeout=10)
    await stop(worker, task)
    rids = sorted(f[b"rid"].decode() for _, f in await r.xrange(s.keys.results))
    assert rids == [f"capped-{i}" for i in range(5)]  # (~ trims whole nodes only: 5 entries stay)
    assert await r.xlen(s.keys.dead) == 0
