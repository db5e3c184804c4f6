"""Producers that cannot touch each other (docs/acl.md, "Producers isolated from each other").

Two producers run as their own ACL users, each narrowed to its reply stream and ownership hash
(``acl_rules("producer", ns, producer=NAME)``), beside a worker user. Producer p1 tries what its
grants used to let it do: have a worker publish into p2's reply stream (a ``reply_to`` naming it;
an entry of its own with p2's live request_id), forge a record on the results stream, empty a
stream it may write with ``XADD … MAXLEN 0``.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
import redis.exceptions

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer.client import Producer, make_request, send
from redroll.shared.codec import encode_request
from redroll.shared.connection import connect
from redroll.shared.settings import Settings
from redroll.shared.types import RecordStatus
from tests import test_security
from tests.conftest import running, wait_until
from tests.test_security import acl_denials, assert_denied, make_user

acl_server, admin = test_security.acl_server, test_security.admin  # (its fixtures: a server with ACL users)

SP = {"max_new_tokens": 3}


def dead_letters(admin: redis.Redis, keys) -> list[dict]:
    return [{k.decode(): v for k, v in fields.items()} for _, fields in admin.xrange(keys.dead)]


def users(admin: redis.Redis, server, ns: str) -> tuple[Settings, Settings, Settings]:
    return (make_user(admin, server, ns, "producer", producer="p1"),
            make_user(admin, server, ns, "producer", producer="p2"),
            make_user(admin, server, ns, "worker"))


async def test_a_reply_to_naming_another_producers_stream_is_dead_lettered_not_published(acl_server, admin):
    ns = "iso" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    p1_s, _, work_s = users(admin, acl_server, ns)
    admin.xgroup_create(keys.reply("p2"), "producer", id="0", mkstream=True)
    p1 = connect(p1_s)
    try:
        # The submit itself is refused: it would note the request in p2's ownership hash.
        with pytest.raises(redis.exceptions.NoPermissionError) as info:
            await send(p1_s, p1, [make_request(request_id="from-p1", prompt="x", sampling_params=SP)],
                       reply_to=keys.reply("p2"))
        assert_denied(info.value, p1_s)
        # An entry of its own (XADD, as the grant to submit allows) reaches a worker, which refuses it.
        forged = make_request(request_id="from-p1", prompt="x", sampling_params=SP)
        forged.reply_to = keys.reply("p2")
        await p1.xadd(keys.requests, encode_request(forged, p1_s.limits))
        async with running(Worker(work_s, SyntheticEngine(), block_ms=100)):
            await wait_until(lambda: admin.xlen(keys.dead) == 1, 15)
    finally:
        await p1.aclose()
    (letter,) = dead_letters(admin, keys)
    assert letter["rid"] == b"from-p1" and b"ownership check failed" in letter["reason"], letter
    assert admin.xlen(keys.reply("p2")) == 0  # nothing reached p2: no record, no error record
    assert admin.xlen(keys.requests) == 0


async def test_an_entry_with_another_producers_live_request_id_cannot_take_it_over(acl_server, admin):
    # p2's request waits in the queue; p1 queues an entry of its own with p2's request_id and reply
    # stream on the high-priority stream (claimed first). p2 must get its own record.
    ns = "iso" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    p1_s, p2_s, work_s = users(admin, acl_server, ns)
    async with Producer(p2_s, name="p2", block_ms=100) as p2:
        victim = await p2.submit(request_id="victim", prompt="genuine", sampling_params=SP)
        p1 = connect(p1_s)
        try:
            forged = make_request(request_id="victim", prompt="forged", sampling_params={"max_new_tokens": 9})
            forged.reply_to = keys.reply("p2")
            await p1.xadd(keys.requests_high, encode_request(forged, p1_s.limits))
        finally:
            await p1.aclose()
        async with running(Worker(work_s, SyntheticEngine(), block_ms=100)):
            record = await asyncio.wait_for(victim, 15)
            await wait_until(lambda: admin.xlen(keys.dead) == 1, 15)
    assert record.status is RecordStatus.FINISHED and len(record.output_token_ids[0]) == 3  # p2's own
    (letter,) = dead_letters(admin, keys)
    assert letter["rid"] == b"victim" and b"ownership check failed" in letter["reason"], letter
    assert admin.xlen(keys.requests_high) == 0 and not admin.exists(keys.rid("victim"))
    assert admin.hlen(f"{keys.tag}:own:p2") == 0  # (the finish took its field out of p2's ownership hash)
    assert acl_denials(admin, ns) == []


async def test_a_producer_writes_neither_the_results_stream_nor_another_producers_ownership_hash(
        acl_server, admin):
    # A forged record on the results stream was applied by consumer groups, which then skipped the
    # genuine record as a duplicate.
    ns = "iso" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    p1_s, _, _ = users(admin, acl_server, ns)
    p1 = connect(p1_s)
    try:
        for command in (("XADD", keys.results, "*", "rid", "victim", "status", "finished", "data", b"x"),
                        ("XADD", keys.results, "MAXLEN", "0", "*", "rid", "x"),
                        ("HSET", f"{keys.tag}:own:p2", "victim", "1-1")):
            with pytest.raises(redis.exceptions.NoPermissionError) as info:
                await p1.execute_command(*command)
            assert_denied(info.value, p1_s)
    finally:
        await p1.aclose()
    assert admin.exists(keys.results) == 0


async def test_a_role_may_still_empty_a_stream_it_writes_and_xinfo_shows_it(acl_server, admin):
    # Documented in docs/acl.md: ACLs cannot restrict XADD's options, so a producer (or worker)
    # that may XADD to the dead-letter stream may trim it to nothing with MAXLEN 0. XINFO STREAM
    # keeps the count of entries ever added, which is how an operator notices.
    ns = "iso" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    p1_s, _, _ = users(admin, acl_server, ns)
    for i in range(3):
        admin.xadd(keys.dead, {"reason": f"r{i}"})
    p1 = connect(p1_s)
    try:
        await p1.xadd(keys.dead, {"reason": "x"}, maxlen=0)
    finally:
        await p1.aclose()
    info = admin.xinfo_stream(keys.dead)
    assert info["length"] == 0 and info["entries-added"] == 4


# ------------------------------------------------- a request_id cannot be taken over (issue 44)

# What p1 tries on p2's live rid key before submitting the same request_id itself. Each worked
# with the grants of before (GET SET MGET DEL on {ns}:rid:*): delete it, overwrite it with a value
# naming no entry, or re-set it with a short expiry.
TAKEOVERS = {
    "delete": lambda key, value: ("DEL", key),
    "overwrite": lambda key, value: ("SET", key, b"p1-token 0-1"),
    "expire": lambda key, value: ("SET", key, value, "PX", "1"),
}


async def _try_takeover(admin, p1, p1_s, keys, how: str):
    """p1 attacks the live rid key of "victim", then submits "victim" fire-and-forget with a
    longer output (9 tokens, p2's asks for 3). Returns (the refusal of the attack or None, the
    outcome of p1's submit: entry id or error)."""
    from redroll.producer.sending import send_each

    key = keys.rid("victim")
    value = admin.get(key)
    assert value is not None
    try:
        await p1.execute_command(*TAKEOVERS[how](key, value))
        refusal = None
    except redis.exceptions.NoPermissionError as exc:
        refusal = exc
    if refusal is None and how == "expire":
        await wait_until(lambda: not admin.exists(key), 5)
    forged = make_request(request_id="victim", prompt="forged", sampling_params={"max_new_tokens": 9},
                          callback="apply")
    (outcome,) = await send_each(p1_s, p1, [forged])
    return refusal, outcome


@pytest.mark.parametrize("how", sorted(TAKEOVERS))
async def test_a_producer_cannot_take_over_another_producers_fire_and_forget_request_id(acl_server, admin, how):
    # p2 queues "victim" for the consumer groups; p1 deletes, overwrites or expires its rid key and
    # queues "victim" itself. The consumer group must apply p2's record (3 tokens), not p1's.
    from redroll.consumer.runner import ConsumerRunner
    from redroll.shared.scripts import DuplicateRequestError

    ns = "iso" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    p1_s, p2_s, work_s = users(admin, acl_server, ns)
    cons_s = make_user(admin, acl_server, ns, "consumer", group="trainer")
    applied: dict[str, list[int]] = {}
    p1, p2 = connect(p1_s), connect(p2_s)
    try:
        await send(p2_s, p2, [make_request(request_id="victim", prompt="genuine", sampling_params=SP,
                                           callback="apply")])
        refusal, outcome = await _try_takeover(admin, p1, p1_s, keys, how)
        consumer = ConsumerRunner(cons_s, group="trainer", block_ms=100,
                                  handlers={"apply": lambda r: applied.setdefault(r.request_id,
                                                                                  r.output_token_ids[0])})
        async with running(Worker(work_s, SyntheticEngine(), block_ms=100), consumer):
            await wait_until(lambda: "victim" in applied and admin.xlen(keys.requests) == 0, 15)
    finally:
        await p1.aclose()
        await p2.aclose()
    assert len(applied["victim"]) == 3, "the consumer group applied p1's record, not p2's"
    assert isinstance(outcome, DuplicateRequestError), outcome  # p1's submit was refused
    assert refusal is not None
    assert_denied(refusal, p1_s)
    assert dead_letters(admin, keys) == []
    assert not admin.exists(keys.rid("victim"))  # (released by the finish)


async def test_a_producer_cannot_take_over_another_producers_request_id_for_its_reply_stream(acl_server, admin):
    # The same with p2 waiting on its reply stream: p2 gets its own record.
    from redroll.shared.scripts import DuplicateRequestError

    ns = "iso" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    p1_s, p2_s, work_s = users(admin, acl_server, ns)
    async with Producer(p2_s, name="p2", block_ms=100) as p2:
        victim = await p2.submit(request_id="victim", prompt="genuine", sampling_params=SP)
        p1 = connect(p1_s)
        try:
            refusal, outcome = await _try_takeover(admin, p1, p1_s, keys, "delete")
        finally:
            await p1.aclose()
        async with running(Worker(work_s, SyntheticEngine(), block_ms=100)):
            record = await asyncio.wait_for(victim, 15)
            await wait_until(lambda: admin.xlen(keys.requests) == 0, 15)
    assert record.status is RecordStatus.FINISHED and len(record.output_token_ids[0]) == 3
    assert isinstance(outcome, DuplicateRequestError), outcome
    assert refusal is not None
    assert dead_letters(admin, keys) == []


async def test_a_producer_may_create_rid_keys_but_not_overwrite_expire_or_delete_one(acl_server, admin):
    ns = "iso" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    p1_s, _, _ = users(admin, acl_server, ns)
    key = keys.rid("victim")
    admin.set(key, "p2-token 1-1")
    p1 = connect(p1_s)
    try:
        assert await p1.setnx(key, "p1-token 2-2") is False  # create-only: the holder stays
        assert await p1.get(key) == b"p2-token 1-1"
        for command in (("SET", key, "x"), ("SET", key, "x", "NX", "EX", "60"), ("SETEX", key, "1", "x"),
                        ("PSETEX", key, "1", "x"), ("GETSET", key, "x"), ("MSET", key, "x"),
                        ("APPEND", key, "x"), ("SETRANGE", key, "0", "x"), ("INCR", key),
                        ("DEL", key), ("UNLINK", key), ("GETDEL", key), ("RENAME", key, keys.rid("other")),
                        ("EXPIRE", key, "1"), ("EXPIRE", key, "1", "NX"), ("PEXPIRE", key, "1"),
                        ("EXPIREAT", key, "1"), ("PEXPIREAT", key, "1"), ("GETEX", key, "PX", "1"),
                        ("PERSIST", key)):
            with pytest.raises(redis.exceptions.NoPermissionError) as info:
                await p1.execute_command(*command)
            assert_denied(info.value, p1_s)
    finally:
        await p1.aclose()
    assert admin.get(key) == b"p2-token 1-1" and admin.ttl(key) == -1


async def test_housekeeping_releases_the_rid_key_of_a_request_cancelled_while_queued(acl_server, admin):
    # The producer cancels its queued request (record published, entry deleted) but may not delete
    # the rid key: the request_id stays held until a worker's housekeeping releases it.
    from redroll.ops.gc import collect_garbage
    from redroll.shared.scripts import DuplicateRequestError

    ns = "iso" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    p1_s, p2_s, work_s = users(admin, acl_server, ns)
    admin.acl_log_reset()
    async with Producer(p2_s, name="p2", block_ms=100) as p2:
        cancelled = await p2.submit(request_id="cancelled", prompt="c", sampling_params=SP)
        kept = await p2.submit(request_id="kept", prompt="k", sampling_params=SP)
        assert await p2.abort(["cancelled"]) == ["cancelled"]
        assert (await asyncio.wait_for(cancelled, 15)).status is RecordStatus.ABORTED
        assert admin.exists(keys.rid("cancelled"))
        with pytest.raises(DuplicateRequestError):
            await p2.submit(request_id="cancelled", prompt="c", sampling_params=SP)
        p1 = connect(p1_s)
        try:
            assert await p1.setnx(keys.rid("squatted"), "no entry here")  # (a key naming no entry)
        finally:
            await p1.aclose()
        admin.hset(keys.rid("a-hash"), "x", "1")  # (a key of another type is not a rid key to release)

        worker = connect(work_s)
        try:
            dry = await collect_garbage(worker, keys, reply_ttl_s=3600, dry_run=True)
            assert admin.exists(keys.rid("cancelled"), keys.rid("squatted")) == 2
            report = await collect_garbage(worker, keys, reply_ttl_s=3600)
        finally:
            await worker.aclose()
        assert sorted(dry.rid_keys) == sorted(report.rid_keys) == sorted([keys.rid("cancelled"),
                                                                          keys.rid("squatted")])
        assert admin.exists(keys.rid("cancelled"), keys.rid("squatted")) == 0
        assert admin.exists(keys.rid("kept"), keys.rid("a-hash")) == 2  # (its entry is still queued)

        again = await p2.submit(request_id="cancelled", prompt="c", sampling_params=SP)
        async with running(Worker(work_s, SyntheticEngine(), block_ms=100)):
            for fut in (kept, again):
                assert (await asyncio.wait_for(fut, 15)).status is RecordStatus.FINISHED
    assert acl_denials(admin, ns) == []
    assert not admin.exists(keys.rid("kept"), keys.rid("cancelled"))


async def test_a_workers_housekeeping_releases_a_cancelled_requests_rid_key_on_its_own(acl_server, admin):
    ns = "iso" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    _, p2_s, work_s = users(admin, acl_server, ns)
    admin.acl_log_reset()
    async with Producer(p2_s, name="p2", block_ms=100) as p2:
        fut = await p2.submit(request_id="cancelled", prompt="c", sampling_params=SP)
        assert await p2.abort(["cancelled"]) == ["cancelled"]
        assert (await asyncio.wait_for(fut, 15)).status is RecordStatus.ABORTED
        assert admin.exists(keys.rid("cancelled"))
        # (the only live worker: its every round sweeps the rid keys)
        async with running(Worker(work_s.with_(gc_interval_s=0.2), SyntheticEngine(), block_ms=100)):
            await wait_until(lambda: not admin.exists(keys.rid("cancelled")), 15)
            again = await p2.submit(request_id="cancelled", prompt="c", sampling_params=SP)
            assert (await asyncio.wait_for(again, 15)).status is RecordStatus.FINISHED
    assert acl_denials(admin, ns) == []


def test_the_fleet_sweeps_rid_keys_about_once_per_interval():
    from redroll.engine_worker.housekeeping import sweep_share

    assert sweep_share(0) == sweep_share(1) == 1.0 and sweep_share(50) == 0.02
