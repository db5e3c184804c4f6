"""Security on a real server: least-privilege ACL users per role (redroll/security/acl.py, docs/acl.md),
authentication errors, password files, TLS with server and client certificates.

Every role runs for real with its own ACL user; the happy path must leave no ACL denial in
``ACL LOG`` (a denied command inside a worker loop would otherwise only be logged and retried),
and forbidden operations fail with NOPERM and a clear one-line message from ``describe_error``.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import redis
import redis.asyncio
import redis.exceptions

from redroll.cli.batch_run import submit_file
from redroll.consumer.runner import ConsumerRunner
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.ops.control import send_abort
from redroll.ops.gc import collect_garbage
from redroll.ops.status import collect_status
from redroll.producer.client import Producer, make_request, send
from redroll.security.acl import ROLES, acl_rules, setuser_args
from redroll.shared.codec import encode_record
from redroll.shared.connection import RedisConfigError, connect, connection_kwargs, describe_error
from redroll.shared.functions import LIBRARY, LIBRARY_SOURCE, FunctionsNotLoadedError
from redroll.shared.keys import WORKERS_GROUP, Keys
from redroll.shared.scripts import Scripts
from redroll.shared.settings import Settings
from redroll.shared.types import CompletionRecord, RecordStatus
from redroll.testing.embedded import RedisServer
from tests.conftest import ROOT, run_until_drained, server_executable, start_test_server, wait_until

ADMIN_PASSWORD = "admin-" + uuid.uuid4().hex
SP = {"max_new_tokens": 4}


# ---------------------------------------------------------------- a server with ACL users


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    """A private server whose ``default`` user is disabled; ``admin`` can do anything."""
    server = start_test_server()
    with redis.Redis(port=server.port) as c:
        c.execute_command("ACL", "SETUSER", "admin", "on", f">{ADMIN_PASSWORD}", "~*", "&*", "+@all")
        c.execute_command("ACL", "SETUSER", "default", "off")
        c.function_load(LIBRARY_SOURCE)  # (the roles may not: an administrator loads it)
    yield server
    server.stop()
    shutil.rmtree(server.directory, ignore_errors=True)


@pytest.fixture
def admin(acl_server: RedisServer) -> Iterator[redis.Redis]:
    with redis.Redis(port=acl_server.port, username="admin", password=ADMIN_PASSWORD) as c:
        yield c


def server_version(admin: redis.Redis) -> str:
    return admin.info("server")["redis_version"]


def make_user(admin: redis.Redis, server: RedisServer, namespace: str, role: str, **kw) -> Settings:
    """An ACL user for ``role`` in ``namespace``; returns the Settings that connect as it."""
    username = f"{role}-{namespace}" + (f"-{kw['producer']}" if kw.get("producer") else "")
    password = uuid.uuid4().hex
    admin.execute_command("ACL", "SETUSER", *setuser_args(username, password, role, namespace,
                                                          server_version=server_version(admin), **kw))
    return Settings(redis_url=server.url, namespace=namespace, redis_username=username, redis_password=password,
                    claim_idle_ms=800, heartbeat_s=0.3, drain_timeout_s=5.0, max_deliveries=3)


def acl_denials(admin: redis.Redis, namespace: str) -> list[dict]:
    return [e for e in admin.acl_log(count=1000) if namespace in str(e.get("username"))]


def assert_denied(exc: BaseException, settings: Settings) -> str:
    """``exc`` is an ACL refusal and describe_error says so on one line, without the password."""
    message = describe_error(exc, settings)
    assert "lacks a permission" in message, message
    assert "\n" not in message
    assert settings.redis_password not in message
    return message


# ---------------------------------------------------------------- the roles, end to end


async def test_every_role_runs_with_only_its_acl_user(acl_server, admin):
    ns = "sec" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    prod_s = make_user(admin, acl_server, ns, "producer", producer="trainer-0")
    work_s = make_user(admin, acl_server, ns, "worker").with_(gc_interval_s=0.3)
    cons_s = make_user(admin, acl_server, ns, "consumer", group="trainer")
    oper_s = make_user(admin, acl_server, ns, "operator")
    admin.acl_log_reset()

    applied: list[tuple[str, str]] = []
    flaky_failures = []

    def handler(record):
        if record.request_id == "ff-flaky" and not flaky_failures:
            flaky_failures.append(1)
            raise RuntimeError("first try fails")
        applied.append((record.request_id, record.status.value))

    def applied_ids() -> set[str]:
        return {rid for rid, _ in applied}

    # A request taken by a worker that then died: the real worker must reclaim it (XPENDING IDLE, XCLAIM).
    async with Producer(prod_s, name="trainer-0", block_ms=100) as p:
        orphan = await p.submit(request_id="orphan-1", prompt="o", sampling_params=SP)
        admin.xgroup_create(keys.requests, WORKERS_GROUP, id="0", mkstream=True)
        assert admin.xreadgroup(WORKERS_GROUP, "ghost-worker", {keys.requests: ">"}, count=1)

        worker = Worker(work_s, SyntheticEngine(token_ms=5), max_inflight=2, block_ms=100)
        consumer = ConsumerRunner(cons_s, group="trainer", handlers={"apply": handler}, block_ms=100,
                                  trim_interval_s=0.2)
        tasks = [asyncio.create_task(worker.run()), asyncio.create_task(consumer.run())]
        try:
            rec = await asyncio.wait_for(orphan, 15)
            assert rec.status is RecordStatus.FINISHED and rec.meta_info["attempt"] == 2

            # Submit and await; fire-and-forget to the consumer group (one callback fails once).
            futs = await p.submit_many([make_request(request_id=f"p-{i}", prompt=f"p{i}", sampling_params=SP)
                                        for i in range(5)])
            recs = await asyncio.wait_for(asyncio.gather(*futs), 15)
            assert all(x.status is RecordStatus.FINISHED for x in recs)
            await send(prod_s, p.redis, [make_request(request_id=x, prompt=x, sampling_params=SP, callback="apply")
                                         for x in ("ff-0", "ff-1", "ff-flaky")])
            await wait_until(lambda: {"ff-0", "ff-1", "ff-flaky"} <= applied_ids(), timeout=15)
            assert flaky_failures == [1]  # handed back (renew.lua), reclaimed (XAUTOCLAIM), applied

            # Abort: two long requests fill the worker; a third and a fire-and-forget one stay queued.
            long_sp = {"max_new_tokens": 2000}
            running = await p.submit_many([make_request(request_id=f"long-{i}", prompt="l", sampling_params=long_sp)
                                           for i in range(2)])
            await wait_until(lambda: worker.inflight_count == 2, timeout=10)
            queued = await p.submit(request_id="queued-1", prompt="q", sampling_params=SP)
            await send(prod_s, p.redis, [make_request(request_id="ff-queued", prompt="q", sampling_params=SP,
                                                      callback="apply")])
            # (queued ones first: aborting the running ones frees the slots they wait for)
            # (no producer writes the results stream: the worker that meets ff-queued publishes its record)
            assert sorted(await p.abort(["queued-1", "ff-queued"])) == ["queued-1"]
            assert await p.abort(["long-0", "long-1"]) == []  # in flight: the worker stops them
            for fut in [queued, *running]:
                assert (await asyncio.wait_for(fut, 15)).status is RecordStatus.ABORTED
            await wait_until(lambda: ("ff-queued", "aborted") in applied, timeout=10)

            # Dead letters from each role: a malformed request (worker), a malformed record on the
            # producer's reply stream (producer) and on the results stream (consumer).
            admin.xadd(keys.requests, {"rid": "poison-1", "data": b"\xc1 not msgpack"})
            admin.xadd(p.reply_to, {"rid": "junk", "status": "finished", "worker": "w", "data": b"\xc1"})
            admin.xadd(keys.results, {"rid": "junk2", "status": "finished", "worker": "w", "data": b"\xc1"})

            def dead_sources() -> set[str]:
                return {f[b"source"].decode() for _i, f in admin.xrange(keys.dead)}

            await wait_until(lambda: {"worker", "producer", "consumer:trainer"} <= dead_sources(), timeout=10)

            # Weight update from the producer: every live worker switches, later records carry it.
            live = await p.update_weights("/ckpt/step-2", "2", timeout=15)
            assert [b["weight_version"] for b in live.values()] == ["2"]
            rec = await asyncio.wait_for(await p.submit(request_id="after-weights", prompt="w", sampling_params=SP), 10)
            assert rec.meta_info["weight_version"] == "2"

            # Status as the read-only operator, in process and through the CLI.
            op = connect(oper_s)
            try:
                status = await collect_status(op, keys)
            finally:
                await op.aclose()
            assert status["workers_alive"] == 1 and status["dead_letters"] >= 3
            cli = await asyncio.to_thread(run_cli, oper_s, "status", "--json")
            assert cli.returncode == 0, cli.stderr
            assert json.loads(cli.stdout)["namespace"] == ns
            await asyncio.sleep(0.5)  # let the worker's own housekeeping loop run at least once more
        finally:
            worker.request_stop()
            consumer.request_stop()
            await asyncio.wait_for(asyncio.gather(*tasks), 20)

        # Housekeeping as the worker: a reply stream of a producer that never came back, a stale
        # heartbeat, idle consumers that own nothing (the ghost and the stopped worker).
        admin.xadd(keys.reply("gone"), {"rid": "x"})
        admin.hset(keys.workers, "old-worker", json.dumps({"seen": 0}))
        w = connect(work_s)
        try:
            report = await collect_garbage(w, keys, reply_ttl_s=0, stale_worker_s=60, idle_consumer_s=0)
        finally:
            await w.aclose()
        assert report.reply_streams == [keys.reply("gone")]
        assert report.heartbeats == ["old-worker"]
        assert set(report.consumers) == {"ghost-worker", worker.name}
        assert admin.exists(p.reply_to)  # a live producer's stream (it has its TTL) is kept

    # Each path ran: reclaim and dead letter in the worker, retry, reclaim, dead letter and trim in the consumer.
    assert worker.stats.reclaimed >= 1 and worker.stats.dead_lettered >= 1
    assert consumer.stats.reclaimed >= 1 and consumer.stats.dead_lettered >= 1 and consumer.stats.trimmed >= 1
    assert acl_denials(admin, ns) == [], "the happy path was refused something"
    assert admin.xlen(keys.requests) == 0


async def test_a_worker_user_steals_overdue_lane_entries(acl_server, admin):
    # claim_lanes.lua skips empty lanes with XLEN: without it in the grant, every other lane looked
    # empty to a worker running as its ACL user, and nothing was ever stolen.
    ns = "sec" + uuid.uuid4().hex[:8]
    keys = Keys(ns, lanes=2)
    work_s = make_user(admin, acl_server, ns, "worker")
    for stream in keys.request_streams:
        admin.xgroup_create(stream, WORKERS_GROUP, id="0", mkstream=True)
    seconds, micros = admin.time()
    past = seconds * 1000 + micros // 1000 - 60_000  # (queued a minute ago: overdue)
    for i in range(3):
        admin.xadd(keys.lane(1), {"rid": f"b-{i}", "ak": "b", "data": b"x"}, id=f"{past}-*")
    admin.acl_log_reset()
    w = connect(work_s)
    try:
        got = await Scripts(w).claim_lanes(high=keys.requests_high, own=[keys.lane(0)], shared=keys.requests,
                                           others=[keys.lane(1)], group=WORKERS_GROUP, consumer="w",
                                           steal_after_ms=10, budget=4)
    finally:
        await w.aclose()
    assert [(stream, kind, len(entries)) for stream, kind, entries in got] == [(keys.lane(1), "stolen", 3)]
    assert acl_denials(admin, ns) == []


async def test_a_worker_user_keeps_the_lane_table_hands_back_and_stops_its_read(acl_server, admin):
    """With affinity lanes a worker's heartbeat is lanes_beat.lua (its heartbeat, the lane table);
    its hand-back raises the stream's hand-back mark; its stop cuts its claim read short (CLIENT
    ID, CLIENT UNBLOCK): each runs as the worker's ACL user."""
    ns = "sec" + uuid.uuid4().hex[:8]
    prod_s = make_user(admin, acl_server, ns, "producer").with_(affinity_lanes=4)
    work_s = make_user(admin, acl_server, ns, "worker").with_(affinity_lanes=4)
    keys = work_s.keys
    admin.acl_log_reset()
    worker = Worker(work_s, SyntheticEngine(token_ms=2), max_inflight=4)  # (its claim reads wait long)
    task = asyncio.create_task(worker.run())
    try:
        await wait_until(lambda: worker.lanes is not None and len(worker.lanes.owned) == 4, 10)
        async with Producer(prod_s, block_ms=100) as p:
            futs = await p.submit_many([make_request(request_id=f"k{i}", prompt="x", sampling_params=SP,
                                                     affinity_key=f"key-{i}") for i in range(8)])
            recs = await asyncio.wait_for(asyncio.gather(*futs), 15)
        assert all(x.status is RecordStatus.FINISHED for x in recs)
        stopped = asyncio.get_running_loop().time()
        worker.request_stop()
        await asyncio.wait_for(task, 10)
        assert asyncio.get_running_loop().time() - stopped < 5  # (its read waits 20 s unless cut short)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 20)
    assert not admin.hexists(keys.workers, worker.name) and admin.zcard(keys.lane_members) == 0
    w = connect(work_s)
    try:  # a hand-back as the worker: the entry's idle time set, the mark raised
        entry = admin.xadd(keys.requests, {"rid": "h", "data": b"x"}).decode()
        admin.xreadgroup(WORKERS_GROUP, "holder", {keys.requests: ">"}, count=1)
        assert await Scripts(w).renew(keys.requests, WORKERS_GROUP, "holder", [entry], idle_ms=60_000,
                                      marks=keys.reclaim_marks) == []
    finally:
        await w.aclose()
    assert admin.zscore(keys.reclaim_marks, keys.requests) == int(entry.split("-")[0])
    assert acl_denials(admin, ns) == []


