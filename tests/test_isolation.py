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
