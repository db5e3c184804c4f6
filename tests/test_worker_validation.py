"""Acceptance: malformed requests never crash a worker; each is dead-lettered with a reason naming the
problem and, where its request_id and reply_to can be read, its waiter gets an ``error`` record."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer.client import Producer
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.types import SCHEMA_VERSION, RecordStatus
from tests.conftest import wait_until
from tests.support.raw_submit import add_request_entry

_DROP = object()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def request_map(rid: str, reply_to: str, **over: Any) -> dict[str, Any]:
    m: dict[str, Any] = {
        "v": 1,
        "request_id": rid,
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 4},
        "reply_to": reply_to,
        "submitted_at": time.time(),
    }
    for k, v in over.items():
        if v is _DROP:
            m.pop(k, None)
        else:
            m[k] = v
    return m


def nested_request(rid: str, reply_to: str) -> bytes:
    """A request whose meta_info nests 2,000 lists deep (2 kB): past a recursive decoder's limit."""
    m = request_map(rid, reply_to)
    return (msgpack.Packer(use_bin_type=True).pack_map_header(len(m) + 1)
            + b"".join(pack(k) + pack(v) for k, v in m.items()) + pack("meta_info") + b"\x81\xa1k"
            + b"\x91" * 2_000 + b"\xc0")


@dataclass
class Case:
    name: str
    rid: str
    data: bytes | None
    keywords: tuple[str, ...]
    """Each must appear in the dead entry's reason (and in the error record)."""
    expect_record: bool
    reply_to: str | None = None
    entry_id: str | None = None


def cases(ns_reply: str) -> list[Case]:
    def c(name: str, keywords: tuple[str, ...], *, record: bool = True, rid: str | None = None,
          data: Any = None, raw: bytes | None = None, reply_to: str | None = None, **over: Any) -> Case:
        rid = rid or f"bad-{name}"
        if raw is None and data is None:
            raw = pack(request_map(rid, ns_reply, **over))
        elif raw is None:
            raw = pack(data)
        return Case(name, rid, raw, keywords, record, reply_to or ns_reply)

    return [
        c("not-msgpack", ("data", "msgpack"), raw=b"\xc1\xc1 this is not msgpack"),
        c("not-a-map", ("data", "map"), data=[1, 2, 3]),
        c("no-data-field", ("data",), raw=b""),  # replaced below by an entry without a data field
        c("missing-request-id", ("request_id",), request_id=_DROP),
        c("braces-request-id", ("request_id",), record=False, rid="bad{id}",
          data=request_map("bad{id}", ns_reply)),
        c("both-inputs", ("input_ids", "prompt"), prompt="hello"),
        c("neither-input", ("input_ids", "prompt"), input_ids=_DROP),
        c("input-ids-string", ("input_ids",), input_ids="1 2 3"),
        c("return-logprob-int", ("return_logprob",), return_logprob=1),
        c("negative-max-new-tokens", ("max_new_tokens",), sampling_params={"max_new_tokens": -5}),
        c("huge-max-new-tokens", ("max_new_tokens",), sampling_params={"max_new_tokens": 10**9}),
        c("token-out-of-vocab", ("input_ids", "vocab"), input_ids=[1, 2, 5000]),
        c("stop-token-out-of-vocab", ("stop_token_ids", "vocab"),
          sampling_params={"max_new_tokens": 4, "stop_token_ids": [1000]}),
        c("foreign-reply-to", ("reply_to",), record=False, reply_to="other:stream", rid="bad-foreign",
          data=request_map("bad-foreign", "other:stream")),
        c("oversize", ("data", "exceeds"), input_ids=_DROP, prompt="x" * 6000),
        c("schema-v0", ("v", "schema"), v=0),
        c("temperature-negative", ("temperature",), sampling_params={"temperature": -1}),
        c("top-p-2", ("top_p",), sampling_params={"top_p": 2}),
        c("nan-temperature", ("temperature",), sampling_params={"temperature": float("nan")}),
        c("unknown-sampling", ("frobnicate", "unknown"), sampling_params={"frobnicate": 3}),
        c("model-not-served", ("model", "other-model"), model="other-model"),
        c("meta-not-map", ("meta_info",), meta_info=[1, 2]),
        c("deadline-str", ("deadline",), deadline="tomorrow"),
        c("negative-token", ("input_ids",), input_ids=[1, -1]),
        c("deeply-nested", ("data", "nested too deeply"), raw=nested_request("bad-deeply-nested", ns_reply)),
    ]