# ---------------------------------------------------------------- what each role may not do


async def test_partitioned_pipeline_runs_with_role_users_of_its_partitions(acl_server, admin):
    """With --partitions 3 the roles' rules grant the partition tags {ns:0}..{ns:2}: every role
    works, and none can reach another namespace's partitions."""
    ns = "secp" + uuid.uuid4().hex[:8]
    users = {role: make_user(admin, acl_server, ns, role, partitions=3).with_(partitions=3)
             for role in ("producer", "worker", "consumer", "operator")}
    admin.acl_log_reset()
    applied: list[str] = []
    worker = Worker(users["worker"], SyntheticEngine(token_ms=1), max_inflight=8, block_ms=100)
    consumer = ConsumerRunner(users["consumer"], group="trainer", handlers={"apply": lambda r: applied.append(r.request_id)},
                              block_ms=100)
    tasks = [asyncio.create_task(worker.run())]
    try:
        async with Producer(users["producer"], block_ms=100) as p:
            futs = await p.submit_many([make_request(request_id=f"p-{i}", prompt=f"p{i}", sampling_params=SP)
                                        for i in range(30)])
            assert all(r.status is RecordStatus.FINISHED for r in await asyncio.wait_for(asyncio.gather(*futs), 15))
            await send(users["producer"], p.redis, [make_request(request_id=f"c-{i}", prompt="c", sampling_params=SP,
                                                                 callback="apply") for i in range(30)])
            # a burst consumer with the consumer's ACL user: it may ask the request streams' groups
            # (XINFO GROUPS) whether a record is still to come, and stops once none is
            await run_until_drained(consumer, timeout=30)
            assert sorted(applied) == sorted(f"c-{i}" for i in range(30))
            parts = users["producer"].partition_keys
            assert all(admin.xlen(part.results) >= 0 for part in parts)
            assert sum(admin.exists(part.requests) for part in parts) == 3  # every partition was used
            # Another namespace's partition is out of reach.
            with pytest.raises(redis.exceptions.NoPermissionError):
                await p.redis.xadd("{other:0}:requests", {"data": b"x"})
        op = connect(users["operator"])
        try:
            from redroll.ops.status import collect_pipeline_status
            status = await collect_pipeline_status(op, users["operator"].keys, users["operator"].partition_keys)
        finally:
            await op.aclose()
        assert len(status["partitions"]) == 3 and status["requests"]["backlog"] == 0
    finally:
        worker.request_stop()
        consumer.request_stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
    denials = [e for e in acl_denials(admin, ns) if "other:0" not in str(e.get("object"))]
    assert denials == [], denials


