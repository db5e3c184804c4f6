"""Producer client against a real redis-server with an in-process synthetic worker."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis
from redis.asyncio.client import Pipeline

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer import DuplicateRequestError, Producer, make_request
from redroll.shared.codec import encode_record, encode_request
from redroll.shared.keys import PRODUCER_GROUP
from redroll.shared.scripts import Scripts
from redroll.shared.types import RecordStatus
from tests.conftest import wait_until

SP = {"max_new_tokens": 4}


@contextlib.asynccontextmanager
async def running_worker(settings, **engine_kw):
    worker = Worker(settings, SyntheticEngine(**engine_kw), block_ms=100)
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 15)


async def reply_pending(r, producer_name: str, settings) -> int:
    info = await r.xpending(settings.keys.reply(producer_name), PRODUCER_GROUP)
    return int(info["pending"])


# ---------------------------------------------------------------- basic submit / await


async def test_submit_one_and_many_with_callbacks(settings, r):
    calls: dict[str, int] = {}

    def cb(record):
        calls[record.request_id] = calls.get(record.request_id, 0) + 1

    async with running_worker(settings), Producer(settings, block_ms=100) as p:
        fut = await p.submit(prompt="hello", sampling_params=SP)
        rec = await asyncio.wait_for(fut, 10)
        assert rec.status is RecordStatus.FINISHED
        assert len(rec.output_token_ids) == 1 and len(rec.output_token_ids[0]) == 4
        assert p.outstanding == 0

        reqs = [make_request(request_id=f"many-{i}_step1", prompt=f"p{i}",
                             sampling_params={"max_new_tokens": 3 + i % 5, "n": 2}, return_logprob=True)
                for i in range(50)]
        futs = await p.submit_many(reqs, callback=cb)
        assert p.outstanding + len(calls) == 50  # (the worker may have finished some before submit_many returned)
        records = await asyncio.wait_for(asyncio.gather(*futs), 20)
        assert [x.request_id for x in records] == [q.request_id for q in reqs]
        for q, x in zip(reqs, records):
            assert x.status is RecordStatus.FINISHED
            assert len(x.output_token_ids) == 2 and len(x.output_logprobs) == 2
            for ids, lps in zip(x.output_token_ids, x.output_logprobs):
                assert len(ids) == len(lps) == q.sampling_params.max_new_tokens
        assert calls == {q.request_id: 1 for q in reqs}
        assert p.outstanding == 0
        # every handled record was acked and deleted from the private reply stream
        await wait_until(lambda: _xlen_is(r, p.reply_to, 0), timeout=5)
        assert await reply_pending(r, p.name, settings) == 0


async def _xlen_is(r, key: str, n: int) -> bool:
    return await r.xlen(key) == n


async def test_generate_submits_and_waits_in_one_call(settings):
    async with running_worker(settings), Producer(settings, block_ms=100) as p:
        record = await p.generate(prompt="hello", sampling_params=SP, timeout=10)
        assert record.status is RecordStatus.FINISHED and len(record.output_token_ids[0]) == 4
        assert p.outstanding == 0
        with pytest.raises(TimeoutError):  # (a worker that never answers in time; the request goes on)
            await p.generate(prompt="slow", sampling_params={"max_new_tokens": 4}, timeout=0)


async def test_the_reply_reader_survives_an_unexpected_redis_error(settings, monkeypatch):
    """A cluster client that gives up mid-failover raises ClusterError ("TTL exhausted"), which is
    neither a connection nor a response error: the reader reads again instead of ending for good."""
    from redroll.producer import replies

    real = replies.read_group
    raised = asyncio.Event()

    async def flaky(*args, **kwargs):
        if not raised.is_set():
            raised.set()
            raise redis.exceptions.ClusterError("TTL exhausted.")
        return await real(*args, **kwargs)

    async with running_worker(settings), Producer(settings, block_ms=100) as p:
        monkeypatch.setattr(replies, "read_group", flaky)  # (after the start: its reads go on)
        await asyncio.wait_for(raised.wait(), 10)
        record = await p.generate(prompt="after", sampling_params=SP, timeout=20)
    assert record.status is RecordStatus.FINISHED


async def test_a_submit_that_a_cluster_client_gave_up_on_is_sent_again_with_its_token(settings, monkeypatch):
    """A cluster client that gives up mid-resharding raises ClusterError ("TTL exhausted") from the
    submit's pipeline: the producer sends it again with the same tokens, as after a dropped connection."""
    from redroll.producer import client

    real = client.submit_batch
    calls = []

    async def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise redis.exceptions.ClusterError("TTL exhausted.")
        return await real(*args, **kwargs)

    async with running_worker(settings), Producer(settings, block_ms=100) as p:
        monkeypatch.setattr(client, "submit_batch", flaky)
        record = await p.generate(prompt="again", sampling_params=SP, timeout=20)
    assert record.status is RecordStatus.FINISHED and len(calls) == 2