@pytest.mark.parametrize("token_ms", [1, 0], ids=["task-per-request", "instant-engine-batches"])
async def test_malformed_requests_are_dead_lettered_and_waiters_told(settings, r, token_ms):
    # (with an instant engine a claim's entries run in one task, and these leave it for their own)
    settings = settings.with_(max_payload_bytes=4096)
    keys = settings.keys
    worker = Worker(settings, SyntheticEngine(token_ms=token_ms, vocab_size=1000), max_inflight=8, block_ms=200)
    task = asyncio.create_task(worker.run())
    try:
        async with Producer(settings, block_ms=200) as producer:
            bad = cases(producer.reply_to)
            assert len({c.name for c in bad}) >= 13
            valid_futures = []
            for i, case in enumerate(bad):
                fields: dict[str, Any] = {"rid": case.rid, "reply_to": case.reply_to}
                if case.name != "no-data-field":
                    fields["data"] = case.data
                ours = isinstance(case.rid, str) and case.reply_to == producer.reply_to
                case.entry_id = await add_request_entry(r, keys.requests, fields, rid=case.rid,
                                                        owner_key=keys.owner(producer.name) if ours else None)
                valid_futures.append(await producer.submit(
                    request_id=f"good-{i}", input_ids=[1, 2, 3 + i], sampling_params={"max_new_tokens": 4 + i}))
            valid_futures.append(await producer.submit(request_id="good-prompt", prompt="a prompt",
                                                       sampling_params={"max_new_tokens": 3, "n": 2}))

            # every valid request completes
            records = await asyncio.wait_for(asyncio.gather(*valid_futures), timeout=20)
            for rec in records:
                assert rec.status is RecordStatus.FINISHED, (rec.request_id, rec.error)
                assert rec.error is None
                assert all(len(ids) > 0 for ids in rec.output_token_ids)
            assert [len(x) for x in records[-1].output_token_ids] == [3, 3]

            # every bad one is in the dead-letter stream, with a reason naming the problem
            async def all_dead() -> bool:
                return await r.xlen(keys.dead) >= len(bad)
            await wait_until(all_dead, timeout=15)
            dead = {f[b"entry"].decode(): f for _id, f in await r.xrange(keys.dead)}
            assert len(dead) == len(bad)
            for case in bad:
                d = dead.get(case.entry_id)
                assert d is not None, f"{case.name}: no dead entry"
                reason = d[b"reason"].decode()
                for kw in case.keywords:
                    assert kw in reason, f"{case.name}: {kw!r} not in reason {reason!r}"
                assert d[b"source"] == b"worker"
                assert d[b"rid"] == case.rid.encode()
                assert d[b"reply_to"] == case.reply_to.encode()
                if case.name != "no-data-field":
                    assert d[b"data"] == case.data, case.name
                else:
                    assert b"data" not in d

                if case.expect_record:
                    rec = await producer.result(case.rid, timeout=5)
                    assert rec.status is RecordStatus.ERROR, case.name
                    assert rec.error == reason, case.name
                    assert rec.request_id == case.rid
                    assert rec.finish_reasons == [None]

            # nothing was written outside the pipeline's keys; nothing is left behind
            assert await r.exists("other:stream") == 0
            async def drained() -> bool:
                pend = await r.xpending(keys.requests, WORKERS_GROUP)
                return await r.xlen(keys.requests) == 0 and pend["pending"] == 0
            await wait_until(drained, timeout=10)
            # no error record reached the producer for the cases nobody could be told about,
            # and no duplicate records arrived for anything else
            await asyncio.sleep(0.3)
            assert await r.xlen(producer.reply_to) == 0
            assert producer.outstanding == 0

            assert not task.done(), "the worker must survive malformed input"
            assert worker.stats.dead_lettered == len(bad)
            assert worker.stats.by_status.get("finished") == len(valid_futures)
            assert worker.stats.engine_errors == 0
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, timeout=10)


async def test_newer_schema_is_handed_back_not_dead_lettered(settings, r):
    # a short claim_idle makes the worker re-meet the entry many times (well past max_deliveries)
    settings = settings.with_(claim_idle_ms=300, max_deliveries=3)
    keys = settings.keys
    worker = Worker(settings, SyntheticEngine(token_ms=1, vocab_size=1000), max_inflight=8, block_ms=200)
    task = asyncio.create_task(worker.run())
    try:
        async with Producer(settings, block_ms=200) as producer:
            m = request_map("from-the-future", producer.reply_to, v=SCHEMA_VERSION + 1,
                            sampling_params={"max_new_tokens": 4, "a_knob_from_v2": True})
            entry_id = (await r.xadd(keys.requests, {"rid": "from-the-future", "reply_to": producer.reply_to,
                                                     "data": pack(m)})).decode()
            # a valid request behind it is not blocked
            rec = await asyncio.wait_for(await producer.submit(request_id="ok-1", prompt="hi",
                                                               sampling_params={"max_new_tokens": 2}), 10)
            assert rec.status is RecordStatus.FINISHED

            await wait_until(lambda: worker.stats.handed_back >= 1, timeout=5)
            await asyncio.sleep(2.0)  # many reclaim cycles (reclaim every ~0.15 s)
            assert worker.stats.handed_back > settings.max_deliveries
            remaining = [e[0].decode() for e in await r.xrange(keys.requests)]
            assert remaining == [entry_id]
            assert await r.xlen(keys.dead) == 0
            assert await r.xlen(producer.reply_to) == 0
            assert worker.stats.dead_lettered == 0
            assert not task.done()
            # noted as handed back on purpose: taken back with the rest, never run alone as a suspect
            note = (await r.hget(keys.errors, entry_id)).decode()
            assert "handed back" in note and "newer" in note
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, timeout=10)
    # the drained worker left it pending for a newer worker, with its payload intact
    fields = (await r.xrange(keys.requests))[0][1]
    assert msgpack.unpackb(fields[b"data"], raw=False)["v"] == SCHEMA_VERSION + 1