async def test_forbidden_operations_fail_with_a_clear_error(acl_server, admin):
    ns = "sec" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    other = Settings(namespace="other" + uuid.uuid4().hex[:6]).keys
    users = {role: make_user(admin, acl_server, ns, role) for role in ("worker", "consumer", "operator")}
    users["producer"] = make_user(admin, acl_server, ns, "producer", producer="trainer-0")
    admin.xgroup_create(keys.requests, WORKERS_GROUP, id="0", mkstream=True)
    admin.xgroup_create(keys.results, "trainer", id="0", mkstream=True)
    admin.xadd(keys.results, {"rid": "r1", "status": "finished", "data": b""})

    forbidden = {
        "producer": [
            ("XACK", keys.requests, WORKERS_GROUP, "0-1"),                           # ack work it did not do
            ("XREADGROUP", "GROUP", WORKERS_GROUP, "p", "STREAMS", keys.requests, ">"),  # take requests
            ("XREADGROUP", "GROUP", "trainer", "p", "STREAMS", keys.results, ">"),  # read a consumer group
            ("XREADGROUP", "GROUP", "producer", "p", "STREAMS", keys.reply("trainer-1"), ">"),  # another producer
            ("DEL", keys.requests), ("XTRIM", keys.results, "MAXLEN", "0"),        # delete or trim
            ("XADD", other.requests, "*", "rid", "x"),                              # another namespace
            ("HSET", keys.workers, "fake", "{}"), ("FLUSHALL",), ("KEYS", "*"),
        ],
        "consumer": [
            ("XADD", keys.requests, "*", "rid", "x"),                               # enqueue requests
            ("XACK", keys.requests, WORKERS_GROUP, "0-1"), ("XADD", keys.control, "*", "kind", "drain"),
            ("DEL", keys.results), ("HGETALL", keys.workers), ("SMISMEMBER", f"{other.tag}:applied:x:1", "a"),
        ],
        "worker": [
            ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "SET", "appendonly", "no"), ("CONFIG", "GET", "*"),
            ("ACL", "LIST"), ("KEYS", "*"), ("SCRIPT", "FLUSH"), ("SHUTDOWN",),
            ("XADD", keys.requests, "*", "rid", "x"), ("XADD", keys.control, "*", "kind", "drain"),
            ("DEL", keys.requests), ("ZADD", keys.aborted, "1", "r:x"), ("HSET", keys.weights, "v", "9"),
            ("XRANGE", keys.dead, "-", "+"), ("XREADGROUP", "GROUP", "trainer", "w", "STREAMS", keys.results, ">"),
        ],
        "operator": [
            ("XADD", keys.control, "*", "kind", "drain"), ("HSET", keys.weights, "v", "9"), ("DEL", keys.dead),
            ("XREADGROUP", "GROUP", "trainer", "o", "STREAMS", keys.results, ">"), ("XLEN", other.requests),
            ("EVAL", "return 1", "0"), ("KEYS", "*"),
        ],
    }
    # No role runs Lua of its own (a busy loop would block the server): only the library's functions.
    own_lua = [("EVAL", "return 1", "0"), ("EVAL_RO", "return 1", "0"), ("SCRIPT", "LOAD", "return 1"),
               ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "0"), ("SCRIPT", "FLUSH"),
               ("FUNCTION", "LOAD", "#!lua name=mine\nredis.register_function('spin', function() while true do end end)"),
               ("FUNCTION", "DELETE", LIBRARY), ("FUNCTION", "FLUSH")]
    for role in ("producer", "worker", "consumer"):
        forbidden[role] += own_lua
    for role, commands in forbidden.items():
        settings = users[role]
        client = connect(settings)
        try:
            assert await client.ping()
            for command in commands:
                with pytest.raises(redis.exceptions.NoPermissionError) as info:
                    await client.execute_command(*command)
                assert_denied(info.value, settings)
        finally:
            await client.aclose()

    # Inside a Lua script the commands are checked too: the worker holds the keys of the submit
    # script (it releases rid keys) but may not XADD a request, so the script fails, clearly.
    w = connect(users["worker"])
    try:
        with pytest.raises(redis.ResponseError) as info:
            await Scripts(w).submit(keys.requests, keys.rid("x"), "tok", "x", None, b"\x80", 60)
        message = assert_denied(info.value, users["worker"])
        assert "script" in message
        # ... and a consumer may not even name the request stream to a script.
        c = connect(users["consumer"])
        try:
            with pytest.raises(redis.exceptions.NoPermissionError) as info:
                await Scripts(c).submit(keys.requests, keys.rid("x"), "tok", "x", None, b"\x80", 60)
            assert_denied(info.value, users["consumer"])
        finally:
            await c.aclose()
    finally:
        await w.aclose()
    assert admin.xlen(keys.requests) == 0 and not admin.exists(keys.rid("x"))

    # The library calls surface the same error: an operator cannot abort.
    op = connect(users["operator"])
    try:
        with pytest.raises(redis.exceptions.NoPermissionError) as info:
            await send_abort(op, keys, ["x"])
        assert_denied(info.value, users["operator"])
    finally:
        await op.aclose()

    # ... and the command line prints that one line and exits 1.
    proc = await asyncio.to_thread(run_cli, users["operator"], "abort", "some-request")
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("redroll abort: redis at redis://127.0.0.1:") and "lacks a permission" in line, line
    assert users["operator"].redis_password not in proc.stderr