async def test_async_callback_and_as_completed(settings):
    seen: list[str] = []

    async def acb(record):
        await asyncio.sleep(0)
        seen.append(record.request_id)

    async with running_worker(settings, token_ms=1.0), Producer(settings, block_ms=100) as p:
        reqs = [make_request(prompt=f"x{i}", sampling_params={"max_new_tokens": 1 + (7 * i) % 11})
                for i in range(20)]
        futs = await p.submit_many(reqs, callback=acb)
        got = []
        async for rec in p.as_completed(futs):
            got.append(rec.request_id)
        assert sorted(got) == sorted(q.request_id for q in reqs)
        assert len(got) == len(set(got)) == 20
        assert sorted(seen) == sorted(got)
        assert p.outstanding == 0


# ---------------------------------------------------------------- duplicates and retries


async def test_a_restarted_producer_with_tokens_from_ids_takes_over_its_live_requests(settings, r):
    """Same name, ``tokens_from_ids``: a live request submitted again is the first submit (one
    entry, one generation), and its record reaches the new process; random tokens refuse it."""
    async with Producer(settings, name="batch-1", tokens_from_ids=True, block_ms=100) as first:
        await first.submit(request_id="live-1", prompt="x", sampling_params=SP)  # (no worker yet: it stays queued)
    async with Producer(settings, name="batch-1", block_ms=100) as random_tokens:
        with pytest.raises(DuplicateRequestError):
            await random_tokens.submit(request_id="live-1", prompt="x", sampling_params=SP)
    async with Producer(settings, name="batch-1", tokens_from_ids=True, block_ms=100) as again:
        fut = await again.submit(request_id="live-1", prompt="x", sampling_params=SP)
        assert await r.xlen(settings.keys.requests) == 1
        async with running_worker(settings) as worker:
            record = await asyncio.wait_for(fut, 10)
            assert record.status is RecordStatus.FINISHED and worker.stats.claimed == 1


async def test_a_taken_over_request_whose_record_came_before_its_submit_gets_that_record(settings, r):
    """The request finished while no process of that name ran; the restarted producer read its
    record (nobody waited for it yet) before ``start`` returned, so the submit that takes it over,
    sent at once, is resolved with it, its entry acked, and the request not sent (generated) again."""
    async with Producer(settings, name="batch-2", tokens_from_ids=True, block_ms=100) as first:
        await first.submit(request_id="early-1", prompt="x", sampling_params=SP)
    reply = settings.keys.reply("batch-2")
    async with running_worker(settings):
        await wait_until(lambda: r.xlen(reply), timeout=10)
    async with Producer(settings, name="batch-2", tokens_from_ids=True, block_ms=100) as again:
        assert await reply_pending(r, "batch-2", settings) == 1  # (held for unclaimed())
        seen: list = []
        fut = await again.submit(request_id="early-1", prompt="x", sampling_params=SP, callback=seen.append)
        record = await asyncio.wait_for(fut, 5)
        assert record.status is RecordStatus.FINISHED and seen == [record]
        assert await r.xlen(settings.keys.requests) == 0 and await r.xlen(reply) == 0  # (acked and deleted)
        assert again.outstanding == 0


class SubmitAfterItsRecord(Producer):
    """A producer whose submits reach Redis only once the records of their requests were delivered
    here: the instant between a resumed producer's reads and its takeover submit, made to last."""

    async def _submit_with_retry(self, prepared: list, attempts: int = 8) -> list:
        futures = [self.pending.waiting[req.request_id].future for req, _, _ in prepared]
        await asyncio.wait_for(asyncio.gather(*futures), 10)
        return await super()._submit_with_retry(prepared, attempts)


