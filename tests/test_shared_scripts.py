"""The Lua scripts of the delivery promise, against a real redis-server."""

from __future__ import annotations

import asyncio
import dataclasses

import msgpack
import pytest
import redis

from redroll.ops.gc import collect_garbage
from redroll.producer.client import make_request, send
from redroll.shared import scripts as scripts_module
from redroll.shared.codec import decode_record
from redroll.shared.functions import FunctionsMissingError
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.refusals import StreamRefusedError
from redroll.shared.scripts import (
    FINISH_MARKER_TTL_MS,
    DeadLetter,
    DeadLetterOutcome,
    DuplicateRequestError,
    OwnershipError,
    Scripts,
    raising_first_error,
)
from redroll.shared.streams import ensure_group
from redroll.shared.types import CompletionRecord, RecordStatus

G = WORKERS_GROUP


def data_for(rid: str) -> bytes:
    return msgpack.packb({"v": 1, "request_id": rid, "prompt": "hi", "submitted_at": 1.0}, use_bin_type=True)


def record(rid: str, status: RecordStatus = RecordStatus.FINISHED, worker: str = "w1") -> CompletionRecord:
    return CompletionRecord(request_id=rid, status=status, output_token_ids=[[1, 2]], finish_reasons=["length"],
                            output_logprobs=[[-0.1, -0.2]], meta_info={"m": 1}, worker=worker)


async def submit(scripts: Scripts, keys, rid: str, token: str, ttl: int = 60):
    return await scripts.submit(keys.requests, keys.rid(rid), token, rid, keys.results, data_for(rid), ttl)


async def read_one(r, keys, consumer: str) -> str:
    resp = await r.xreadgroup(G, consumer, {keys.requests: ">"}, count=1)
    assert resp, "nothing to read"
    return resp[0][1][0][0].decode()


async def pending(r, keys, entry_id: str) -> dict | None:
    rows = await r.xpending_range(keys.requests, G, min=entry_id, max=entry_id, count=1)
    return rows[0] if rows else None


async def add_and_claim(r, keys, consumer: str, rid: str = "req-1") -> str:
    await ensure_group(r, keys.requests, G)
    await r.xadd(keys.requests, {"rid": rid, "reply_to": keys.results, "data": data_for(rid)})
    return await read_one(r, keys, consumer)


def finish_kwargs(keys, consumer: str, entry_id: str, rid: str = "req-1", **kw):
    return dict(requests_key=keys.requests, reply_key=keys.results, rid_key=keys.rid(rid), group=G,
                consumer=consumer, entry_id=entry_id, record=record(rid, worker=consumer), **kw)


# ---------------------------------------------------------------- submit