async def test_a_role_meets_a_missing_library_with_the_command_to_run(acl_server, admin):
    ns = "sec" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    settings = make_user(admin, acl_server, ns, "producer")
    admin.function_delete(LIBRARY)
    try:
        p = connect(settings)
        try:
            with pytest.raises(FunctionsNotLoadedError) as info:
                await send(settings, p, [make_request(request_id="x", prompt="x", sampling_params=SP)])
        finally:
            await p.aclose()
        message = assert_denied(info.value, settings)
        assert "redroll functions load" in message and LIBRARY in message
        assert admin.xlen(keys.requests) == 0
        # ... which an administrator runs (here with the admin user), once: the role's submit then works.
        admin_s = Settings(redis_url=acl_server.url, namespace=ns, redis_username="admin",
                           redis_password=ADMIN_PASSWORD)
        for action, expected in (("show", "not loaded"), ("load", "loaded on"), ("load", "already loaded"),
                                 ("show", f"{LIBRARY}: loaded")):
            proc = await asyncio.to_thread(run_cli, admin_s, "functions", action)
            assert proc.returncode == 0 and expected in proc.stdout, proc.stderr
        p = connect(settings)
        try:
            assert len(await send(settings, p, [make_request(request_id="x", prompt="x", sampling_params=SP)])) == 1
        finally:
            await p.aclose()
    finally:
        if not admin.function_list(library=LIBRARY):
            admin.function_load(LIBRARY_SOURCE)