async def test_a_record_that_comes_while_its_takeover_submit_is_on_its_way_is_not_generated_again(settings, r):
    """The request finishes and its record is applied here while the takeover submit is on its
    way: the record's ack waits for that submit, which meets the finished mark and queues nothing;
    then the ack takes the mark out."""
    keys = settings.keys
    async with Producer(settings, name="batch-3", tokens_from_ids=True, block_ms=100) as first:
        await first.submit(request_id="race-1", prompt="x", sampling_params=SP)  # (no worker yet: queued)
    async with SubmitAfterItsRecord(settings, name="batch-3", tokens_from_ids=True, block_ms=100) as again:
        submitting = asyncio.create_task(again.submit(request_id="race-1", prompt="x", sampling_params=SP))
        async with running_worker(settings) as worker:
            record = await asyncio.wait_for(await asyncio.wait_for(submitting, 15), 5)
            assert record.status is RecordStatus.FINISHED
            assert await r.xlen(keys.requests) == 0  # (the submit queued nothing)
        assert worker.stats.claimed == 1
        await wait_until(lambda: _is_zero(r.xlen(keys.reply("batch-3"))), timeout=5)  # (acked after the submit)
        assert await r.hlen(keys.owner("batch-3")) == 0 and again.outstanding == 0


async def _is_zero(count) -> bool:
    return await count == 0


async def test_before_ack_runs_before_the_acks_and_a_failure_leaves_the_records_on_the_reply_stream(settings, r):
    """``before_ack`` runs after the callbacks of a delivered batch and before its acks; while it
    raises, the entries stay on the reply stream (the reader tries again), and the callbacks are
    not run a second time."""
    applied: list[str] = []
    hook: dict = {"fail": True, "calls": 0, "applied_then": []}

    def before_ack() -> None:
        hook["calls"] += 1
        hook["applied_then"] = sorted(applied)
        if hook["fail"]:
            raise OSError("disk full (simulated)")

    reply = settings.keys.reply("hooked")
    async with Producer(settings, name="hooked", block_ms=100, before_ack=before_ack) as p:
        futures = await p.submit_many([make_request(request_id=f"h-{i}", prompt="x", sampling_params=SP)
                                       for i in range(5)], callback=lambda rec: applied.append(rec.request_id))
        async with running_worker(settings):
            await asyncio.wait_for(asyncio.gather(*futures), 10)
            await wait_until(lambda: hook["calls"] >= 2, timeout=10)  # (tried again)
            assert await r.xlen(reply) == 5 and await reply_pending(r, "hooked", settings) == 5
            hook["fail"] = False
            await wait_until(lambda: _xlen_is(r, reply, 0), timeout=10)
        assert sorted(applied) == hook["applied_then"] == [f"h-{i}" for i in range(5)]  # (each applied once)


async def test_duplicate_request_id_refused(settings, r):
    async with Producer(settings, block_ms=100) as a, Producer(settings, block_ms=100) as b:
        fut = await a.submit(request_id="dup-1", prompt="x", sampling_params=SP)
        with pytest.raises(DuplicateRequestError) as ei:
            await b.submit(request_id="dup-1", prompt="y", sampling_params=SP)
        msg = str(ei.value)
        assert "dup-1" in msg and "already queued or in flight" in msg
        assert ei.value.request_id == "dup-1"
        # the same producer refuses a live id too
        with pytest.raises(DuplicateRequestError):
            await a.submit(request_id="dup-1", prompt="z", sampling_params=SP)
        # in a batch, only the duplicate fails; the others are queued
        futs = await b.submit_many([make_request(request_id="dup-1", prompt="q", sampling_params=SP),
                                    make_request(request_id="fresh-1", prompt="q", sampling_params=SP)])
        with pytest.raises(DuplicateRequestError):
            futs[0].result()
        assert b.outstanding == 1
        assert await r.xlen(settings.keys.requests) == 2
        # one call naming a request_id twice is refused whole, before anything is sent (its first
        # waiter was once replaced by the second's, and never resolved)
        with pytest.raises(ValueError, match="'twice-1' appears twice in one submit"):
            await b.submit_many([make_request(request_id="twice-1", prompt="q", sampling_params=SP),
                                 make_request(request_id="other-1", prompt="q", sampling_params=SP),
                                 make_request(request_id="twice-1", prompt="r", sampling_params=SP)])
        assert b.outstanding == 1 and await r.xlen(settings.keys.requests) == 2
        async with Producer(settings, block_ms=100, max_inflight=1) as c:  # (sent a chunk at a time)
            with pytest.raises(ValueError, match="appears twice"):
                await c.submit_many([{"request_id": "twice-2", "prompt": "q"}, {"prompt": "q"},
                                     {"request_id": "twice-2", "prompt": "r"}])
            assert c.outstanding == 0 and await r.xlen(settings.keys.requests) == 2
        # the refused submits left the first one intact
        assert a.outstanding == 1 and not fut.done()
        async with running_worker(settings):
            rec = await asyncio.wait_for(fut, 10)
            assert rec.request_id == "dup-1" and rec.status is RecordStatus.FINISHED
            assert (await asyncio.wait_for(futs[1], 10)).request_id == "fresh-1"
        # after the finish the id is free again
        assert not await r.exists(settings.keys.rid("dup-1"))
        fut2 = await b.submit(request_id="dup-1", prompt="again", sampling_params=SP)
        assert not fut2.done()


