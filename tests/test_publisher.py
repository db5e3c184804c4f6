"""The worker's publisher against a real redis-server: concurrent finishes share a round trip, a
round trip's records are split into script calls of bounded size, and each caller gets its own
entry's outcome back whichever call carried it."""

from __future__ import annotations

import asyncio

import msgpack

from redroll.engine_worker.publisher import Finish, Publisher
from redroll.shared.codec import decode_record, encode_record
from redroll.shared.keys import WORKERS_GROUP, submitted_as
from redroll.shared.refusals import StreamRefusedError
from redroll.shared.scripts import Scripts
from redroll.shared.streams import ensure_group
from redroll.shared.types import CompletionRecord, RecordStatus

G = WORKERS_GROUP


def record(rid: str, tokens: int) -> CompletionRecord:
    return CompletionRecord(request_id=rid, status=RecordStatus.FINISHED, output_token_ids=[list(range(tokens))],
                            finish_reasons=["length"], output_logprobs=[[-0.5] * tokens], meta_info={},
                            worker="w1")


async def claimed(r, keys, rids: list[str], consumer: str) -> list[str]:
    await ensure_group(r, keys.requests, G)
    for rid in rids:
        data = msgpack.packb({"v": 1, "request_id": rid, "prompt": "hi", "submitted_at": 1.0}, use_bin_type=True)
        await r.xadd(keys.requests, {"rid": rid, "data": data})
    resp = await r.xreadgroup(G, consumer, {keys.requests: ">"}, count=len(rids))
    return [e[0].decode() for e in resp[0][1]]


class CountingScripts(Scripts):
    """Scripts that note how many records each ``finish_many`` call carried (loaded first, so that
    no call is sent twice after a NOSCRIPT reply)."""

    def __init__(self, redis):
        super().__init__(redis)
        self.calls: list[int] = []

    def finish_many_in(self, client, **kwargs):
        self.calls.append(len(kwargs["items"]))
        return super().finish_many_in(client, **kwargs)


async def finish_all(publisher: Publisher, keys, entries: list[str], records: list[CompletionRecord]) -> list[bool]:
    """Finish every entry at once (one flush), then close the publisher."""
    try:
        return await asyncio.gather(*(
            publisher.finish(Finish(stream=keys.requests, entry_id=e, reply_key=keys.results,
                                    rid_key=keys.rid(rec.request_id), record=rec, cap=0))
            for e, rec in zip(entries, records)))
    finally:
        await publisher.close()


async def test_finishes_of_one_round_trip_are_split_into_calls_of_bounded_size(r, settings):
    keys = settings.keys
    records = [record(f"big-{i}", 3_000) for i in range(5)]
    size = len(encode_record(records[0])["data"])
    entries = await claimed(r, keys, [rec.request_id for rec in records], "w1")
    scripts = CountingScripts(r)
    await scripts.load_all()
    publisher = Publisher(scripts, "w1", max_call_bytes=2 * size + size // 2)
    published = await finish_all(publisher, keys, entries, records)
    assert published == [True] * 5
    assert publisher.flushes == 1 and scripts.calls == [2, 2, 1]  # one round trip, three calls
    stored = [decode_record(f) for _, f in await r.xrange(keys.results)]
    assert [s.request_id for s in stored] == [rec.request_id for rec in records]
    assert stored[4].output_token_ids == records[4].output_token_ids
    assert await r.xlen(keys.requests) == 0  # each call acked and deleted its own entries


async def test_each_caller_gets_its_own_outcome_whichever_call_carried_it(r, settings):
    # Entries 1 and 3 belong to another worker: their finishes are fenced (False), in whichever
    # call they went; the others publish.
    keys = settings.keys
    records = [record(f"mix-{i}", 2_000) for i in range(4)]
    size = len(encode_record(records[0])["data"])
    mine = await claimed(r, keys, ["mix-0", "mix-2"], "w1")
    theirs = await claimed(r, keys, ["mix-1", "mix-3"], "w2")
    entries = [mine[0], theirs[0], mine[1], theirs[1]]
    scripts = CountingScripts(r)
    await scripts.load_all()
    publisher = Publisher(scripts, "w1", max_call_bytes=size)  # one record a call
    published = await finish_all(publisher, keys, entries, records)
    assert published == [True, False, True, False]
    assert scripts.calls == [1, 1, 1, 1]
    assert [f[b"rid"] for _, f in await r.xrange(keys.results)] == [b"mix-0", b"mix-2"]


async def test_small_finishes_share_one_call(r, settings):
    keys = settings.keys
    records = [record(f"small-{i}", 4) for i in range(20)]
    entries = await claimed(r, keys, [rec.request_id for rec in records], "w1")
    scripts = CountingScripts(r)
    await scripts.load_all()
    publisher = Publisher(scripts, "w1")
    published = await finish_all(publisher, keys, entries, records)
    assert published == [True] * 20
    assert scripts.calls == [20]


async def test_a_group_of_finishes_has_one_future_and_each_its_own_outcome(r, settings):
    # One finish_many group: entries of this worker publish, another worker's are fenced, and one
    # whose reply stream is a key of another type gets that refusal; nothing else changes.
    keys = settings.keys
    records = [record(f"grp-{i}", 3) for i in range(4)]
    mine = await claimed(r, keys, ["grp-0", "grp-2", "grp-3"], "w1")
    theirs = await claimed(r, keys, ["grp-1"], "w2")
    broken = keys.reply("broken")
    await r.set(broken, "not a stream")
    await r.hset(keys.owner("broken"), "grp-2", submitted_as(keys.requests, mine[1]))  # (its producer's submit noted it: the XADD is reached)
    scripts = CountingScripts(r)
    await scripts.load_all()
    publisher = Publisher(scripts, "w1", max_batch=2)  # two records a call
    entries, replies = [mine[0], theirs[0], mine[1], mine[2]], [keys.results, keys.results, broken, keys.results]
    try:
        outcomes = await publisher.finish_many([
            Finish(stream=keys.requests, entry_id=e, reply_key=reply, rid_key=keys.rid(rec.request_id), record=rec, cap=0)
            for e, reply, rec in zip(entries, replies, records)])
    finally:
        await publisher.close()
    assert outcomes[:2] == [True, False] and outcomes[3] is True
    assert isinstance(outcomes[2], StreamRefusedError) and outcomes[2].key == broken and "WRONGTYPE" in str(outcomes[2])
    assert publisher.flushes == 1 and scripts.calls == [2, 2]
    assert [f[b"rid"] for _, f in await r.xrange(keys.results)] == [b"grp-0", b"grp-3"]
    assert [e[0].decode() for e in await r.xrange(keys.requests)] == [mine[1], theirs[0]]  # (kept: not published)