async def test_submit_and_its_resume_run_with_the_producer_user(acl_server, admin, tmp_path):
    ns = "sec" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    prod_s = make_user(admin, acl_server, ns, "producer")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"request_id": x, "prompt": "x"}) + "\n" for x in ("a", "b")))
    admin.acl_log_reset()
    assert await submit_file(prod_s, str(src), wait=True, out=str(out), progress=False, timeout=0.3) == 3  # (no worker)
    producer = json.loads((tmp_path / "out.jsonl.run").read_text())["producer"]
    # the record of "a" reaches the reply stream while nothing reads it (as a worker writes it)
    admin.xadd(keys.reply(producer), encode_record(CompletionRecord(
        request_id="a", status=RecordStatus.FINISHED, output_token_ids=[[1]], finish_reasons=["length"])))
    assert await submit_file(prod_s, str(src), wait=True, out=str(out), progress=False, timeout=0.3,
                             resume=True) == 3  # ("b" is still queued)
    assert [json.loads(line)["request_id"] for line in out.read_text().splitlines()] == ["a"]
    assert admin.xlen(keys.reply(producer)) == 0 and admin.xlen(keys.requests) == 2  # (taken over: not sent again)
    assert acl_denials(admin, ns) == []


def test_rule_lines_are_what_the_docs_show():
    doc = (ROOT / "docs" / "acl.md").read_text()
    for role in ROLES:
        assert acl_rules(role) in doc, f"docs/acl.md does not show the current {role} rules"