async def test_submit_dedup_retry_and_refusal(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    first = await submit(scripts, keys, "rid-a", "tok-1")
    assert first.retried is False
    assert await r.xlen(keys.requests) == 1
    entries = await r.xrange(keys.requests)
    assert entries[0][0].decode() == first.entry_id
    f = entries[0][1]
    assert f[b"rid"] == b"rid-a" and f[b"reply_to"] == keys.results.encode() and f[b"data"] == data_for("rid-a")
    held = (await r.get(keys.rid("rid-a"))).decode()
    assert held == f"tok-1 requests {first.entry_id}"  # (token, stream, entry id)
    assert await r.ttl(keys.rid("rid-a")) == -1  # no expiry: the finish, a dead letter or gc deletes it

    again = await submit(scripts, keys, "rid-a", "tok-1")  # a retried submit (same token)
    assert again.entry_id == first.entry_id and again.retried is True
    assert await r.xlen(keys.requests) == 1

    with pytest.raises(DuplicateRequestError) as ei:
        await submit(scripts, keys, "rid-a", "tok-2")
    assert ei.value.request_id == "rid-a"
    assert await r.xlen(keys.requests) == 1

    other = await submit(scripts, keys, "rid-b", "tok-2")  # other ids are independent
    assert other.retried is False and other.entry_id != first.entry_id
    assert await r.xlen(keys.requests) == 2


async def test_submit_without_reply_to_and_in_pipeline(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    await scripts.load_all()  # (a pipeline cannot load the library: its caller does, see below)
    async with r.pipeline(transaction=False) as pipe:
        for rid, reply_to in (("p1", None), ("p2", keys.results), ("p1", None)):
            scripts.submit_many_in(pipe, requests_key=keys.requests, rid_ttl_s=60,
                                   items=[(keys.rid(rid), "t", rid, reply_to, data_for(rid))])
        replies = await pipe.execute()
    outs = [Scripts.submit_outcome(rid, rep) for rid, (rep,) in zip(["p1", "p2", "p1"], replies)]
    assert [o.retried for o in outs] == [False, False, True]
    assert outs[0].entry_id == outs[2].entry_id
    entries = await r.xrange(keys.requests)
    assert len(entries) == 2
    assert b"reply_to" not in entries[0][1]


async def test_submit_entry_fields_in_every_shape(r, settings):
    # with and without a reply stream, with and without an affinity key: each shape has its own XADD
    keys, scripts = settings.keys, Scripts(r)
    shapes = {"none": (None, None), "reply": (keys.results, None), "ak": (None, "s1"), "both": (keys.results, "s2")}
    items = [(keys.rid(rid), "t", rid, reply_to, data_for(rid), ak) for rid, (reply_to, ak) in shapes.items()]
    out = await scripts.submit_many_in(r, requests_key=keys.requests, rid_ttl_s=60, items=items)
    assert [code for code, _ in out] == [1, 1, 1, 1]
    fields = {e[1][b"rid"].decode(): list(e[1].items()) for e in await r.xrange(keys.requests)}
    reply = keys.results.encode()
    assert fields == {
        "none": [(b"rid", b"none"), (b"data", data_for("none"))],
        "reply": [(b"rid", b"reply"), (b"reply_to", reply), (b"data", data_for("reply"))],
        "ak": [(b"rid", b"ak"), (b"ak", b"s1"), (b"data", data_for("ak"))],
        "both": [(b"rid", b"both"), (b"reply_to", reply), (b"ak", b"s2"), (b"data", data_for("both"))],
    }


async def test_finish_releases_rid_so_it_can_be_reused(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    await ensure_group(r, keys.requests, G)
    first = await submit(scripts, keys, "reuse-me", "tok-1")
    entry = await read_one(r, keys, "c1")
    assert entry == first.entry_id
    assert await scripts.finish(**finish_kwargs(keys, "c1", entry, rid="reuse-me")) == 1
    assert await r.exists(keys.rid("reuse-me")) == 0
    # a new submit of the same id (another caller) is accepted now
    second = await submit(scripts, keys, "reuse-me", "tok-2")
    assert second.retried is False and second.entry_id != first.entry_id
    assert (await r.get(keys.rid("reuse-me"))).decode() == f"tok-2 requests {second.entry_id}"


async def test_finish_refuses_an_entry_whose_rid_key_names_another_entry(r, settings):
    # Another entry holds the request_id (a later submit; or a producer's XADD of another's live
    # request_id): publishing this one would let consumer groups apply it and skip the holder's.
    keys, scripts = settings.keys, Scripts(r)
    entry = await add_and_claim(r, keys, "c1", rid="x1")
    await r.set(keys.rid("x1"), "other-token 1-1")
    with pytest.raises(OwnershipError, match="request_id is held by another entry"):
        await scripts.finish(**finish_kwargs(keys, "c1", entry, rid="x1"))
    assert (await r.get(keys.rid("x1"))) == b"other-token 1-1"
    assert await r.xlen(keys.results) == 0 and (await r.xpending(keys.requests, G))["pending"] == 1


# ---------------------------------------------------------------- fenced finish


async def test_release_rids_deletes_only_keys_whose_entry_is_in_no_request_stream(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    queued = await submit(scripts, keys, "queued", "t")
    high = await scripts.submit(keys.requests_high, keys.rid("high"), "t", "high", None, data_for("high"), 60)
    gone = await submit(scripts, keys, "gone", "t")
    await r.xdel(keys.requests, gone.entry_id)  # (as a producer's cancel of a queued request leaves it)
    await r.set(keys.rid("junk"), "no entry")
    await r.set(keys.rid("ahead"), "t 99999999999999-0")  # (an id past every entry)
    # Ids are per stream: the rid key's stream is the one looked in, whatever the others hold.
    twin = keys.lane(0)
    await r.xadd(twin, {"rid": "twin"}, id=gone.entry_id)
    await r.hset(keys.rid("hash"), "x", "1")
    names = ["queued", "high", "gone", "junk", "ahead", "hash", "missing"]
    streams = [*keys.request_streams, twin]
    expected = [keys.rid(x) for x in ("gone", "junk", "ahead")]
    assert await scripts.release_rids(streams, [keys.rid(x) for x in names], dry_run=True) == expected
    assert await r.exists(*expected) == 3
    assert await scripts.release_rids(streams, [keys.rid(x) for x in names]) == expected
    assert await r.exists(*expected) == 0
    assert await r.exists(keys.rid("queued"), keys.rid("high"), keys.rid("hash")) == 3
    assert (await r.get(keys.rid("queued"))).decode().endswith(queued.entry_id)
    assert (await r.get(keys.rid("high"))).decode().endswith(high.entry_id)
    assert await scripts.release_rids(streams, []) == []
    report = await collect_garbage(r, keys, reply_ttl_s=3600)
    assert report.rid_keys == [] and report.to_json()["rid_keys"] == []


async def test_finish_by_owner_publishes_once_acks_and_deletes(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    entry = await add_and_claim(r, keys, "c1")
    res = await scripts.finish(**finish_kwargs(keys, "c1", entry))
    assert res == 1
    results = await r.xrange(keys.results)
    assert len(results) == 1
    fields = results[0][1]
    assert fields[b"rid"] == b"req-1" and fields[b"status"] == b"finished" and fields[b"worker"] == b"c1"
    assert decode_record(fields) == record("req-1", worker="c1")
    assert await r.xlen(keys.requests) == 0
    assert (await r.xpending(keys.requests, G))["pending"] == 0
    # a second finish of the same entry (a retried call whose reply was lost) publishes nothing
    # again, and says the record was published (2), not fenced
    assert await scripts.finish(**finish_kwargs(keys, "c1", entry)) == 2
    assert await r.xlen(keys.results) == 1


async def test_finish_in_pipeline(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    await ensure_group(r, keys.requests, G)
    for i in range(3):
        await r.xadd(keys.requests, {"rid": f"r{i}", "data": data_for(f"r{i}")})
    resp = await r.xreadgroup(G, "c1", {keys.requests: ">"}, count=3)
    ids = [e[0].decode() for e in resp[0][1]]
    await scripts.load_all()
    async with r.pipeline(transaction=False) as pipe:
        for i, entry in enumerate(ids):
            consumer = "c1" if i != 1 else "intruder"
            scripts.finish_many_in(pipe, requests_key=keys.requests, group=G, consumer=consumer, worker=consumer,
                                   items=[(entry, keys.results, keys.rid(f"r{i}"),
                                                         record(f"r{i}", worker=consumer), 0)])
        res = await pipe.execute()
    assert res == [[1], [0], [1]]
    assert [f[b"rid"] for _, f in await r.xrange(keys.results)] == [b"r0", b"r2"]
    assert [e[0].decode() for e in await r.xrange(keys.requests)] == [ids[1]]


async def test_large_requests_and_records_arrive_whole(r, settings):
    # Large data goes out as its own buffer (redis-py's packer, not hiredis): the same bytes arrive.
    keys, scripts = settings.keys, Scripts(r)
    await ensure_group(r, keys.requests, G)
    big_request = msgpack.packb({"v": 1, "request_id": "big", "input_ids": list(range(40_000)), "submitted_at": 1.0},
                                use_bin_type=True)
    assert len(big_request) > 64 * 1024
    submitted = await scripts.submit(keys.requests, keys.rid("big"), "t1", "big", keys.results, big_request, 60)
    resp = await r.xreadgroup(G, "c1", {keys.requests: ">"}, count=1)
    entry, fields = resp[0][1][0]
    assert entry.decode() == submitted.entry_id and fields[b"data"] == big_request
    rec = CompletionRecord(request_id="big", status=RecordStatus.FINISHED, output_token_ids=[list(range(30_000))] * 2,
                           finish_reasons=["length"] * 2, output_logprobs=[[-0.5] * 30_000] * 2, meta_info={},
                           worker="c1")
    async with r.pipeline(transaction=False) as pipe:
        scripts.finish_many_in(pipe, requests_key=keys.requests, group=G, consumer="c1", worker="c1",
                               items=[(entry.decode(), keys.results, keys.rid("big"), rec, 0)])
        assert await pipe.execute() == [[1]]
    (_, published), = await r.xrange(keys.results)
    assert decode_record(published) == rec


async def test_finish_refused_for_non_owner(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    entry = await add_and_claim(r, keys, "c1")
    assert await scripts.finish(**finish_kwargs(keys, "c2", entry)) == 0
    assert await r.xlen(keys.results) == 0
    assert await r.xlen(keys.requests) == 1
    p = await pending(r, keys, entry)
    assert p is not None and p["consumer"] == b"c1"


async def test_finish_of_a_batch_publishes_only_the_entries_this_consumer_owns(r, settings):
    # One XPENDING over the batch's id range decides: entries of another consumer in between, an
    # entry listed twice and ids that order differently as text (…-9 < …-10) are all handled.
    keys, scripts = settings.keys, Scripts(r)
    await ensure_group(r, keys.requests, G)
    seconds, _ = await r.time()
    ms = seconds * 1000
    owners = {}
    for seq, consumer in [(9, "c1"), (10, "c2"), (11, "c1"), (100, "c1")]:
        rid = f"r-{seq}"
        entry = f"{ms}-{seq}"
        await r.xadd(keys.requests, {"rid": rid, "reply_to": keys.results, "data": data_for(rid)}, id=entry)
        await r.xreadgroup(G, consumer, {keys.requests: ">"}, count=1)
        owners[entry] = (consumer, rid)
    order = [f"{ms}-100", f"{ms}-10", f"{ms}-9", f"{ms}-11", f"{ms}-9"]
    async with r.pipeline(transaction=False) as pipe:
        scripts.finish_many_in(pipe, requests_key=keys.requests, group=G, consumer="c1", worker="c1", items=[
            (e, keys.results, keys.rid(owners[e][1]), record(owners[e][1], worker="c1"), 0) for e in order])
        (reply,) = await pipe.execute()
    assert [int(x) for x in reply] == [1, 0, 1, 1, 0]
    assert sorted(f[b"rid"].decode() for _, f in await r.xrange(keys.results)) == ["r-100", "r-11", "r-9"]
    assert [e.decode() for e, _ in await r.xrange(keys.requests)] == [f"{ms}-10"]  # c2's, untouched


async def test_a_retried_finish_is_told_from_a_lost_lease(r, settings):
    # The marker {ns}:finished:<consumer> says who finished what, for FINISH_MARKER_TTL_MS.
    keys, scripts = settings.keys, Scripts(r)
    mine = await add_and_claim(r, keys, "c1", rid="mine")
    taken = await add_and_claim(r, keys, "c1", rid="taken")
    await r.xclaim(keys.requests, G, "c2", 0, [taken])  # c1's lease on it is lost
    items = [(mine, keys.results, keys.rid("mine"), record("mine", worker="c1"), 0),
             (taken, keys.results, keys.rid("taken"), record("taken", worker="c1"), 0)]
    for expected in ([1, 0], [2, 0]):  # the first call, then its retry (same arguments)
        async with r.pipeline(transaction=False) as pipe:
            scripts.finish_many_in(pipe, requests_key=keys.requests, group=G, consumer="c1", worker="c1",
                                   items=items)
            (reply,) = await pipe.execute()
        assert [int(x) for x in reply] == expected
    assert [f[b"rid"] for _, f in await r.xrange(keys.results)] == [b"mine"]
    marker = keys.finished("c1")
    assert marker == f"{keys.tag}:finished:c1"
    assert await r.lrange(marker, 0, -1) == [f"{mine} requests".encode()]
    assert 0 < await r.pttl(marker) <= FINISH_MARKER_TTL_MS
    # The new owner finishes its entry; c1 still cannot, and another consumer's marker is not c1's.
    assert await scripts.finish(**finish_kwargs(keys, "c2", taken, rid="taken")) == 1
    assert await scripts.finish(**finish_kwargs(keys, "c1", taken, rid="taken")) == 0
    assert await scripts.finish(**finish_kwargs(keys, "c2", mine, rid="mine")) == 0


async def test_the_finish_marker_is_per_stream_and_capped(r, settings, monkeypatch):
    keys, scripts = settings.keys, Scripts(r)
    await ensure_group(r, keys.requests_high, G)
    await r.xadd(keys.requests_high, {"rid": "h", "data": data_for("h")}, id="5-1")
    await r.xreadgroup(G, "c1", {keys.requests_high: ">"}, count=1)
    high = dict(finish_kwargs(keys, "c1", "5-1", rid="h"), requests_key=keys.requests_high)
    assert await scripts.finish(**high) == 1
    # The same id in the normal stream is another entry: not published by c1.
    await ensure_group(r, keys.requests, G)
    assert await scripts.finish(**finish_kwargs(keys, "c1", "5-1", rid="h")) == 0
    assert await scripts.finish(**high) == 2
    # It keeps the latest FINISH_MARKER_CAP entries.
    monkeypatch.setattr(scripts_module, "FINISH_MARKER_CAP", 2)
    done = [await add_and_claim(r, keys, "c1", rid=f"c{i}") for i in range(3)]
    for i, entry in enumerate(done):
        assert await scripts.finish(**finish_kwargs(keys, "c1", entry, rid=f"c{i}")) == 1
    assert await r.lrange(keys.finished("c1"), 0, -1) == [f"{e} requests".encode() for e in done[1:]]
    # A marker of another type is left alone: the finish publishes, only the marker is missing.
    await r.delete(keys.finished("c1"))
    await r.set(keys.finished("c1"), "x")
    entry = await add_and_claim(r, keys, "c1", rid="plain")
    assert await scripts.finish(**finish_kwargs(keys, "c1", entry, rid="plain")) == 1
    assert await scripts.finish(**finish_kwargs(keys, "c1", entry, rid="plain")) == 0
    assert await r.get(keys.finished("c1")) == b"x"


async def test_finish_refused_for_unknown_entry(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    await ensure_group(r, keys.requests, G)
    assert await scripts.finish(**finish_kwargs(keys, "c1", "1-1")) == 0
    assert await r.exists(keys.results) == 0


async def test_finish_refused_after_another_consumer_claimed(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    entry = await add_and_claim(r, keys, "c1")
    claimed = await r.xclaim(keys.requests, G, "c2", 0, [entry])
    assert claimed and claimed[0][0].decode() == entry
    # the stale owner (lease lost) cannot publish
    assert await scripts.finish(**finish_kwargs(keys, "c1", entry)) == 0
    assert await r.xlen(keys.results) == 0
    assert await r.xlen(keys.requests) == 1
    # the new owner can, exactly once
    assert await scripts.finish(**finish_kwargs(keys, "c2", entry)) == 1
    assert await scripts.finish(**finish_kwargs(keys, "c1", entry)) == 0
    assert await r.xlen(keys.results) == 1
    assert await r.xlen(keys.requests) == 0


async def test_finish_reply_cap(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    await ensure_group(r, keys.requests, G)
    for i in range(300):
        await r.xadd(keys.results, {"rid": f"old{i}"})
    entry = await add_and_claim(r, keys, "c1")
    assert await scripts.finish(**finish_kwargs(keys, "c1", entry, reply_cap=10)) == 1
    n = await r.xlen(keys.results)
    assert n < 301  # approximate trim (~) happened
    last = await r.xrevrange(keys.results, count=1)
    assert last[0][1][b"rid"] == b"req-1"


# ---------------------------------------------------------------- renew / hand back


async def test_renew_by_owner_resets_idle_keeps_delivery_count(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    entry = await add_and_claim(r, keys, "c1")
    await asyncio.sleep(0.25)
    before = await pending(r, keys, entry)
    assert before["time_since_delivered"] >= 200
    lost = await scripts.renew(keys.requests, G, "c1", [entry])
    assert lost == []
    after = await pending(r, keys, entry)
    assert after["consumer"] == b"c1"
    assert after["time_since_delivered"] < 150
    assert after["times_delivered"] == before["times_delivered"] == 1


async def test_renew_by_non_owner_reports_lost_and_takes_nothing(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    entry = await add_and_claim(r, keys, "c1")
    await asyncio.sleep(0.2)
    lost = await scripts.renew(keys.requests, G, "c2", [entry, "1-1"])
    assert sorted(lost) == sorted([entry, "1-1"])
    p = await pending(r, keys, entry)
    assert p["consumer"] == b"c1"
    assert p["times_delivered"] == 1
    assert p["time_since_delivered"] >= 150  # the non-owner did not renew it either
    assert await scripts.renew(keys.requests, G, "c2", []) == []


async def test_renew_mixed_owned_and_lost(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    e1 = await add_and_claim(r, keys, "c1", rid="a")
    await r.xadd(keys.requests, {"rid": "b", "data": data_for("b")})
    e2 = await read_one(r, keys, "c2")
    assert await scripts.renew(keys.requests, G, "c1", [e1, e2]) == [e2]
    assert (await pending(r, keys, e2))["consumer"] == b"c2"


async def test_hand_back_lets_another_consumer_autoclaim_at_once(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    claim_idle = settings.claim_idle_ms
    entry = await add_and_claim(r, keys, "c1")
    # not idle yet: nobody can take it
    _, taken, *_ = await r.xautoclaim(keys.requests, G, "c2", claim_idle, start_id="0-0")
    assert taken == []
    lost = await scripts.renew(keys.requests, G, "c1", [entry], idle_ms=claim_idle)
    assert lost == []
    p = await pending(r, keys, entry)
    assert p["consumer"] == b"c1" and p["times_delivered"] == 1  # JUSTID: a hand-back is not a delivery
    assert p["time_since_delivered"] >= claim_idle
    _, taken, *_ = await r.xautoclaim(keys.requests, G, "c2", claim_idle, start_id="0-0")
    assert [t[0].decode() for t in taken] == [entry]
    p = await pending(r, keys, entry)
    assert p["consumer"] == b"c2"
    assert p["times_delivered"] == 2
    # and the former owner can neither renew nor finish it any more
    assert await scripts.renew(keys.requests, G, "c1", [entry]) == [entry]
    assert await scripts.finish(**finish_kwargs(keys, "c1", entry)) == 0


# ---------------------------------------------------------------- dead letter


def letter_for(keys, entry: str, fields: dict, *, reply: bool = True, delete: bool = True,
               rid: str = "req-1") -> DeadLetter:
    err = CompletionRecord.failed(None, request_id=rid, status=RecordStatus.ERROR, error="invalid x: bad",
                                  worker="c1") if reply else None
    return DeadLetter(stream=keys.requests, entry_id=entry, reason="invalid x: bad", source="worker",
                      fields=fields, deliveries=2, delete_entry=delete,
                      reply_to=keys.results if reply else None, error_record=err, rid_key=keys.rid(rid))


async def test_dead_letter_writes_dead_entry_error_record_acks_and_deletes(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    await ensure_group(r, keys.requests, G)
    sub = await submit(scripts, keys, "req-1", "tok")
    entry = await read_one(r, keys, "c1")
    assert entry == sub.entry_id
    original = dict((await r.xrange(keys.requests))[0][1])
    # a hostile original field named like a reserved one must not overwrite them
    fields = {**original, b"reason": b"forged", b"source": b"forged"}
    res = await scripts.dead_letter(dead_key=keys.dead, group=G, consumer="c1",
                                    letter=letter_for(keys, entry, fields))
    assert res.done and res.refused is None and res.reply_error is None
    dead = await r.xrange(keys.dead)
    assert len(dead) == 1
    d = dead[0][1]
    assert d[b"reason"] == b"invalid x: bad"
    assert d[b"source"] == b"worker"
    assert d[b"entry"] == entry.encode()
    assert d[b"deliveries"] == b"2"
    for k in (b"rid", b"reply_to", b"data"):
        assert d[k] == original[k]
    # the error record reached the waiter
    results = await r.xrange(keys.results)
    assert len(results) == 1
    rec = decode_record(results[0][1])
    assert rec.request_id == "req-1" and rec.status is RecordStatus.ERROR and rec.error == "invalid x: bad"
    assert rec.finish_reasons == [None]
    # acked, deleted, rid released
    assert (await r.xpending(keys.requests, G))["pending"] == 0
    assert await r.xlen(keys.requests) == 0
    assert await r.exists(keys.rid("req-1")) == 0


@pytest.mark.parametrize("record_sent", [True, False], ids=["error-record-sent", "reply-refused"])
async def test_a_dead_letter_leaves_the_finished_mark_as_a_finish_does(r, settings, record_sent):
    # An error record to a producer's reply stream is that request's record: its ownership field
    # becomes the finished mark (a retried submit of the token queues nothing until the record is
    # acked). Without a record (its reply stream refused it) the field goes.
    keys, scripts = settings.keys, Scripts(r)
    reply = keys.reply("p")
    sub = await scripts.submit(keys.requests, keys.rid("d1"), "p:d1", "d1", reply, data_for("d1"), 60)
    await ensure_group(r, keys.requests, G)
    await r.xreadgroup(G, "c1", {keys.requests: ">"})
    letter = dataclasses.replace(letter_for(keys, sub.entry_id, {b"rid": b"d1"}, rid="d1"), reply_to=reply,
                                 reply_refused=None if record_sent else "WRONGTYPE (simulated)")
    assert (await scripts.dead_letter(dead_key=keys.dead, group=G, consumer="c1", letter=letter)).done
    assert not await r.exists(keys.rid("d1"))
    if record_sent:
        [(rec_id, _)] = await r.xrange(reply)
        assert (await r.hget(keys.owner("p"), "d1")).decode() == f"done {rec_id.decode()} p:d1 requests {sub.entry_id}"
        assert (await scripts.submit(keys.requests, keys.rid("d1"), "p:d1", "d1", reply, data_for("d1"), 60)).retried
        assert await r.xlen(keys.requests) == 0
    else:
        assert await r.xlen(reply) == 0 and not await r.hexists(keys.owner("p"), "d1")


async def test_dead_letter_without_delete_and_without_reply(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    entry = await add_and_claim(r, keys, "c1")
    fields = {b"rid": b"req-1", b"data": b"\xc1garbage"}
    async with r.pipeline(transaction=False) as pipe:
        scripts.dead_letter_in(pipe, dead_key=keys.dead, group=G, consumer="c1",
                               letter=letter_for(keys, entry, fields, reply=False, delete=False))
        res = await pipe.execute()
    assert [DeadLetterOutcome.from_reply(x).done for x in res] == [True]
    d = (await r.xrange(keys.dead))[0][1]
    assert d[b"data"] == b"\xc1garbage"  # binary original fields survive
    assert await r.exists(keys.results) == 0
    assert (await r.xpending(keys.requests, G))["pending"] == 0
    assert await r.xlen(keys.requests) == 1  # acked but kept


async def test_dead_letter_refused_by_the_dead_stream_leaves_only_what_gc_collects(r, settings):
    """A dead stream of another type refuses the letter after the error record went to the reply
    stream: the record is deleted again, the entry stays pending. A reply stream the XADD created is
    left empty without a TTL: the same as a reply stream a worker re-created after it expired, which
    gc deletes once idle past reply_ttl_s."""
    keys, scripts = settings.keys, Scripts(r)
    entry = await add_and_claim(r, keys, "c1")
    await r.set(keys.dead, "a string")
    gone = keys.reply("gone")
    letter = dataclasses.replace(letter_for(keys, entry, {b"rid": b"req-1"}), reply_to=gone)
    res = await scripts.dead_letter(dead_key=keys.dead, group=G, consumer="c1", letter=letter)
    assert not res.done and "WRONGTYPE" in res.refused
    assert (await r.xpending(keys.requests, G))["pending"] == 1 and await r.get(keys.dead) == b"a string"
    assert await r.xlen(gone) == 0 and await r.ttl(gone) == -1
    await asyncio.sleep(0.05)
    report = await collect_garbage(r, keys, reply_ttl_s=0.01)
    assert report.reply_streams == [gone] and await r.exists(gone) == 0


async def test_dead_letter_refused_for_non_owner(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    entry = await add_and_claim(r, keys, "c1")
    await r.set(keys.rid("req-1"), f"tok requests {entry}")
    res = await scripts.dead_letter(dead_key=keys.dead, group=G, consumer="c2",
                                    letter=letter_for(keys, entry, {b"rid": b"req-1"}))
    assert res.fenced and not res.done
    assert await r.exists(keys.dead) == 0
    assert await r.exists(keys.results) == 0
    assert await r.xlen(keys.requests) == 1
    assert (await pending(r, keys, entry))["consumer"] == b"c1"
    assert await r.exists(keys.rid("req-1")) == 1


# ---------------------------------------------------------------- claim_lanes


async def lane_streams(r, namespace: str, lanes: int = 3):
    from redroll.shared.keys import Keys

    keys = Keys(namespace, lanes=lanes)
    for stream in keys.request_streams:
        await ensure_group(r, stream, WORKERS_GROUP)
    return keys


async def fill(r, stream: str, keys_and_counts: list[tuple[str, int]], age_ms: int | None = None) -> None:
    """Entries ``<ak>-<i>``; with ``age_ms``, ids (so ages by the server's clock) that many ms in the past."""
    seconds, micros = await r.time()
    past = seconds * 1000 + micros // 1000 - (age_ms or 0)
    for ak, count in keys_and_counts:
        for i in range(count):
            entry_id = f"{past}-*" if age_ms is not None else "*"
            await r.xadd(stream, {"rid": f"{ak}-{i}", "ak": ak, "data": b"x"}, id=entry_id)


def claimed(reply) -> list[tuple[str, str, list[str]]]:
    def rid(flat: list) -> str:
        return dict(zip(flat[0::2], flat[1::2]))[b"rid"].decode()
    return [(stream.rsplit(":", 1)[-1], kind, [rid(f) for _, f in entries]) for stream, kind, entries in reply]


def rids(got) -> list[tuple[str, list[str]]]:
    return [(stream.rsplit(":", 1)[-1], [dict(zip(f[0::2], f[1::2]))[b"rid"].decode() for _, f in entries])
            for stream, entries in got]


async def test_claim_reads_high_priority_first_and_carries_the_budget(r, namespace):
    keys = await lane_streams(r, namespace, lanes=0)
    scripts = Scripts(r)
    streams = [keys.requests_high, keys.requests]
    await fill(r, keys.requests, [("s", 3)])
    await fill(r, keys.requests_high, [("h", 2)])
    claim = dict(streams=streams, group=WORKERS_GROUP, consumer="w")
    # Budget 3: both high-priority entries, then one of the request stream; nothing over-read.
    got, refused = await scripts.claim(budget=3, **claim)
    assert rids(got) == [("high", ["h-0", "h-1"]), ("requests", ["s-0"])] and refused == []
    info = {g["name"]: g["pending"] for g in await r.xinfo_groups(keys.requests)}
    assert info[WORKERS_GROUP.encode()] == 1
    got, _ = await scripts.claim(budget=1, **claim)
    assert rids(got) == [("requests", ["s-1"])]
    got, _ = await scripts.claim(budget=8, **claim)
    assert rids(got) == [("requests", ["s-2"])]
    assert await scripts.claim(budget=8, **claim) == ([], [])


async def test_claim_reports_a_stream_without_its_group_and_still_reads_the_others(r, namespace):
    keys = await lane_streams(r, namespace, lanes=0)
    scripts = Scripts(r)
    await fill(r, keys.requests, [("s", 2)])
    await r.delete(keys.requests_high)  # (a server that restarted empty: the stream and its group are gone)
    await fill(r, keys.requests_high, [("h", 1)])  # a new submit makes the stream again, without the group
    got, refused = await scripts.claim(streams=[keys.requests_high, keys.requests], group=WORKERS_GROUP,
                                       consumer="w", budget=8)
    assert rids(got) == [("requests", ["s-0", "s-1"])]
    assert len(refused) == 1 and refused[0].startswith(keys.requests_high + ": NOGROUP")


async def test_claim_lanes_order_and_budget(r, namespace):
    keys = await lane_streams(r, namespace)
    scripts = Scripts(r)
    await fill(r, keys.requests_high, [("h", 1)])
    await fill(r, keys.lane(0), [("a", 2)])
    await fill(r, keys.requests, [("s", 2)])
    await fill(r, keys.lane(1), [("b", 3)])
    args = dict(high=keys.requests_high, own=[keys.lane(0)], shared=keys.requests, others=[keys.lane(1), keys.lane(2)],
                group=WORKERS_GROUP, consumer="w", steal_after_ms=60_000)
    # Budget 4: high, then own, then one of the shared stream; nothing over-read anywhere.
    assert claimed(await scripts.claim_lanes(budget=4, **args)) == [
        ("high", "high", ["h-0"]), ("0", "own", ["a-0", "a-1"]), ("requests", "shared", ["s-0"])]
    # The other lane's entries are young and few: not stolen.
    assert claimed(await scripts.claim_lanes(budget=4, **args)) == [("requests", "shared", ["s-1"])]
    assert claimed(await scripts.claim_lanes(budget=4, **args)) == []
    # Once they are older than the steal wait they are taken.
    await asyncio.sleep(0.05)
    assert claimed(await scripts.claim_lanes(budget=2, **{**args, "steal_after_ms": 10})) == [
        ("1", "stolen", ["b-0", "b-1"])]


async def test_claim_lanes_steals_beyond_the_depth_at_key_boundaries(r, namespace):
    keys = await lane_streams(r, namespace)
    scripts = Scripts(r)
    await fill(r, keys.lane(1), [("g1", 4), ("g2", 4), ("g3", 4)])
    args = dict(high=keys.requests_high, own=[keys.lane(0)], shared=keys.requests, others=[keys.lane(1)],
                group=WORKERS_GROUP, consumer="thief", steal_after_ms=60_000)
    # 12 undelivered, depth 4: 8 may go; a budget of 6 is cut back to the end of g1.
    assert claimed(await scripts.claim_lanes(budget=6, steal_depth=4, **args)) == [
        ("1", "stolen", ["g1-0", "g1-1", "g1-2", "g1-3"])]
    # 8 undelivered, depth 4: 4 may go, exactly g2.
    assert claimed(await scripts.claim_lanes(budget=6, steal_depth=4, **args)) == [
        ("1", "stolen", ["g2-0", "g2-1", "g2-2", "g2-3"])]
    assert claimed(await scripts.claim_lanes(budget=6, steal_depth=4, **args)) == []
    # A run longer than the budget is not split (g3: 4 entries, budget 3) ...
    await fill(r, keys.lane(1), [("hot", 20)])
    assert claimed(await scripts.claim_lanes(budget=3, steal_depth=4, **args)) == []
    assert claimed(await scripts.claim_lanes(budget=4, steal_depth=4, **args)) == [
        ("1", "stolen", ["g3-0", "g3-1", "g3-2", "g3-3"])]
    # ... unless it is longer than the window too: a hot key.
    assert claimed(await scripts.claim_lanes(budget=3, steal_depth=4, **args)) == [
        ("1", "stolen", ["hot-0", "hot-1", "hot-2"])]


async def test_claim_lanes_steals_from_lanes_at_a_key_boundary_first(r, namespace):
    keys = await lane_streams(r, namespace)
    scripts = Scripts(r)
    await fill(r, keys.lane(1), [("g1", 4), ("g2", 2)], age_ms=1500)  # older than T = 1 s, not 2T
    await fill(r, keys.lane(2), [("g3", 2)], age_ms=1500)
    await r.xreadgroup(WORKERS_GROUP, "owner", {keys.lane(1): ">"}, count=2)  # g1 is part way through
    args = dict(high=keys.requests_high, own=[keys.lane(0)], shared=keys.requests,
                others=[keys.lane(1), keys.lane(2)], group=WORKERS_GROUP, consumer="thief", steal_after_ms=1000)
    # lane 2 (at a boundary) first; then what is left of g1 (the budget cuts g2 off at a boundary).
    assert claimed(await scripts.claim_lanes(budget=5, **args)) == [
        ("2", "stolen", ["g3-0", "g3-1"]), ("1", "stolen", ["g1-2", "g1-3"])]


async def test_claim_lanes_splits_a_run_once_it_waited_twice_the_steal_wait(r, namespace):
    scripts = Scripts(r)
    for age_ms, expected in ((1500, []), (2500, [("1", "stolen", ["g1-1", "g1-2"])])):
        keys = await lane_streams(r, f"{namespace}{age_ms}")
        await fill(r, keys.lane(1), [("g1", 6)], age_ms=age_ms)
        await r.xreadgroup(WORKERS_GROUP, "owner", {keys.lane(1): ">"}, count=1)
        args = dict(high=keys.requests_high, own=[keys.lane(0)], shared=keys.requests, others=[keys.lane(1)],
                    group=WORKERS_GROUP, consumer="thief", budget=2, steal_after_ms=1000, steal_depth=16)
        # The rest of g1 (5) does not fit in 2 slots: left to its owner until it waited 2T.
        assert claimed(await scripts.claim_lanes(**args)) == expected, age_ms


async def test_claim_lanes_costs_an_idle_lane_one_xlen(r, namespace):
    # An idle fleet scans every other lane once per worker and steal wait: an empty lane must
    # cost that scan a single cheap read.
    keys = await lane_streams(r, namespace, lanes=16)
    scripts = Scripts(r)
    await r.config_resetstat()
    assert await scripts.claim_lanes(high=keys.requests_high, own=[keys.lane(0)], shared=keys.requests,
                                     others=[keys.lane(j) for j in range(1, 16)], group=WORKERS_GROUP,
                                     consumer="w", budget=8, steal_after_ms=10) == []
    stats = await r.info("commandstats")
    assert stats["cmdstat_xlen"]["calls"] == 15
    assert "cmdstat_xinfo|groups" not in stats and "cmdstat_xrange" not in stats


async def test_a_pipelines_first_error_is_raised_as_the_server_gave_it(r, settings):
    keys = settings.keys
    await r.set(keys.rid("plain"), "x")
    async with r.pipeline(transaction=False) as pipe:
        pipe.get(keys.rid("plain"))
        pipe.xlen(keys.rid("plain"))  # WRONGTYPE: no stream there
        pipe.fcall("redroll_not_loaded_here", 0)  # a function the server does not have
        replies = await pipe.execute(raise_on_error=False)
    with pytest.raises(redis.ResponseError) as ei:
        raising_first_error(replies)
    assert ei.value is replies[1] and str(ei.value).startswith("WRONGTYPE")  # (not rewritten with the command)
    assert raising_first_error(replies[:1]) == [b"x"]
    with pytest.raises(FunctionsMissingError):  # (a NoScriptError: callers that reloaded scripts load the library)
        raising_first_error(replies[2:])


async def test_a_send_to_a_server_without_the_library_loads_it_and_adds_each_request_once(r, settings):
    await r.function_flush()
    ids = await send(settings, r, [make_request(request_id=f"cold-{i}", prompt="x" * 400) for i in range(500)])
    assert len(set(ids)) == 500 and await r.xlen(settings.keys.requests) == 500


async def test_submit_notes_a_reply_stream_request_in_its_producers_ownership_hash(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    owned = await scripts.submit(keys.requests, keys.rid("o1"), "t", "o1", keys.reply("p"), data_for("o1"), 60)
    await scripts.submit(keys.requests, keys.rid("f1"), "t", "f1", keys.results, data_for("f1"), 60)
    assert await r.hgetall(keys.owner("p")) == {b"o1": f"requests {owned.entry_id}".encode()}
    assert 0 < await r.ttl(keys.owner("p")) <= 60
    # An ownership key of another type refuses that item alone: nothing of it is written.
    await r.set(keys.owner("q"), "not a hash")
    with pytest.raises(StreamRefusedError, match="WRONGTYPE"):
        await scripts.submit(keys.requests, keys.rid("o2"), "t", "o2", keys.reply("q"), data_for("o2"), 60)
    assert not await r.exists(keys.rid("o2")) and await r.xlen(keys.requests) == 2


async def test_finish_publishes_to_a_reply_stream_only_what_its_ownership_hash_names(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    await ensure_group(r, keys.requests, G)
    entry = (await r.xadd(keys.requests, {"rid": "o1", "reply_to": keys.reply("p"), "data": data_for("o1")})).decode()
    await r.xreadgroup(G, "c1", {keys.requests: ">"})
    kwargs = dict(requests_key=keys.requests, reply_key=keys.reply("p"), rid_key=keys.rid("o1"), group=G,
                  consumer="c1", entry_id=entry, record=record("o1", worker="c1"))
    with pytest.raises(OwnershipError, match="did not submit it"):
        await scripts.finish(**kwargs)
    assert await r.xlen(keys.reply("p")) == 0
    await r.hset(keys.owner("p"), "o1", f"requests {entry}")  # (what p's submit writes)
    assert await scripts.finish(**kwargs) == 1
    assert await r.xlen(keys.reply("p")) == 1 and await r.hlen(keys.owner("p")) == 0


async def test_a_submit_retried_after_its_request_finished_is_not_queued_again_until_its_record_is_acked(r, settings):
    # The finish turns the ownership field into a mark naming the record and the submit's token. A
    # submit of that token while the record waits on the reply stream (a restarted producer with
    # tokens made from its request_ids; a retry after a lost reply) is told it was taken, and
    # queues nothing; the ack takes the mark out, and a later submit of the token is a new request.
    keys, scripts = settings.keys, Scripts(r)
    reply = keys.reply("p")
    first = await scripts.submit(keys.requests, keys.rid("m1"), "p:m1", "m1", reply, data_for("m1"), 60)
    await ensure_group(r, keys.requests, G)
    await ensure_group(r, reply, "producer")
    await r.xreadgroup(G, "c1", {keys.requests: ">"})
    assert await scripts.finish(requests_key=keys.requests, reply_key=reply, rid_key=keys.rid("m1"), group=G,
                                consumer="c1", entry_id=first.entry_id, record=record("m1", worker="c1")) == 1
    [(rec_id, _)] = await r.xrange(reply)
    mark = (await r.hget(keys.owner("p"), "m1")).decode()
    assert mark == f"done {rec_id.decode()} p:m1 requests {first.entry_id}" and not await r.exists(keys.rid("m1"))

    again = await scripts.submit(keys.requests, keys.rid("m1"), "p:m1", "m1", reply, data_for("m1"), 60)
    assert again.retried and again.entry_id == first.entry_id
    assert await r.xlen(keys.requests) == 0 and not await r.exists(keys.rid("m1"))  # (nothing queued or held)

    # Another token (a producer's own new submit of the request_id) is a new request; the record of
    # the earlier one, acked after, leaves the new field alone.
    other = await scripts.submit(keys.requests, keys.rid("m1"), "p:rand:0", "m1", reply, data_for("m1"), 60)
    assert not other.retried and await r.xlen(keys.requests) == 1
    await r.xreadgroup("producer", "p", {reply: ">"})
    assert await scripts.ack_replies_in(r, stream=reply, group="producer", entries=[(rec_id.decode(), "m1")]) == 1
    assert await r.xlen(reply) == 0
    assert (await r.hget(keys.owner("p"), "m1")).decode() == f"requests {other.entry_id}"


async def test_the_ack_takes_out_the_finished_mark_and_a_record_gone_unread_frees_the_token(r, settings):
    keys, scripts = settings.keys, Scripts(r)
    reply = keys.reply("p")
    await ensure_group(r, keys.requests, G)
    await ensure_group(r, reply, "producer")
    entries = {}
    for rid in ("a1", "a2"):
        entries[rid] = (await scripts.submit(keys.requests, keys.rid(rid), f"p:{rid}", rid, reply, data_for(rid),
                                             60)).entry_id
    await r.xreadgroup(G, "c1", {keys.requests: ">"})
    for rid in ("a1", "a2"):
        await scripts.finish(requests_key=keys.requests, reply_key=reply, rid_key=keys.rid(rid), group=G,
                             consumer="c1", entry_id=entries[rid], record=record(rid, worker="c1"))
    recs = {f[b"rid"].decode(): i.decode() for i, f in await r.xrange(reply)}
    await r.xreadgroup("producer", "p", {reply: ">"})
    # a1's record is acked: its mark goes, and the token submits anew
    assert await scripts.ack_replies_in(r, stream=reply, group="producer", entries=[(recs["a1"], "a1")]) == 1
    assert not await r.hexists(keys.owner("p"), "a1")
    assert not (await scripts.submit(keys.requests, keys.rid("a1"), "p:a1", "a1", reply, data_for("a1"), 60)).retried
    # a2's record is gone without an ack (the reply stream trimmed or expired): the mark is stale,
    # and the token submits anew too (nothing would ever deliver the record it names)
    await r.xdel(reply, recs["a2"])
    assert (await r.hget(keys.owner("p"), "a2")).decode().startswith("done ")
    assert not (await scripts.submit(keys.requests, keys.rid("a2"), "p:a2", "a2", reply, data_for("a2"), 60)).retried
    assert await r.xlen(keys.requests) == 2


async def test_an_entry_forged_on_another_request_stream_with_the_submitted_id_is_refused(r, settings):
    # Entry ids are per stream: an entry added to the high-priority stream with the id of a genuine
    # submit to the normal stream (an explicit id, or the same millisecond) names the same
    # request_id and reply stream. The rid key and the ownership hash name the stream as well as the
    # id, so the forged entry is refused (for a reply stream and for the results stream alike) and
    # the genuine one is published.
    keys, scripts = settings.keys, Scripts(r)
    for rid, reply in (("v1", keys.reply("p2")), ("v2", keys.results)):
        genuine = await scripts.submit(keys.requests, keys.rid(rid), "t", rid, reply, data_for(rid), 60)
        await ensure_group(r, keys.requests, G)
        await ensure_group(r, keys.requests_high, G)
        forged = (await r.xadd(keys.requests_high, {"rid": rid, "reply_to": reply, "data": data_for(rid)},
                               id=genuine.entry_id)).decode()
        assert forged == genuine.entry_id
        await r.xreadgroup(G, "c1", {keys.requests_high: ">", keys.requests: ">"})
        common = dict(reply_key=reply, rid_key=keys.rid(rid), group=G, consumer="c1", record=record(rid, worker="c1"))
        with pytest.raises(OwnershipError):
            await scripts.finish(requests_key=keys.requests_high, entry_id=forged, **common)
        assert await r.xlen(reply) == 0
        assert await scripts.finish(requests_key=keys.requests, entry_id=genuine.entry_id, **common) == 1
        assert await r.xlen(reply) == 1 and not await r.exists(keys.rid(rid))
        await r.delete(reply)


async def test_a_batch_finish_logs_each_item_in_its_own_event_log_and_a_refused_item_nowhere(r, settings):
    # Four keys per item (reply, rid, checkpoint, ownership hash), then one event log per item:
    # each item's event lands in its own log, and an item the ownership check refuses writes
    # nothing at all (no record, no ack, no log line), whatever the other items do.
    from redroll.shared.events import EventLog

    keys, scripts = settings.keys, Scripts(r, EventLog())  # (every finish logged)
    await ensure_group(r, keys.requests, G)
    rids = ["mine-1", "forged-2", "fire-3", "lost-4"]
    replies = [keys.reply("p"), keys.reply("p"), keys.results, keys.results]
    entries = [(await r.xadd(keys.requests, {"rid": rid, "reply_to": reply, "data": data_for(rid)})).decode()
               for rid, reply in zip(rids, replies)]
    await r.xreadgroup(G, "c1", {keys.requests: ">"}, count=3)
    await r.xreadgroup(G, "c2", {keys.requests: ">"}, count=1)  # (lost-4 is another worker's)
    await r.hset(keys.owner("p"), "mine-1", f"requests {entries[0]}")  # (p's submit noted mine-1, not forged-2)
    reply = await scripts.finish_many_in(r, requests_key=keys.requests, group=G, consumer="c1", worker="c1", items=[
        (entry, reply_key, keys.rid(rid), record(rid, worker="c1"), 0, None)
        for entry, reply_key, rid in zip(entries, replies, rids)])
    assert reply == [1, 4, 1, 0]
    logs = {rid: (await r.get(keys.events(rid)) or b"").decode() for rid in rids}
    assert logs["mine-1"].count("\n") == 1 and f"\tfinished\tworker=c1\tentry={entries[0]}\t" in logs["mine-1"]
    assert f"\treply={keys.reply('p')}\t" in logs["mine-1"]
    assert logs["fire-3"].count("\n") == 1 and f"\tentry={entries[2]}\t" in logs["fire-3"]
    assert f"\treply={keys.results}\t" in logs["fire-3"]
    assert logs["lost-4"].count("\n") == 1 and f"\tfenced\tworker=c1\tentry={entries[3]}\t" in logs["lost-4"]
    assert logs["forged-2"] == ""
    # The refused item: still pending with c1, not published, its ownership hash untouched.
    assert (await pending(r, keys, entries[1]))["consumer"] == b"c1"
    assert await r.xlen(keys.reply("p")) == 1 and await r.xlen(keys.results) == 1
    assert await r.hgetall(keys.owner("p")) == {}  # (mine-1's field went with its finish)
    assert await r.type(keys.owner("p")) in (b"none", b"hash")


async def test_a_reclaim_scan_walks_only_entries_old_enough_to_be_idle_and_those_handed_back(settings, r):
    """reclaim_scan.lua: XPENDING ... IDLE up to the newest entry that can have been idle that long
    (made before now - min idle), or the newest handed back (renew.lua's mark), not further."""
    from redroll.shared.scripts import Scripts

    keys, stream = settings.keys, settings.keys.requests
    scripts = Scripts(r)
    await ensure_group(r, stream, WORKERS_GROUP)
    seconds, micros = await r.time()
    old_id = f"{seconds * 1000 + micros // 1000 - 120_000}-0"  # (made two minutes ago)
    old = (await r.xadd(stream, {"rid": "old"}, id=old_id)).decode()
    fresh = (await r.xadd(stream, {"rid": "fresh"})).decode()
    handed = (await r.xadd(stream, {"rid": "handed"})).decode()
    await r.xreadgroup(WORKERS_GROUP, "dead", {stream: ">"}, count=3)
    # Idle for a minute each (an XCLAIM ... IDLE): only the old one can really be, and the hand-back.
    await r.xclaim(stream, WORKERS_GROUP, "dead", 0, [old, fresh], idle=60_000, justid=True)

    async def scan() -> list[str]:
        [rows] = await scripts.reclaim_scan(streams=[stream], marks=keys.reclaim_marks, group=WORKERS_GROUP,
                                            min_idle_ms=30_000, count=10)
        return [row[0].decode() for row in rows]

    assert await scan() == [old]
    assert await scripts.renew(stream, WORKERS_GROUP, "dead", [handed], idle_ms=60_000, marks=keys.reclaim_marks) == []
    assert await scan() == [old, fresh, handed]  # (up to the newest handed back: the fresh one is in range)
    [refused] = await scripts.reclaim_scan(streams=[keys.lane(0)], marks=keys.reclaim_marks, group=WORKERS_GROUP,
                                           min_idle_ms=30_000, count=10)
    assert isinstance(refused, str) and "NOGROUP" in refused