async def test_submit_script_retry_with_same_token_is_success(settings, r):
    keys = settings.keys
    scripts = Scripts(r)
    req = make_request(request_id="retry-1", prompt="x", sampling_params=SP)
    req.reply_to = keys.results
    data = encode_request(req, settings.limits)["data"]
    args = (keys.requests, keys.rid(req.request_id), "tok-A", req.request_id, req.reply_to, data, 60)
    first = await scripts.submit(*args)
    second = await scripts.submit(*args)
    assert first.retried is False and second.retried is True
    assert first.entry_id == second.entry_id
    assert await r.xlen(keys.requests) == 1
    # a different token is a refusal
    other = (keys.requests, keys.rid(req.request_id), "tok-B", req.request_id, req.reply_to, data, 60)
    with pytest.raises(DuplicateRequestError):
        await scripts.submit(*other)
    assert await r.xlen(keys.requests) == 1


async def test_submit_survives_connection_drop_after_server_applied(settings, r, monkeypatch):
    original = Pipeline.execute
    state = {"dropped": 0, "calls": 0}

    async def flaky_execute(self, *a, **kw):
        state["calls"] += 1
        carries_submit = any(str(args[0]).upper() == "FCALL" for args, _opts in self.command_stack)
        result = await original(self, *a, **kw)  # the server runs it ...
        if carries_submit and state["dropped"] == 0:
            state["dropped"] += 1  # ... but the reply is lost
            raise redis.ConnectionError("connection dropped before the reply arrived (simulated)")
        return result

    async with Producer(settings, block_ms=100) as p:
        monkeypatch.setattr(Pipeline, "execute", flaky_execute)
        fut = await p.submit(request_id="drop-1", prompt="x", sampling_params=SP)
        monkeypatch.setattr(Pipeline, "execute", original)
        assert state["dropped"] == 1 and state["calls"] >= 2
        assert await r.xlen(settings.keys.requests) == 1
        entries = await r.xrange(settings.keys.requests)
        assert entries[0][1][b"rid"] == b"drop-1"
        async with running_worker(settings):
            rec = await asyncio.wait_for(fut, 10)
        assert rec.request_id == "drop-1" and rec.status is RecordStatus.FINISHED


@pytest.mark.parametrize("after_the_lost_reply", ["an error", "a silent retry"])
async def test_records_read_without_their_reply_are_read_again(settings, r, monkeypatch, after_the_lost_reply):
    # The server ran the reply read (the entries are now pending here) but its reply was lost, as
    # when a primary fails over. Either the reader sees the connection error and pages its own
    # pending entries again, or the client retries the read by itself (redis-py does on a dropped
    # connection, its cluster client after a failover): the retried read finds nothing new, no
    # error reaches the reader, and its check of its own pending count finds them.
    from redroll.producer import replies

    original = replies.read_group  # (the reads of new records; paging its pending ones is xreadgroup)
    state = {"lost": 0}

    async def lossy_read(r, group, consumer, streams, **kw):
        result = await original(r, group, consumer, streams, **kw)
        if group == PRODUCER_GROUP and result and state["lost"] == 0:
            state["lost"] += 1
            if after_the_lost_reply == "an error":
                raise redis.ConnectionError("connection closed by server (simulated, after the read ran)")
            return await original(r, group, consumer, streams, **kw)  # the silent retry
        return result

    monkeypatch.setattr(replies, "read_group", lossy_read)  # (before the start: its reader reads at once)
    async with Producer(settings, name="lossy", block_ms=100) as p:
        futures = await p.submit_many([make_request(request_id=f"lost-{i}", prompt="x", sampling_params=SP)
                                       for i in range(5)])
        async with running_worker(settings):
            records = await asyncio.wait_for(asyncio.gather(*futures), 15)
        assert state["lost"] == 1
        assert sorted(x.request_id for x in records) == [f"lost-{i}" for i in range(5)]
        await wait_until(lambda: _pending_is(r, "lossy", settings, 0), timeout=5)