# ---------------------------------------------------------------- authentication


async def _refused(settings: Settings, error: type[Exception] = redis.ConnectionError) -> str:
    """The one-line description of the ``error`` a client with these settings meets on PING."""
    client = one_attempt_client(settings)
    try:
        with pytest.raises(error) as info:
            await client.ping()
    finally:
        await client.aclose()
    message = describe_error(info.value, settings)
    assert "\n" not in message, message
    return message


async def test_wrong_password_and_no_credentials_are_refused_clearly(acl_server, admin):
    ns = "sec" + uuid.uuid4().hex[:8]
    good = make_user(admin, acl_server, ns, "operator")
    for settings in (good.with_(redis_password="not-the-password"),
                     good.with_(redis_username=None, redis_password=None),   # default user is off
                     good.with_(redis_username="nobody")):
        message = await _refused(settings, redis.AuthenticationError)
        assert "refused authentication" in message, message
        assert "not-the-password" not in message


async def test_password_from_file(acl_server, admin, tmp_path):
    ns = "sec" + uuid.uuid4().hex[:8]
    good = make_user(admin, acl_server, ns, "operator")
    secret = tmp_path / "redis-password"
    secret.write_text(good.redis_password + "\n")
    settings = good.with_(redis_password=None, redis_password_file=str(secret))
    client = connect(settings)
    try:
        assert await client.ping()
        assert await client.xlen(settings.keys.requests) == 0
    finally:
        await client.aclose()
    missing = settings.with_(redis_password_file=str(tmp_path / "nope"))
    with pytest.raises(RedisConfigError) as info:
        connect(missing)
    assert "cannot read redis password file" in describe_error(info.value, missing)


# ---------------------------------------------------------------- TLS


def _certificates(directory: Path) -> dict[str, str]:
    """A self-signed CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, key, cert) -> None:
        (directory / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()))
        (directory / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("redroll test CA")).issuer_name(name("redroll test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    write("ca", ca_key, ca)
    for stem, usage, san in (("server", ExtendedKeyUsageOID.SERVER_AUTH,
                              [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                             ("client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("redroll-client")])):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(f"redroll test {stem}")).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .add_extension(x509.SubjectAlternativeName(san), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256()))
        write(stem, key, cert)
    return {stem: str(directory / stem) for stem in ("ca", "server", "client")}


class TlsServer:
    """A server listening on TLS only (``--port 0``): start_redis_server with a TLS readiness
    probe (its plain-text PING cannot reach it)."""

    def __init__(self, certs: dict[str, str], auth_clients: str, directory: Path):
        context = ssl.create_default_context(cafile=certs["ca"] + ".crt")
        context.load_cert_chain(certs["client"] + ".crt", certs["client"] + ".key")

        def answers_tls_ping(port: int) -> bool:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as raw, \
                        context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(64).startswith(b"+PONG")
            except OSError:
                return False

        self.server = start_test_server(
            "--logfile", str(directory / "server.log"),
            "--tls-cert-file", certs["server"] + ".crt", "--tls-key-file", certs["server"] + ".key",
            "--tls-ca-cert-file", certs["ca"] + ".crt", "--tls-auth-clients", auth_clients,
            directory=str(directory), port_option="--tls-port", ready=answers_tls_ping)
        self.port = self.server.port

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def certs() -> Iterator[dict[str, str]]:
    directory = Path(tempfile.mkdtemp(prefix="redroll-certs-"))
    yield _certificates(directory)
    shutil.rmtree(directory, ignore_errors=True)


def _server_has_tls() -> str | None:
    """None when the server under test was built with TLS, else why not."""
    exe = server_executable()
    proc = subprocess.run([exe, "--port", "0", "--tls-port", "0"], capture_output=True, text=True, timeout=10)
    out = proc.stdout + proc.stderr
    if "tls-port" in out and ("Bad directive" in out or "unsupported" in out.lower()):
        return f"{exe} was built without TLS support: {out.strip().splitlines()[-1]}"
    return None


@pytest.fixture
def tls_server(certs, tmp_path, request) -> Iterator[TlsServer]:
    reason = _server_has_tls()
    if reason:
        pytest.skip(reason)
    server = TlsServer(certs, request.param, tmp_path)
    yield server
    server.stop()


async def _round_trip(settings: Settings, n: int = 5) -> None:
    worker = Worker(settings, SyntheticEngine(), block_ms=100)
    task = asyncio.create_task(worker.run())
    try:
        async with Producer(settings, block_ms=100) as p:
            futs = await p.submit_many([make_request(request_id=f"tls-{i}", prompt=f"t{i}", sampling_params=SP)
                                        for i in range(n)])
            recs = await asyncio.wait_for(asyncio.gather(*futs), 15)
        assert [r.status for r in recs] == [RecordStatus.FINISHED] * n
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 15)


@pytest.mark.parametrize("tls_server", ["optional"], indirect=True)
async def test_tls_round_trip_and_untrusted_server_is_refused(tls_server, certs):
    settings = Settings(redis_url=tls_server.url, namespace="tls" + uuid.uuid4().hex[:8],
                        tls_ca_file=certs["ca"] + ".crt")
    await _round_trip(settings)
    # Without the CA that signed the server certificate the client refuses the server, clearly.
    message = await _refused(settings.with_(tls_ca_file=None))
    assert "certificate" in message.lower() and "REDROLL_TLS_CA_FILE" in message, message
    # Plain redis:// to a TLS-only port fails too (the server only speaks TLS there).
    message = await _refused(settings.with_(redis_url=f"redis://127.0.0.1:{tls_server.port}/0"))
    assert message.startswith(f"cannot reach redis at redis://127.0.0.1:{tls_server.port}/0"), message


@pytest.mark.parametrize("tls_server", ["yes"], indirect=True)
async def test_tls_client_certificate_authentication(tls_server, certs):
    settings = Settings(redis_url=tls_server.url, namespace="tls" + uuid.uuid4().hex[:8],
                        tls_ca_file=certs["ca"] + ".crt", tls_cert_file=certs["client"] + ".crt",
                        tls_key_file=certs["client"] + ".key")
    await _round_trip(settings, n=3)
    # A client with the CA but no certificate of its own is turned away.
    message = await _refused(settings.with_(tls_cert_file=None, tls_key_file=None))
    # (the server's "certificate required" alert, or the reset that follows it, whichever arrives first)
    assert (message.startswith(f"redis at {tls_server.url} requires a TLS client certificate")
            or message.startswith(f"cannot reach redis at {tls_server.url}")), message


# ---------------------------------------------------------------- helpers


def one_attempt_client(settings: Settings) -> redis.asyncio.Redis:
    """A client with the connection settings of ``connect(settings)`` that tries once: connect()
    retries connection errors with backoff, and redis-py counts a refused login or a missing TLS
    client certificate as one, so the error would surface only after 3-20 s."""
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return redis.asyncio.Redis.from_url(settings.redis_url, retry=Retry(NoBackoff(), 0), **connection_kwargs(settings))


def run_cli(settings: Settings, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDROLL_")}
    env.update(REDROLL_REDIS_URL=settings.redis_url, REDROLL_NAMESPACE=settings.namespace,
               REDROLL_REDIS_USERNAME=settings.redis_username or "",
               REDROLL_REDIS_PASSWORD=settings.redis_password or "", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "redroll.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def test_rules_options_and_escaping():
    assert "+client|setinfo" in acl_rules("worker") and "+client|setinfo" not in acl_rules("worker",
                                                                                          server_version="7.0.15")
    assert "+client|setinfo" in acl_rules("worker", server_version="7.2.4")
    odd = acl_rules("producer", "a*b?", producer="p[1]")
    assert "~{a\\*b\\?}:requests " in odd and "~{a\\*b\\?}:reply:p\\[1\\] " in odd and "reply:*" not in odd
    assert "~{redroll}:applied:trainer:*)" in acl_rules("consumer", group="trainer")
    with pytest.raises(ValueError, match="unknown role"):
        acl_rules("admin")