async def test_reply_reads_of_large_records_ask_for_fewer_entries(settings, r, monkeypatch):
    # Records of about 40 kB: after the first of them, a reply read asks for about 1 MiB of them,
    # not read_count (256), so that Redis never builds one reply of many megabytes.
    from redroll.shared.streams import READ_BYTES

    counts = _count_reply_reads(monkeypatch)
    async with Producer(settings, name="large", block_ms=100) as p:
        sp = {"max_new_tokens": 3000}
        futures = await p.submit_many([make_request(request_id=f"large-{i}", prompt="x", sampling_params=sp,
                                                    return_logprob=True) for i in range(3)])
        async with running_worker(settings):
            records = await asyncio.wait_for(asyncio.gather(*futures), 30)
        size = len(encode_record(records[0])["data"])
        await wait_until(lambda: counts[-1] < 256, timeout=5)
    assert size > 20_000 and counts[0] == 256
    assert abs(counts[-1] - READ_BYTES // size) <= 2


def _count_reply_reads(monkeypatch) -> list[int]:
    """The COUNT each producer reply read asks for, in order: pages of its own pending records
    (``xreadgroup``) and reads of new ones (``read_group``)."""
    from redis.asyncio import Redis

    from redroll.producer import replies

    original_paging, original_reading = Redis.xreadgroup, replies.read_group
    counts: list[int] = []

    async def counting_paging(self, groupname, consumername, streams, *a, **kw):
        if groupname in (PRODUCER_GROUP, PRODUCER_GROUP.encode()):
            counts.append(kw["count"])
        return await original_paging(self, groupname, consumername, streams, *a, **kw)

    async def counting_reading(r, group, consumer, streams, **kw):
        if group == PRODUCER_GROUP:
            counts.append(kw["count"])
        return await original_reading(r, group, consumer, streams, **kw)

    monkeypatch.setattr(Redis, "xreadgroup", counting_paging)
    monkeypatch.setattr(replies, "read_group", counting_reading)
    return counts


async def test_the_reads_before_start_returns_ask_for_fewer_large_records_too(settings, r, monkeypatch):
    # Records of about 300 kB wait on the reply stream of a producer that stopped, read by it (held
    # for unclaimed(), so pending under its name) and not handed out: the restarted one pages them
    # before its start returns, and its read of new records then asks for about 1 MiB of them.
    from redroll.shared.streams import READ_BYTES

    async with Producer(settings, name="large-again", block_ms=100) as first:
        await first.submit_many([make_request(request_id=f"big-{i}", prompt="x", return_logprob=True,
                                              sampling_params={"max_new_tokens": 24_000}) for i in range(4)])
    async with running_worker(settings):
        await wait_until(lambda: _xlen_is(r, settings.keys.reply("large-again"), 4), timeout=30)
    async with Producer(settings, name="large-again", block_ms=100) as second:
        assert len(second.pending.held) == 4
    counts = _count_reply_reads(monkeypatch)
    async with Producer(settings, name="large-again", block_ms=100) as again:
        first_reads = counts[:]
        size = len(encode_record(again.pending.held["big-0"][1])["data"])
        assert len(again.pending.held) == 4  # (all read before start returned)
    assert size > 200_000 and first_reads[:2] == [256, READ_BYTES // size]  # (paging, then new ones)


async def test_the_next_reply_read_is_asked_for_before_a_batch_is_delivered(settings, r, monkeypatch):
    from redroll.producer import replies

    original = replies.read_group
    events: list[str] = []

    def asked(r, group, consumer, streams, **kw):  # (called when the read is asked for)
        if group == PRODUCER_GROUP:
            events.append("read")
        return original(r, group, consumer, streams, **kw)

    monkeypatch.setattr(replies, "read_group", asked)
    async with Producer(settings, name="ahead", block_ms=100) as p:
        deliver = p.reader._deliver

        async def delivering(batch):
            if batch:
                events.append(f"deliver {len(batch)}")
            await deliver(batch)

        p.reader._deliver = delivering  # type: ignore[method-assign]
        futures = await p.submit_many([make_request(request_id=f"ahead-{i}", prompt="x", sampling_params=SP)
                                       for i in range(5)])
        async with running_worker(settings):
            records = await asyncio.wait_for(asyncio.gather(*futures), 15)
        assert sorted(x.request_id for x in records) == [f"ahead-{i}" for i in range(5)]
        await wait_until(lambda: _pending_is(r, "ahead", settings, 0), timeout=5)
    first = next(i for i, e in enumerate(events) if e.startswith("deliver"))
    assert events[first - 2:first] == ["read", "read"]  # the read that brought it, then the next one


async def test_a_held_record_handed_out_and_read_again_is_not_a_later_record(settings, r):
    # unclaimed() hands a held record out; the same entry read again (its ack lost) is skipped,
    # and result() knows the record was delivered instead of waiting for it or handing it out twice.
    async with Producer(settings, name="restarted", block_ms=100) as a:
        await a.submit(make_request(request_id="held-1", prompt="x", sampling_params=SP))
    async with running_worker(settings):
        await wait_until(lambda: _xlen_is(r, settings.keys.reply("restarted"), 1), timeout=10)
    async with Producer(settings, name="restarted", block_ms=100) as b:
        rec = await asyncio.wait_for(anext(aiter(b.unclaimed())), 10)
        assert rec.request_id == "held-1"
        entry_id = b.pending.recent["held-1"][0]
        assert entry_id is not None
        assert await b.pending.resolve(rec, entry_id)  # the same entry delivered again: skipped, acked
        assert b.pending.recent["held-1"][1] is None and not b.pending.held
        with pytest.raises(LookupError):
            await b.result("held-1")


# ---------------------------------------------------------------- isolation and restart


async def test_concurrent_producers_get_only_their_own_records(settings):
    async with running_worker(settings), \
            Producer(settings, block_ms=100) as a, Producer(settings, block_ms=100) as b:
        assert a.reply_to != b.reply_to
        ra = [make_request(request_id=f"a-{i}", prompt=f"a{i}", sampling_params=SP) for i in range(30)]
        rb = [make_request(request_id=f"b-{i}", prompt=f"b{i}", sampling_params=SP) for i in range(30)]
        fa, fb = await asyncio.gather(a.submit_many(ra), b.submit_many(rb))
        recs_a = await asyncio.wait_for(asyncio.gather(*fa), 15)
        recs_b = await asyncio.wait_for(asyncio.gather(*fb), 15)
        assert [x.request_id for x in recs_a] == [q.request_id for q in ra]
        assert [x.request_id for x in recs_b] == [q.request_id for q in rb]
        # nothing foreign turned up in either producer
        assert not a.pending.held and not b.pending.held


async def test_restart_resumes_records_by_name(settings, r):
    rids = [f"resume-{i}" for i in range(10)]
    async with Producer(settings, name="trainer-1", block_ms=100) as a:
        await a.submit_many([make_request(request_id=x, prompt=x, sampling_params=SP) for x in rids])
        assert a.reply_to == settings.keys.reply("trainer-1")
    reply = settings.keys.reply("trainer-1")
    async with running_worker(settings):
        await wait_until(lambda: _xlen_is(r, reply, 10), timeout=10)

    async with Producer(settings, name="trainer-1", block_ms=100) as b:
        got = {}
        for x in rids[:5]:
            rec = await b.result(x, timeout=5)
            got[x] = rec
        async def drain_unclaimed():
            async for rec in b.unclaimed():
                got[rec.request_id] = rec
                if len(got) == 10:
                    return
        await asyncio.wait_for(drain_unclaimed(), 5)
        assert sorted(got) == sorted(rids)
        assert all(rec.status is RecordStatus.FINISHED for rec in got.values())
        assert await reply_pending(r, "trainer-1", settings) == 0
        assert await r.xlen(reply) == 0


async def test_restart_resumes_pending_entries_read_before_crash(settings, r):
    """Records the old producer read but never handled stay pending and are re-read on restart."""
    rids = [f"pend-{i}" for i in range(4)]
    name = "trainer-2"
    async with Producer(settings, name=name, block_ms=100) as a:
        await a.submit_many([make_request(request_id=x, prompt=x, sampling_params=SP) for x in rids])
    reply = settings.keys.reply(name)
    async with running_worker(settings):
        await wait_until(lambda: _xlen_is(r, reply, 4), timeout=10)
    # a crashed instance read them but did not ack
    await r.xreadgroup(PRODUCER_GROUP, name, {reply: ">"}, count=10)
    assert await reply_pending(r, name, settings) == 4
    async with Producer(settings, name=name, block_ms=100) as b:
        recs = [await b.result(x, timeout=5) for x in rids]
        assert [x.request_id for x in recs] == rids
        await wait_until(lambda: _pending_is(r, name, settings, 0), timeout=5)


async def _pending_is(r, name, settings, n):
    return await reply_pending(r, name, settings) == n


# ---------------------------------------------------------------- abort, sync facade, poison


async def test_abort_queued_request(settings):
    async with Producer(settings, block_ms=100) as p:
        fut = await p.submit(request_id="abort-me", prompt="x", sampling_params=SP)
        keep = await p.submit(request_id="keep-me", prompt="x", sampling_params=SP)
        await p.abort(["abort-me"])
        async with running_worker(settings):
            rec = await asyncio.wait_for(fut, 10)
            kept = await asyncio.wait_for(keep, 10)
        assert rec.status is RecordStatus.ABORTED
        assert rec.finish_reasons == [None]
        assert rec.output_logprobs is None
        assert kept.status is RecordStatus.FINISHED


async def test_abort_by_group_id(settings):
    async with Producer(settings, block_ms=100) as p:
        futs = await p.submit_many([make_request(prompt=f"g{i}", sampling_params=SP, group_id="grp-7")
                                    for i in range(3)])
        await p.abort(group_id="grp-7")
        async with running_worker(settings):
            recs = await asyncio.wait_for(asyncio.gather(*futs), 10)
        assert all(x.status is RecordStatus.ABORTED and x.finish_reasons == [None] for x in recs)


async def test_undecodable_reply_is_dead_lettered(settings, r):
    async with Producer(settings, block_ms=100) as p:
        await r.xadd(p.reply_to, {"rid": "junk", "status": "finished", "worker": "w", "data": b"\xc1\xff"})
        await r.xadd(p.reply_to, {"rid": "junk2", "status": "bogus", "data": b"\x80"})
        # a map nested 2,000 lists deep, and a map32 header counting 2**32 - 1 pairs
        await r.xadd(p.reply_to, {"rid": "junk3", "status": "finished", "worker": "w",
                                  "data": b"\x81\xa9meta_info\x81\xa1k" + b"\x91" * 2_000 + b"\xc0"})
        await r.xadd(p.reply_to, {"rid": "junk4", "status": "finished", "worker": "w", "data": b"\xdf\xff\xff\xff\xff"})
        await wait_until(lambda: _xlen_is(r, settings.keys.dead, 4), timeout=5)
        dead = await r.xrange(settings.keys.dead)
        assert all(f[b"source"] == b"producer" for _i, f in dead)
        assert b"data" in dead[0][1][b"reason"]
        assert b"status" in dead[1][1][b"reason"]
        assert dead[2][1][b"reason"] == b"invalid data: maps or lists nested too deeply"
        assert b"msgpack" in dead[3][1][b"reason"]
        async with running_worker(settings):
            rec = await asyncio.wait_for(await p.submit(prompt="after", sampling_params=SP), 10)
        assert rec.status is RecordStatus.FINISHED
        await wait_until(lambda: _pending_is(r, p.name, settings, 0), timeout=5)
        assert await r.xlen(p.reply_to) == 0


async def test_duplicate_record_on_reply_stream_is_skipped(settings, r):
    from redroll.shared.codec import encode_record

    calls: list[str] = []
    async with running_worker(settings), Producer(settings, block_ms=100) as p:
        rec = await asyncio.wait_for(await p.submit(request_id="once-1", prompt="x", sampling_params=SP,
                                                    callback=None), 10)
        fut = await p.submit(request_id="once-2", prompt="x", sampling_params=SP,
                             callback=lambda x: calls.append(x.request_id))
        rec2 = await asyncio.wait_for(fut, 10)
        # a replayed copy of an already handled record (e.g. after a redis crash) is acked, not re-applied
        await r.xadd(p.reply_to, encode_record(rec2))
        await r.xadd(p.reply_to, encode_record(rec))
        await wait_until(lambda: _xlen_is(r, p.reply_to, 0), timeout=5)
        assert calls == ["once-2"]
        assert not p.pending.held
        assert await reply_pending(r, p.name, settings) == 0
